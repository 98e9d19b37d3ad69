"""Exceptions of the trace package, rooted in :class:`envport.errors.EnvportError`.

::

    EnvportError
    ├── TraceStoreError            the store cannot be opened, migrated or written
    │   ├── TraceStoreLockedError  another process held the store locked too long
    │   └── TraceNotFoundError     no trace (or run) with this id
    └── TraceFormatError           a file being imported is not valid traces
                                   (names the file and the line or row)
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from envport.errors import EnvportError


def short_validation_error(exc: ValidationError) -> str:
    """A pydantic error on one line: the first problem's field and message, and a count."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(trace)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


class TraceStoreError(EnvportError):
    """The trace store cannot be opened, migrated, read or written."""


class TraceStoreLockedError(TraceStoreError):
    """Another process kept the store locked past the store's busy timeout."""


class TraceNotFoundError(TraceStoreError, LookupError):
    """No trace (or run) is stored under this id."""


class TraceFormatError(EnvportError, ValueError):
    """An imported file holds something that is not a valid trace.

    ``location`` is ``"path:line"`` for JSONL and ``"path:row"`` for Parquet.
    """

    def __init__(self, message: str, *, location: str, **details: Any) -> None:
        super().__init__(f"{location}: {message}", location=location, **details)
        self.location = location
