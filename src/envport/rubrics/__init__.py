"""Rubrics: how a run is scored.

A reward function is any callable, sync or async, that names what it needs —
``task``, ``trace``, ``observation``, ``completion``, ``answer``, ``state``, ``env``,
``reference``, ``metadata``, ``params`` — and returns a number or a :class:`Score`
(``functions.py``). A :class:`Rubric` scores weighted functions together; weight 0 makes
a metric; a function that raises is recorded as an error and leaves the run unscored,
never scored 0 (``rubric.py``). Reward functions inspect the environment through an
:class:`EnvHandle` (``context.py``). Built-in types — ``exact_match``,
``numeric_match``, ``regex``, ``env_reward``, ``test_command``, ``llm_judge`` — are
built from a task's rubric specs by :func:`from_specs` (``builtin.py``)::

    from envport.rubrics import Rubric, ScoringContext, from_specs

    rubric = from_specs(task.rubric)               # or Rubric([RewardFunc(fn, 1.0)])
    result = await rubric.score(ScoringContext(trace=trace, task=task))
    result.apply(trace)                            # rewards, total, metrics, errors
"""

from envport.rubrics.builtin import (
    JUDGE_PROMPT,
    build,
    from_specs,
    parse_verdict,
    register,
    registered_types,
)
from envport.rubrics.context import (
    ClientHandle,
    CommandResult,
    EnvHandle,
    LocalDirHandle,
    ScoringContext,
    extract_answer,
)
from envport.rubrics.errors import (
    CommandError,
    CommandTimeoutError,
    JudgeError,
    NotSupportedError,
    RubricBuildError,
    RubricError,
    UnknownRubricTypeError,
)
from envport.rubrics.functions import PARAMETERS, RewardFn, Score, set_reward_threads
from envport.rubrics.rubric import (
    RewardFunc,
    Rubric,
    RubricResult,
    group_advantages,
    trace_advantages,
)

__all__ = [
    "JUDGE_PROMPT",
    "PARAMETERS",
    "ClientHandle",
    "CommandError",
    "CommandResult",
    "CommandTimeoutError",
    "EnvHandle",
    "JudgeError",
    "LocalDirHandle",
    "NotSupportedError",
    "RewardFn",
    "RewardFunc",
    "Rubric",
    "RubricBuildError",
    "RubricError",
    "RubricResult",
    "Score",
    "ScoringContext",
    "UnknownRubricTypeError",
    "build",
    "extract_answer",
    "from_specs",
    "group_advantages",
    "parse_verdict",
    "register",
    "registered_types",
    "set_reward_threads",
    "trace_advantages",
]
