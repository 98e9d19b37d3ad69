"""Harbor task directories (the format of Terminal-Bench 2) as tasks.

A Harbor task is a directory::

    my-task/
      instruction.md        the prompt
      task.toml             version, [metadata], [verifier], [agent], [environment]
      environment/          Docker build context: Dockerfile and the files it copies
      tests/test.sh         the verifier: writes a reward to /logs/verifier/reward.txt
      solution/solve.sh     optional reference solution

It maps onto a :class:`~envport.tasks.task.Task` as follows: ``id`` is the directory
name; ``prompt`` is ``instruction.md``; ``[environment]`` gives ``resources`` (cpus,
memory, storage, gpus) and ``build_timeout_sec`` the ``env_start`` timeout;
``[agent].timeout_sec`` and ``[verifier].timeout_sec`` the ``agent`` and ``scoring``
timeouts; the verifier becomes one ``test_command`` rubric component that the rubric
layer runs in the environment (``bash /tests/test.sh``, then the reward read from
``reward.txt`` or ``reward.json``). Files under ``environment/`` other than the Docker
files become workspace ``files`` (by reference). ``[metadata]`` becomes ``metadata``,
with Harbor-specific facts (the Docker image, Dockerfile and its ``WORKDIR``) under
``metadata["harbor"]``.

The task runs in ``shell-v1`` (:mod:`envport.envs.shell`), or in the environment that
``[metadata] envport_env`` names. For ``shell-v1`` the ``env_options`` are
``{"task_dir": "."}`` (relative to ``Task.root``, resolved by the harness before reset, so
a moved task directory keeps its content hash), plus ``workdir`` when the Dockerfile's last
``WORKDIR`` is a path the sandbox can use (``/app``, say): the environment copies
``environment/`` into the workspace and mounts ``tests/`` read-only at ``/tests`` itself,
so its rubric uploads nothing. Any other environment gets no options and a rubric that
uploads ``tests/`` to ``/tests`` before running them.

``task.toml`` is read tolerantly: unknown keys and sections are ignored, and both the
current ``memory_mb``/``storage_mb`` and the older ``memory = "2G"`` forms are accepted
(a number and a unit, as Harbor reads it: see :func:`size_mb`). The files are UTF-8; a
leading BOM is dropped.
"""

from __future__ import annotations

import os
import posixpath
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from envport.tasks.errors import TaskFileError, check_utf8, read_text
from envport.tasks.task import RubricSpec, Task, TaskFile

#: Where Harbor's verifier expects the reward, and where it mounts ``tests/``.
REWARD_FILE = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
TESTS_MOUNT = "/tests"
#: The environment Harbor tasks run in unless ``[metadata] envport_env`` names another.
SHELL_ENV = "shell-v1"
#: Paths ``shell-v1`` provides itself, so a ``WORKDIR`` there cannot be its workdir.
_SANDBOX_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev",
    "/tmp", "/logs", TESTS_MOUNT,
)  # fmt: skip

_DOCKER_FILES = frozenset(
    {"Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"}
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Verifier(_Section):
    timeout_sec: float | None = None


class _Agent(_Section):
    timeout_sec: float | None = None


class _Environment(_Section):
    build_timeout_sec: float | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    gpus: int | None = None
    memory: str | None = None
    storage: str | None = None
    docker_image: str | None = None

    @field_validator("memory", "storage")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            size_mb(value)
        return value


class _Config(_Section):
    version: str | float | None = None
    metadata: dict[str, Any] = {}
    verifier: _Verifier = _Verifier()
    agent: _Agent = _Agent()
    environment: _Environment = _Environment()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT])(?:i?B)?\s*$", re.IGNORECASE)
_UNIT_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}


def size_mb(text: str) -> int:
    """The older ``memory``/``storage`` form in MB: ``"2G"`` → 2048, ``"512M"`` → 512.

    As Harbor reads it: a number and a binary unit (K, M or G; any case), fractions
    truncated (``"1.5G"`` → 1536), and a bare number is an error (bytes? MB?). envport
    also takes ``T`` and a trailing ``B``/``iB`` (``"2GB"``, ``"1.5GiB"``), which Harbor
    rejects, and gives at least 1 MB.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(
            f"not a size like '2G' or '512M' (a number and a unit: K, M, G or T), got {text!r}"
        )
    return max(1, int(float(match.group(1)) * _UNIT_MB[match.group(2).upper()]))


def is_harbor_task(path: Path) -> bool:
    return (path / "task.toml").is_file()


def harbor_task_dirs(path: Path) -> list[Path]:
    """``[path]`` if it is a task directory, else its task subdirectories, sorted."""
    if is_harbor_task(path):
        return [path]
    if not path.is_dir():
        raise TaskFileError(path, None, None, "not a directory")
    dirs = sorted(d for d in path.iterdir() if d.is_dir() and is_harbor_task(d))
    if not dirs:
        raise TaskFileError(
            path, None, None, "no task.toml here or in any subdirectory; not a Harbor task dir"
        )
    return dirs


def read_harbor_task(task_dir: str | Path) -> Task:
    """Read one Harbor task directory; errors name the file, line and field."""
    task_dir = Path(task_dir)
    config = _read_config(task_dir / "task.toml")
    prompt = _read_instruction(task_dir / "instruction.md")
    test_sh = task_dir / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskFileError(
            test_sh, None, "rubric", "missing: a Harbor task is scored by tests/test.sh"
        )
    env = config.environment
    env_dir = task_dir / "environment"
    dockerfile = env_dir / "Dockerfile"
    solution = task_dir / "solution" / "solve.sh"
    workdir = _dockerfile_workdir(dockerfile) if dockerfile.is_file() else None
    harbor_meta: dict[str, Any] = {
        "version": None if config.version is None else str(config.version),
        "solution": "solution/solve.sh" if solution.is_file() else None,
        "environment_dir": "environment" if env_dir.is_dir() else None,
        "docker_image": env.docker_image,
        "dockerfile": "environment/Dockerfile" if dockerfile.is_file() else None,
        "workdir": workdir,
    }
    env_id = config.metadata.get("envport_env", SHELL_ENV)
    if not isinstance(env_id, str) or not env_id:
        raise TaskFileError(
            task_dir / "task.toml",
            _key_line(read_text(task_dir / "task.toml"), "metadata", "envport_env"),
            "metadata.envport_env",
            f"must be a registered environment id, got {env_id!r}",
        )
    params: dict[str, Any] = {
        "command": f"bash {TESTS_MOUNT}/test.sh",
        "reward_file": REWARD_FILE,
        "reward_json": REWARD_JSON,
    }
    env_options: dict[str, Any] = {}
    if env_id == SHELL_ENV:
        env_options["task_dir"] = "."  # relative to Task.root; see module docstring
        if workdir is not None and _sandbox_workdir(workdir):
            env_options["workdir"] = workdir
    else:
        params.update(tests_dir="tests", tests_mount=TESTS_MOUNT)
    fields: dict[str, Any] = {
        "id": task_dir.name,
        "prompt": prompt,
        "files": _environment_files(env_dir),
        "env_id": env_id,
        "env_options": env_options,
        "resources": {
            "cpus": env.cpus,
            "memory_mb": env.memory_mb or (size_mb(env.memory) if env.memory else None),
            "storage_mb": env.storage_mb or (size_mb(env.storage) if env.storage else None),
            "gpus": env.gpus,
            "timeouts": {
                "env_start": env.build_timeout_sec,
                "agent": config.agent.timeout_sec,
                "scoring": config.verifier.timeout_sec,
            },
        },
        "rubric": (RubricSpec(type="test_command", params=params),),
        "metadata": {**config.metadata, "harbor": harbor_meta},
        "source": str(task_dir),
        "root": str(task_dir.resolve()),
    }
    try:
        return Task(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        msg = err["msg"] + (f", got {err['input']!r}" if "input" in err else "")
        if loc[:1] == ("prompt",):
            raise TaskFileError(task_dir / "instruction.md", None, "prompt", msg) from exc
        toml_path = task_dir / "task.toml"
        section, key = _TOML_KEY.get(loc, ("", loc[0]))
        text = read_text(toml_path)
        field = f"{section}.{key}" if section else key
        raise TaskFileError(toml_path, _key_line(text, section, key), field, msg) from exc


#: Task field -> the task.toml (section, key) it comes from.
_TOML_KEY: dict[tuple[str, ...], tuple[str, str]] = {
    ("resources", "cpus"): ("environment", "cpus"),
    ("resources", "memory_mb"): ("environment", "memory_mb"),
    ("resources", "storage_mb"): ("environment", "storage_mb"),
    ("resources", "gpus"): ("environment", "gpus"),
    ("resources", "timeouts", "env_start"): ("environment", "build_timeout_sec"),
    ("resources", "timeouts", "agent"): ("agent", "timeout_sec"),
    ("resources", "timeouts", "scoring"): ("verifier", "timeout_sec"),
}


def _read_config(toml_path: Path) -> _Config:
    try:
        text = read_text(toml_path)
    except OSError as exc:
        raise TaskFileError(toml_path, None, None, f"cannot read: {exc.strerror}") from exc
    check_utf8(toml_path, text)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"at line (\d+)", str(exc))
        line = int(match.group(1)) if match else None
        raise TaskFileError(toml_path, line, None, f"invalid TOML: {exc}") from exc
    try:
        return _Config.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        section, key = (".".join(loc[:-1]), loc[-1]) if len(loc) > 1 else ("", loc[0])
        line = _key_line(text, section, key)
        if err["type"] == "value_error":  # our own validator's message, which shows the value
            msg = str(err.get("ctx", {}).get("error", err["msg"]))
        else:
            msg = err["msg"] + (f", got {err['input']!r}" if "input" in err else "")
        raise TaskFileError(toml_path, line, ".".join(loc), msg) from exc


def _read_instruction(path: Path) -> str:
    try:
        text = read_text(path)
    except FileNotFoundError as exc:
        raise TaskFileError(
            path, None, "prompt", "missing: a Harbor task's prompt is instruction.md"
        ) from exc
    except OSError as exc:
        raise TaskFileError(path, None, "prompt", f"cannot read: {exc.strerror}") from exc
    check_utf8(path, text, field="prompt")
    if not text.strip():
        raise TaskFileError(path, None, "prompt", "instruction.md is empty")
    return text


def _environment_files(env_dir: Path) -> dict[str, TaskFile]:
    if not env_dir.is_dir():
        return {}
    files: dict[str, TaskFile] = {}
    for file in sorted(env_dir.rglob("*")):
        rel = file.relative_to(env_dir)
        if not file.is_file() or (len(rel.parts) == 1 and rel.name in _DOCKER_FILES):
            continue
        files[rel.as_posix()] = TaskFile(
            source=f"environment/{rel.as_posix()}", executable=os.access(file, os.X_OK)
        )
    return files


_WORKDIR = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)


def _dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last absolute ``WORKDIR`` of a Dockerfile (no variables), else ``None``."""
    try:
        text = dockerfile.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found: list[str] = [str(w).strip("\"'") for w in _WORKDIR.findall(text)]
    last = found[-1] if found else None
    if last is None or not last.startswith("/") or "$" in last:
        return None
    return posixpath.normpath(last)


def _sandbox_workdir(path: str) -> bool:
    return path != "/" and not any(path == p or path.startswith(p + "/") for p in _SANDBOX_PATHS)


_HEADER = re.compile(r"^\s*\[\s*([^\]\s]+)\s*\]")


def _key_line(text: str, section: str, key: str) -> int | None:
    """The 1-based line where ``key`` is set inside ``[section]`` ("" = top level)."""
    current = ""
    key_re = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            if current == f"{section}.{key}" if section else current == key:
                return number
            continue
        if current == section and key_re.match(line):
            return number
    return None
