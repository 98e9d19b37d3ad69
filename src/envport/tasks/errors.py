"""Errors of the tasks package, rooted in :class:`envport.errors.EnvportError`.

::

    EnvportError
    └── TasksetError                  a taskset could not be loaded or queried
        ├── TaskFileError             a bad task file: names the file, line and field
        ├── UnknownTasksetError       a spec that names no taskset (lists what exists)
        ├── TaskNotFoundError         Taskset.get() with an unknown id (suggests one)
        └── MissingDependencyError    an optional extra is not installed
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from pathlib import Path

from envport.errors import EnvportError, ErrorCode


class TasksetError(EnvportError):
    """A taskset could not be loaded or queried."""

    code = ErrorCode.VALIDATION_ERROR


class TaskFileError(TasksetError, ValueError):
    """A task file is malformed. ``line`` (1-based) and ``field`` are set when known.

    ``str()`` reads ``path:line: field: message``, the form editors and CI logs link.
    """

    def __init__(self, path: str | Path, line: int | None, field: str | None, message: str) -> None:
        where = str(path) + (f":{line}" if line is not None else "")
        what = f"{field}: " if field else ""
        super().__init__(f"{where}: {what}{message}", path=str(path), line=line, field=field)
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = message


#: A byte that was not UTF-8, as ``errors="surrogateescape"`` decodes it.
_ESCAPED_BYTE = re.compile(r"[\udc80-\udcff]")


def read_text(path: Path) -> str:
    """A text file as UTF-8 (a leading BOM dropped, newlines made ``\\n``), with any byte
    that is not UTF-8 kept as a lone surrogate for :func:`check_utf8` to report."""
    return path.read_text(encoding="utf-8-sig", errors="surrogateescape")


def check_utf8(
    path: str | Path, text: str, *, line: int | None = None, field: str | None = None
) -> None:
    """Raise :class:`TaskFileError` at the first byte of ``text`` that was not UTF-8.

    ``text`` was decoded with ``errors="surrogateescape"`` (see :func:`read_text`). It is
    one line (number ``line``) or, when ``line`` is None, a whole file.
    """
    bad = _ESCAPED_BYTE.search(text)
    if bad is None:
        return
    start = text.rfind("\n", 0, bad.start()) + 1
    if line is None:
        line = text.count("\n", 0, start) + 1
    byte = ord(bad.group()) - 0xDC00
    raise TaskFileError(
        path,
        line,
        field,
        f"not UTF-8 text: byte 0x{byte:02x} at column {bad.start() - start + 1} "
        "(task files are UTF-8; save it as UTF-8)",
    )


class UnknownTasksetError(TasksetError, LookupError):
    """A taskset spec that resolves to nothing; lists the known names."""

    def __init__(self, spec: str, reason: str, known: Iterable[str] = ()) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(spec.split(":", 1)[-1], known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listing = f" Known: {', '.join(known)}." if known else ""
        super().__init__(f"Cannot load taskset {spec!r}: {reason}.{hint}{listing}", spec=spec)
        self.spec = spec


class TaskNotFoundError(TasksetError, LookupError):
    """No task with this id in the taskset."""

    def __init__(self, task_id: str, known: Iterable[str]) -> None:
        close = difflib.get_close_matches(task_id, list(known), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        super().__init__(f"No task with id {task_id!r}.{hint}", task_id=task_id)
        self.suggestion = close[0] if close else None


class MissingDependencyError(TasksetError, ImportError):
    """A loader needs an optional extra that is not installed."""

    def __init__(self, package: str, extra: str, what: str) -> None:
        super().__init__(
            f"{what} needs the {package!r} package, which is not installed. "
            f"Install it with: pip install 'envport[{extra}]'",
            package=package,
            extra=extra,
        )
