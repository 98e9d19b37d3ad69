"""Loaders: JSONL files, Hugging Face datasets, Harbor task dirs, Python tasksets.

:func:`load` picks one from a spec string:

==============================  =============================================
spec                            loader
==============================  =============================================
``tasks.jsonl``                 :func:`load_jsonl`
``dir/`` with ``task.toml``     :func:`load_harbor` (one task, or a dir of task dirs)
``data.parquet``, ``.arrow``    :func:`load_hf`
``hf:PATH`` or ``hf:PATH#test`` :func:`load_hf` (a local file or dir; ``#`` names a split)
``builtin:arithmetic``          a taskset shipped with envport
``entrypoint:NAME``             a Taskset registered in the ``envport.tasksets`` group
``package.module:Class``        a Taskset subclass (or instance, or factory) by path
==============================  =============================================

Every loader returns a lazy :class:`~envport.tasks.taskset.Taskset`: files are opened
and rows turned into tasks as they are iterated, and opened again on the next iteration.
Bad input raises :class:`~envport.tasks.errors.TaskFileError` naming the file, the line
(or row) and the field, when the bad task is reached.

JSONL is envport's own format (one :class:`Task` per line, unknown keys are errors);
datasets are foreign, so their unknown columns go to ``metadata``. Both take ``columns``
(rename source keys to Task fields; ``None`` drops a key) and ``defaults`` (fields for
tasks that do not set them, e.g. ``{"env_id": "arithmetic-v1"}``).
"""

from __future__ import annotations

import csv
import importlib
import json
import re
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from importlib.resources import files as package_files
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from envport.tasks.errors import (
    MissingDependencyError,
    TaskFileError,
    UnknownTasksetError,
    check_utf8,
)
from envport.tasks.harbor import harbor_task_dirs, is_harbor_task, read_harbor_task
from envport.tasks.task import Task
from envport.tasks.taskset import Taskset

ENTRY_POINT_GROUP = "envport.tasksets"

_TASK_FIELDS = frozenset(Task.model_fields)
_HF_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
_MODULE_ATTR = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


# --- rows to tasks ------------------------------------------------------------------


def _check_columns(columns: Mapping[str, str | None] | None) -> dict[str, str | None]:
    columns = dict(columns or {})
    bad = sorted(t for t in columns.values() if t is not None and t not in _TASK_FIELDS)
    if bad:
        raise ValueError(
            f"columns maps to unknown Task field(s) {bad}; fields: {sorted(_TASK_FIELDS)}"
        )
    return columns


def _check_defaults(defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    defaults = dict(defaults or {})
    bad = sorted(set(defaults) - _TASK_FIELDS)
    if bad:
        raise ValueError(
            f"defaults has unknown Task field(s) {bad}; fields: {sorted(_TASK_FIELDS)}"
        )
    return defaults


def _row_fields(
    row: Mapping[str, Any],
    *,
    columns: Mapping[str, str | None],
    defaults: Mapping[str, Any],
    unknown: Literal["forbid", "metadata"],
    drop_none: bool,
) -> dict[str, Any]:
    data: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in row.items():
        target = columns.get(key, key)
        if target is None or (drop_none and value is None):
            continue
        if target in _TASK_FIELDS or unknown == "forbid":
            data[target] = value  # an unknown key is reported by validation
        else:
            extra[key] = value
    if extra:
        metadata = data.get("metadata")
        data["metadata"] = {**extra, **metadata} if isinstance(metadata, dict) else extra
    for key, value in defaults.items():
        data.setdefault(key, value)
    return data


_UNION_TAG = re.compile(r"\[|^str$")


def _field_path(loc: tuple[int | str, ...]) -> str:
    """``("prompt", "tuple[...]", 0, "role")`` → ``prompt[0].role`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _UNION_TAG.search(part):
            continue
        elif part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


def _validation_to_file_error(
    exc: ValidationError, path: str | Path, line: int | None, prefix: str = ""
) -> TaskFileError:
    errors = exc.errors()
    # A union reports each member; a "not a string" error beside others is noise.
    meaningful = [e for e in errors if not (e["type"] == "string_type" and e["loc"][-1] == "str")]
    errors = meaningful or errors
    described: list[tuple[str, str]] = []
    for err in errors:
        msg = err["msg"]
        if err["type"] not in ("missing", "extra_forbidden") and "input" in err:
            shown = repr(err["input"])
            msg += f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
        described.append((_field_path(err["loc"]), msg))
    field, message = described[0]
    if len(described) > 1:
        rest = "; ".join(f"{f}: {m}" for f, m in described[1:4])
        more = f" (+{len(described) - 4} more)" if len(described) > 4 else ""
        message += f" (also {rest}{more})"
    return TaskFileError(path, line, field or None, prefix + message)


# --- JSONL --------------------------------------------------------------------------


def load_jsonl(
    path: str | Path,
    *,
    columns: Mapping[str, str | None] | None = None,
    defaults: Mapping[str, Any] | None = None,
    name: str | None = None,
    invalid: list[TaskFileError] | None = None,
) -> Taskset:
    """One task per line of a JSONL file (blank lines are skipped).

    Keys are Task fields (after ``columns`` renames them); an unknown key, bad JSON, an
    invalid field or an id already used on an earlier line raise
    :class:`TaskFileError` with the line number. With ``invalid`` (a list), each bad
    line's error is appended to it instead, and the lines after it are still read (a
    batch run records each as a failed run of its own). Relative ``files`` sources
    resolve against the file's directory.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(path, None, None, "no such file")
    cols = _check_columns(columns)
    defs = _check_defaults(defaults)
    return Taskset(lambda: _read_jsonl(path, cols, defs, invalid), name=name or path.stem)


def _read_jsonl(
    path: Path,
    columns: Mapping[str, str | None],
    defaults: Mapping[str, Any],
    invalid: list[TaskFileError] | None = None,
) -> Iterator[Task]:
    root = str(path.parent.resolve())
    seen: dict[str, int] = {}
    # utf-8-sig drops a leading BOM; surrogateescape turns bytes that are not UTF-8 into
    # lone surrogates, so a bad byte fails its own line (below), not the whole file.
    with path.open(encoding="utf-8-sig", errors="surrogateescape") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                check_utf8(path, text, line=number)
                task = _jsonl_task(path, number, text, columns, defaults, root, seen)
            except TaskFileError as exc:
                if invalid is None:
                    raise
                invalid.append(exc)
                continue
            seen[task.id] = number
            yield task


def _jsonl_task(
    path: Path,
    number: int,
    text: str,
    columns: Mapping[str, str | None],
    defaults: Mapping[str, Any],
    root: str,
    seen: Mapping[str, int],
) -> Task:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskFileError(
            path, number, None, f"invalid JSON: {exc.msg} (column {exc.colno})"
        ) from exc
    if not isinstance(row, dict):
        raise TaskFileError(path, number, None, f"expected a JSON object, got {type(row).__name__}")
    data = _row_fields(row, columns=columns, defaults=defaults, unknown="forbid", drop_none=False)
    data.setdefault("source", f"{path}:{number}")
    data.setdefault("root", root)
    try:
        task = Task.model_validate(data)
    except ValidationError as exc:
        raise _validation_to_file_error(exc, path, number) from exc
    if task.id in seen:
        raise TaskFileError(
            path, number, "id", f"duplicate id {task.id!r} (first on line {seen[task.id]})"
        )
    return task


# --- Hugging Face datasets ----------------------------------------------------------


def _import_datasets() -> Any:
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError as exc:
        raise MissingDependencyError(
            "datasets", "datasets", "Loading Hugging Face datasets"
        ) from exc
    return datasets


def load_hf(
    path: str | Path,
    split: str | None = None,
    *,
    columns: Mapping[str, str | None] | None = None,
    defaults: Mapping[str, Any] | None = None,
    streaming: bool = False,
    cache_dir: str | Path | None = None,
    name: str | None = None,
) -> Taskset:
    """Tasks from a local Hugging Face dataset: a Parquet, Arrow, JSON(L) or CSV file, a
    directory written by ``save_to_disk``, or a dataset directory ``load_dataset`` reads.

    There is no hub access: ``path`` must exist locally (download it beforehand). A
    dataset with several splits needs ``split``. Columns that are not Task fields (after
    ``columns`` renames them) go to ``metadata``; null values count as absent. An integer
    id becomes text (``7`` → ``"7"``, and so does a whole float, ``7.0``); a boolean or
    fractional id is an error, and so is an id that an earlier row used. A CSV file's
    cells are read as text (``4`` stays ``"4"``, ``NA`` stays ``"NA"``), an empty cell as
    absent; number fields such as ``seed`` are converted by validation.
    ``streaming=True`` reads rows without preparing an Arrow cache (length unknown).
    Needs the ``datasets`` extra: ``pip install 'envport[datasets]'``.
    """
    datasets = _import_datasets()
    path = Path(path)
    if not path.exists():
        raise TaskFileError(
            path,
            None,
            None,
            "no such file or directory; load_hf reads local datasets only (no hub access "
            "at run time): download it first, e.g. `hf download --repo-type dataset NAME "
            "--local-dir DIR`",
        )
    cols = _check_columns(columns)
    defs = _check_defaults(defaults)
    try:
        dataset = _open_dataset(datasets, path, split, streaming, cache_dir)
    except TaskFileError:
        raise
    except Exception as exc:  # the boundary with `datasets`: map whatever it raises
        field = "split" if split is not None and "split" in str(exc).lower() else None
        raise TaskFileError(
            path, None, field, f"cannot load dataset: {type(exc).__name__}: {exc}"
        ) from exc
    length = None if streaming else len(dataset)
    label = f"{path}#{split}" if split else str(path)

    def rows() -> Iterator[Task]:
        seen: dict[str, int] = {}
        for index, row in enumerate(dataset):
            data = _row_fields(row, columns=cols, defaults=defs, unknown="metadata", drop_none=True)
            data.setdefault("source", f"{label}[{index}]")
            if "id" in data:
                data["id"] = _row_id(data["id"], path, index)
            try:
                task = Task.model_validate(data)
            except ValidationError as exc:
                raise _validation_to_file_error(exc, path, None, f"row {index}: ") from exc
            if task.id in seen:
                raise TaskFileError(
                    path,
                    None,
                    "id",
                    f"row {index}: duplicate id {task.id!r} (first in row {seen[task.id]})",
                )
            seen[task.id] = index
            yield task

    return Taskset(rows, name=name or path.stem, length=length)


def _row_id(value: Any, path: Path, index: int) -> Any:
    """A dataset's id as text: ``7`` → ``"7"``, and ``7.0`` (an integer column that
    pandas or a null turned into floats) → ``"7"``; a boolean or a fractional number is
    an error, not an id."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TaskFileError(
            path, None, "id", f"row {index}: must be text or a whole number, got {value!r}"
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value))
    return value


def _csv_as_text(datasets: Any, path: Path) -> dict[str, Any]:
    """``load_dataset("csv")`` options that read every column as text, an empty cell as
    null and nothing else as null (pandas would read ``4`` as ``4.0`` in a column with an
    empty cell, and ``NA`` or ``None`` as null)."""
    with path.open(encoding="utf-8-sig", newline="") as fh:
        header = next(csv.reader(fh), None)
    if not header:
        return {}  # an empty file: let `datasets` report it
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:  # pandas would rename the second one; one feature per name would drop it
        raise TaskFileError(path, 1, None, f"column name(s) {repeated} appear twice in the header")
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False, "na_values": [""]}


def _open_dataset(
    datasets: Any, path: Path, split: str | None, streaming: bool, cache_dir: str | Path | None
) -> Any:
    cache = None if cache_dir is None else str(cache_dir)
    if path.is_file():
        if path.suffix == ".arrow":
            dataset = datasets.Dataset.from_file(str(path))
            if streaming:
                dataset = dataset.to_iterable_dataset()
            return _pick_split(dataset, split, path)
        builder = _HF_FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise TaskFileError(
                path,
                None,
                None,
                f"unsupported file type {path.suffix!r}; "
                f"expected one of {sorted({*_HF_FILE_BUILDERS, '.arrow'})}",
            )
        options = _csv_as_text(datasets, path) if builder == "csv" else {}
        loaded = datasets.load_dataset(
            builder, data_files=str(path), cache_dir=cache, streaming=streaming, **options
        )
    elif (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if streaming:
            loaded = _pick_split(loaded, split, path).to_iterable_dataset()
            return loaded
    else:
        loaded = datasets.load_dataset(str(path), cache_dir=cache, streaming=streaming)
    return _pick_split(loaded, split, path)


def _pick_split(loaded: Any, split: str | None, path: Path) -> Any:
    if not isinstance(loaded, Mapping):  # a single Dataset
        if split not in (None, "train"):
            raise TaskFileError(path, None, "split", f"has no split {split!r}; it has one: train")
        return loaded
    names = list(loaded)
    if split is None:
        if len(names) == 1:
            return loaded[names[0]]
        raise TaskFileError(
            path, None, "split", f"has several splits ({', '.join(names)}); pass split="
        )
    if split not in loaded:
        raise TaskFileError(
            path, None, "split", f"has no split {split!r}; splits: {', '.join(names)}"
        )
    return loaded[split]


# --- Harbor -------------------------------------------------------------------------


def load_harbor(path: str | Path, *, name: str | None = None) -> Taskset:
    """One Harbor task directory, or a directory of them (sorted by name)."""
    path = Path(path)
    dirs = harbor_task_dirs(path)
    return Taskset(
        lambda: (read_harbor_task(d) for d in dirs), name=name or path.name, length=len(dirs)
    )


# --- Python tasksets ------------------------------------------------------------------


#: Built-in tasksets generated by Python (``builtin:NAME`` -> ``module:function``).
_GENERATED_BUILTINS = {"coding": "envport.tasks.builtin_coding:taskset"}


def builtin_names() -> list[str]:
    """Names of the tasksets shipped in ``envport/tasks/builtin`` (``builtin:NAME``)."""
    folder = package_files("envport.tasks") / "builtin"
    return sorted(
        [
            p.name.removesuffix(".jsonl").replace("_", "-")
            for p in folder.iterdir()
            if p.name.endswith(".jsonl")
        ]
        + list(_GENERATED_BUILTINS)
    )


def load_builtin(name: str, **kwargs: Any) -> Taskset:
    """A taskset shipped with envport, e.g. ``load_builtin("arithmetic")``; ``kwargs`` go
    to :func:`load_jsonl`."""
    if name not in builtin_names():
        raise UnknownTasksetError(f"builtin:{name}", "no such built-in taskset", builtin_names())
    if name in _GENERATED_BUILTINS:
        module, _, attr = _GENERATED_BUILTINS[name].partition(":")
        if kwargs:
            raise TypeError(f"builtin:{name} takes no options, got {sorted(kwargs)}")
        made = getattr(importlib.import_module(module), attr)()
        assert isinstance(made, Taskset)
        return made
    resource = package_files("envport.tasks") / "builtin" / f"{name.replace('-', '_')}.jsonl"
    kwargs.setdefault("name", name)
    return load_jsonl(Path(str(resource)), **kwargs)


def _as_taskset(obj: Any, spec: str, kwargs: Mapping[str, Any]) -> Taskset:
    if isinstance(obj, Taskset):
        if kwargs:
            raise TypeError(f"{spec!r} is a Taskset instance; it takes no arguments")
        return obj
    if callable(obj):
        result = obj(**kwargs)
        if isinstance(result, Taskset):
            return result
        raise UnknownTasksetError(
            spec, f"calling it returned {type(result).__name__}, not a Taskset"
        )
    raise UnknownTasksetError(spec, f"it is a {type(obj).__name__}, not a Taskset or factory")


def taskset_entry_points() -> dict[str, str]:
    """Registered ``envport.tasksets`` entry points: name → ``module:attr``."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_entry_point(name: str, **kwargs: Any) -> Taskset:
    """The taskset registered under ``name`` in the ``envport.tasksets`` group."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        return _as_taskset(ep.load(), f"entrypoint:{name}", kwargs)
    raise UnknownTasksetError(
        f"entrypoint:{name}",
        f"no entry point {name!r} in group {ENTRY_POINT_GROUP!r}",
        taskset_entry_points(),
    )


def load_object(path: str, **kwargs: Any) -> Taskset:
    """A Taskset from ``package.module:Attr``: a subclass (instantiated with ``kwargs``),
    an instance, or a callable returning one."""
    module_name, _, attr = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownTasksetError(path, f"cannot import {module_name!r}: {exc}") from exc
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError as exc:
        raise UnknownTasksetError(path, f"{module_name!r} has no attribute {attr!r}") from exc
    return _as_taskset(target, path, kwargs)


# --- dispatch -----------------------------------------------------------------------


def load(spec: str | Path, **kwargs: Any) -> Taskset:
    """Load a taskset from a spec (see the module docstring); ``kwargs`` go to the loader."""
    if isinstance(spec, Path):
        return _load_path(spec, str(spec), kwargs)
    if spec.startswith("hf:"):
        target, _, split = spec[3:].partition("#")
        if split:
            kwargs.setdefault("split", split)
        return load_hf(target, **kwargs)
    if spec.startswith("builtin:"):
        return load_builtin(spec.removeprefix("builtin:"), **kwargs)
    if spec.startswith("entrypoint:"):
        return load_entry_point(spec.removeprefix("entrypoint:"), **kwargs)
    path = Path(spec)
    if path.exists():
        return _load_path(path, spec, kwargs)
    if _MODULE_ATTR.match(spec):
        return load_object(spec, **kwargs)
    raise UnknownTasksetError(
        spec,
        "no such file or directory, and not 'hf:PATH', 'builtin:NAME', 'entrypoint:NAME' "
        "or 'package.module:Class'",
        [f"builtin:{n}" for n in builtin_names()]
        + [f"entrypoint:{n}" for n in taskset_entry_points()],
    )


def _load_path(path: Path, spec: str, kwargs: dict[str, Any]) -> Taskset:
    if path.is_dir():
        if is_harbor_task(path) or any(d.is_dir() and is_harbor_task(d) for d in path.iterdir()):
            return load_harbor(path, **kwargs)
        return load_hf(path, **kwargs)
    if path.suffix == ".jsonl":
        return load_jsonl(path, **kwargs)
    if path.suffix in (".parquet", ".arrow", ".json", ".csv"):
        return load_hf(path, **kwargs)
    raise UnknownTasksetError(
        spec, f"unknown file type {path.suffix!r}; use .jsonl, .parquet, .arrow, .json or .csv"
    )
