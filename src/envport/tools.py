"""Tools: methods of an environment that an agent can call by name.

A tool is a method decorated with :func:`tool`. Its parameters' type hints become a
JSON Schema (through pydantic), its docstring's first paragraph the description, and
Google-style ``Args:`` lines the parameter descriptions. The same tools are reachable as
OpenEnv ``list_tools``/``call_tool`` actions and through the MCP endpoint.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from envport.errors import ToolError
from envport.types import ToolSpec

F = TypeVar("F", bound=Callable[..., Any])

_TOOL_ATTR = "__envport_tool__"
_ARG_LINE = re.compile(r"^\s{2,}(\w+)\s*(?:\([^)]*\))?:\s*(.+)$")


def tool(fn: F | None = None, *, name: str | None = None) -> Any:
    """Mark a method of an environment as a tool.

    ``@tool`` or ``@tool(name="other_name")``. Sync methods run in a worker thread.
    """

    def mark(f: F) -> F:
        setattr(f, _TOOL_ATTR, name or f.__name__)
        return f

    return mark(fn) if fn is not None else mark


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    if not doc:
        return "", {}
    text = inspect.cleandoc(doc)
    description = text.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    in_args = False
    for line in text.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            if line and not line.startswith(" "):
                in_args = False
                continue
            match = _ARG_LINE.match("  " + line.strip()) if line.startswith("    ") else None
            if match:
                params[match.group(1)] = match.group(2).strip()
    return description, params


@dataclass(frozen=True)
class BoundTool:
    """A tool found on an environment instance, ready to call."""

    spec: ToolSpec
    params_model: type[BaseModel]
    method: Callable[..., Any]

    async def call(
        self,
        arguments: dict[str, Any],
        in_thread: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
    ) -> Any:
        """Validate ``arguments`` and call the tool. A plain ``def`` tool runs through
        ``in_thread`` (the environment's own worker thread, where its hooks run), or in
        asyncio's default pool without one."""
        try:
            validated = self.params_model.model_validate(arguments)
        except ValidationError as exc:
            raise ToolError(
                f"Invalid arguments for tool {self.spec.name!r}: {_summarise(exc)}",
                kind="invalid_args",
                schema=self.spec.input_schema,
            ) from exc
        kwargs = {field: getattr(validated, field) for field in self.params_model.model_fields}
        if inspect.iscoroutinefunction(self.method):
            return await self.method(**kwargs)
        if in_thread is not None:
            return await in_thread(partial(self.method, **kwargs))
        return await asyncio.to_thread(self.method, **kwargs)


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _params_model(name: str, fn: Callable[..., Any], docs: dict[str, str]) -> type[BaseModel]:
    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = hints.get(pname, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, Field(default, description=docs.get(pname)))
    model: type[BaseModel] = create_model(
        f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
    )
    return model


def discover(obj: object) -> dict[str, BoundTool]:
    """All tools on ``obj`` (an environment instance), by name."""
    found: dict[str, BoundTool] = {}
    for attr in dir(type(obj)):
        member = getattr(type(obj), attr, None)
        tool_name = getattr(member, _TOOL_ATTR, None)
        if tool_name is None or member is None:
            continue
        description, docs = _parse_docstring(member.__doc__)
        model = _params_model(tool_name, member, docs)
        schema = model.model_json_schema()
        schema.pop("title", None)
        spec = ToolSpec(name=tool_name, description=description, input_schema=schema)
        found[tool_name] = BoundTool(spec=spec, params_model=model, method=getattr(obj, attr))
    return found


def to_jsonable(value: Any) -> Any:
    """Make a tool's return value JSON-serialisable (pydantic models are dumped)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value
