"""envport: the environment layer for agentic RL.

The public surface is small and pinned by a test (tests/test_public_api.py).
"""

from envport.env import Env, EnvStatus, TimeLimit, Wrapper
from envport.errors import EnvportError, ErrorCode
from envport.registry import make, register, registered
from envport.tools import tool
from envport.types import Action, EnvMetadata, Observation, State, StepResult, ToolSpec

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Env",
    "EnvMetadata",
    "EnvStatus",
    "EnvportError",
    "ErrorCode",
    "Observation",
    "State",
    "StepResult",
    "TimeLimit",
    "ToolSpec",
    "Wrapper",
    "__version__",
    "make",
    "register",
    "registered",
    "tool",
]
