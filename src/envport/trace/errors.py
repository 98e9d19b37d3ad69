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

from envport.errors import EnvportError


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
