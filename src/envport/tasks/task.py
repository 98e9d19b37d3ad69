"""A task: one unit of work, as frozen data.

A :class:`Task` says what to ask (``prompt``, ``system_prompt``), what the workspace
starts with (``files``), what a good answer is (``answer``), which environment to run
it in (``env_id``, ``seed``, ``env_options``), what it may use (``resources``) and how
it is scored (``rubric``). It has no behaviour: loaders build tasks, the controller runs
them, the rubric layer reads ``rubric`` and ``answer``.

Two notions of identity:

* ``id`` names the task inside its taskset (a Harbor directory name, a JSONL ``id``).
* :attr:`Task.content_hash` is a SHA-256 over the canonical JSON of the *content*
  fields (everything but ``id``, ``source`` and ``root``), with default values left out
  and keys sorted. Renaming a task, reordering keys in its file, moving its directory or
  adding a new optional field to this model does not change it; changing the prompt, the
  answer, the options or the rubric does. Splits and shuffles key on it, so a task keeps
  its split when others are added, and duplicated content cannot straddle train and test.

Paths inside a task (``TaskFile.source``, a rubric's ``tests_dir``) are relative to
``root`` when they are not absolute, so the hash does not depend on where the task lives.
The hash covers the declaration, not the bytes of files it points to.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]

#: Fields that locate or name a task but are not part of its content.
NON_CONTENT_FIELDS = frozenset({"id", "source", "root"})


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatMessage(BaseModel):
    """One message of a chat prompt (OpenAI-style); extra keys such as ``name`` are kept."""

    model_config = ConfigDict(frozen=True, extra="allow")

    role: Role
    content: str | list[dict[str, Any]] = Field(
        description="Text, or a list of content parts ({'type': 'text', 'text': ...}, ...)."
    )

    @field_validator("content", mode="before")
    @classmethod
    def _text_or_parts(cls, value: Any) -> Any:
        if not isinstance(value, str | list | tuple):
            raise ValueError(f"must be text or a list of content parts, not {type(value).__name__}")
        return value


class Timeouts(_Frozen):
    """Per-stage deadlines in seconds; ``None`` leaves the stage to the runner's default."""

    env_start: float | None = Field(
        default=None, gt=0, description="Building and starting the environment."
    )
    agent: float | None = Field(default=None, gt=0, description="The agent's whole run.")
    scoring: float | None = Field(default=None, gt=0, description="Running the rubric.")


class Resources(_Frozen):
    """What one run of the task may use; ``None`` means the backend's default."""

    cpus: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, gt=0)
    storage_mb: int | None = Field(default=None, gt=0)
    gpus: int | None = Field(default=None, ge=0)
    timeouts: Timeouts = Field(default_factory=Timeouts)


class RubricSpec(_Frozen):
    """One scoring component: its ``type`` (which the rubric layer resolves), a weight,
    and type-specific ``params``.

    Written flat in task files, keys other than ``type`` and ``weight`` go to ``params``:
    ``{"type": "test_command", "command": "bash tests/test.sh"}``. A bare string is a
    type with no params: ``"exact_match"``.
    """

    type: str = Field(min_length=1)
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _flat_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"type": data}
        if isinstance(data, dict):
            extra = {k: v for k, v in data.items() if k not in ("type", "weight", "params")}
            if extra:
                params = data.get("params") or {}
                if not isinstance(params, dict):
                    return data  # let field validation report it
                rest = {k: v for k, v in data.items() if k in ("type", "weight")}
                return {**rest, "params": {**params, **extra}}
        return data


class TaskFile(_Frozen):
    """A file placed in the workspace before the run: inline ``content`` or a ``source``
    path to copy (relative to the task's ``root`` unless absolute). In task files a plain
    string is inline content."""

    content: str | None = None
    source: str | None = None
    executable: bool = False

    @model_validator(mode="before")
    @classmethod
    def _text_form(cls, data: Any) -> Any:
        return {"content": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _one_of(self) -> TaskFile:
        if (self.content is None) == (self.source is None):
            raise ValueError("give exactly one of 'content' or 'source'")
        return self


class Task(_Frozen):
    """One unit of work. Frozen; build variants with ``model_copy(update=...)``.

    Dict-valued fields are not deep-frozen: treat them as read-only.
    """

    id: str = Field(
        default="",
        description="Name within the taskset; defaults to 'task-' + the first 12 hex "
        "digits of the content hash.",
    )
    prompt: str | tuple[ChatMessage, ...] = Field(
        description="The instruction: text, or chat messages."
    )
    system_prompt: str | None = None
    files: dict[str, TaskFile] = Field(
        default_factory=dict, description="Workspace-relative path -> file to place there."
    )
    answer: Any = Field(default=None, description="Reference answer (any JSON value).")
    env_id: str | None = Field(default=None, description="Registered environment id.")
    seed: int | None = Field(default=None, description="Seed passed to the env's reset().")
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options for the environment's reset()."
    )
    resources: Resources = Field(default_factory=Resources)
    rubric: tuple[RubricSpec, ...] = Field(default=(), description="Scoring components.")
    metadata: dict[str, Any] = Field(default_factory=dict)
    source: str | None = Field(
        default=None, description="Where the task was read from ('file.jsonl:3'); not content."
    )
    root: str | None = Field(
        default=None, description="Directory that relative paths resolve against; not content."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_messages(cls, value: Any) -> Any:
        if not isinstance(value, str | list | tuple):
            raise ValueError(f"must be text or a list of chat messages, not {type(value).__name__}")
        return value

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, value: str | tuple[ChatMessage, ...]) -> Any:
        if not value or (isinstance(value, str) and not value.strip()):
            raise ValueError("prompt is empty")
        return value

    @field_validator("seed", mode="before")
    @classmethod
    def _no_bool_seed(cls, value: Any) -> Any:
        # pydantic's lax int takes true as 1; a boolean seed is a mistake, not a seed.
        if isinstance(value, bool):
            raise ValueError(f"must be an integer, not a boolean ({str(value).lower()})")
        return value

    @field_validator("rubric", mode="before")
    @classmethod
    def _one_rubric(cls, value: Any) -> Any:
        return [value] if isinstance(value, str | dict) else value

    @field_validator("files")
    @classmethod
    def _relative_paths(cls, value: dict[str, TaskFile]) -> dict[str, TaskFile]:
        for path in value:
            norm = posixpath.normpath(path)
            if not path or path.startswith(("/", "\\")) or norm == ".." or norm.startswith("../"):
                raise ValueError(f"file path {path!r} must be relative and stay in the workspace")
        return value

    @model_validator(mode="after")
    def _default_id(self) -> Task:
        if not self.id:
            # Frozen model: set the derived default once, during validation.
            object.__setattr__(self, "id", "task-" + self.content_hash[:12])
        return self

    def content(self) -> dict[str, Any]:
        """The content fields as JSON data, defaults omitted: what the hash covers."""
        return self.model_dump(mode="json", exclude=set(NON_CONTENT_FIELDS), exclude_defaults=True)

    @property
    def content_hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON of :meth:`content`. See the module docstring."""
        canonical = json.dumps(
            self.content(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def __hash__(self) -> int:
        return hash((self.id, self.content_hash))

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages, the system prompt first when there is one."""
        out: list[dict[str, Any]] = []
        if self.system_prompt is not None:
            out.append({"role": "system", "content": self.system_prompt})
        if isinstance(self.prompt, str):
            out.append({"role": "user", "content": self.prompt})
        else:
            out.extend(m.model_dump(mode="json") for m in self.prompt)
        return out

    def resolve(self, path: str) -> Path:
        """``path`` made absolute against ``root`` (unchanged if already absolute)."""
        p = Path(path)
        if p.is_absolute() or self.root is None:
            return p
        return Path(self.root) / p
