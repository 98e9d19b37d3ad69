"""Errors of the rubrics package, rooted in :class:`envport.errors.EnvportError`.

::

    EnvportError
    └── RubricError                  scoring could not be set up, or a component failed
        ├── RubricBuildError         a rubric that cannot be built: unknown parameter
        │                            name, unknown type, bad params (raised at build time)
        ├── NotSupportedError        the environment handle cannot do this (run, read_file)
        ├── CommandError             a command could not run in the environment
        │   └── CommandTimeoutError  it ran past its deadline and was killed
        └── JudgeError               the LLM judge failed or its verdict is unreadable

Build errors are raised to the caller: a rubric that cannot be built is a bug in the
task or the code. Everything raised while *scoring* is caught by
:meth:`~envport.rubrics.rubric.Rubric.score` and recorded on the trace as a
:class:`~envport.trace.model.TraceError` of kind ``rubric``, never scored 0.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from envport.errors import EnvportError, ErrorCode


class RubricError(EnvportError):
    """Scoring could not be set up, or a rubric component failed."""

    code = ErrorCode.EXECUTION_ERROR


class RubricBuildError(RubricError, ValueError):
    """A rubric that cannot be built (raised when it is built, not when it scores)."""

    code = ErrorCode.VALIDATION_ERROR


class UnknownRubricTypeError(RubricBuildError, LookupError):
    """A rubric spec names a type nobody registered; lists the known ones."""

    def __init__(self, type_name: str, known: Iterable[str]) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(type_name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        super().__init__(
            f"Unknown rubric type {type_name!r}.{hint} Known types: {', '.join(known)}. "
            "Register others with envport.rubrics.register().",
            type=type_name,
        )
        self.suggestion = close[0] if close else None


class NotSupportedError(RubricError, NotImplementedError):
    """The environment handle cannot do what a reward function asked of it."""


class CommandError(RubricError):
    """A command could not run in the environment (not found, not executable, …)."""


class CommandTimeoutError(CommandError, TimeoutError):
    """A command ran past its deadline; it (and its process group) was killed."""

    code = ErrorCode.TIMEOUT


class JudgeError(RubricError):
    """The LLM judge's endpoint failed, or its reply held no readable verdict."""
