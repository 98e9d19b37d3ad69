"""The environment registry: versioned ids to factories.

``make("echo-v1")`` builds a registered environment; ``make("echo")`` takes the highest
registered version; ``make("package.module:Class")`` imports a class directly. Third-party
packages register through the ``envport.envs`` entry-point group (a callable run once,
on first lookup). Unknown ids raise :class:`~envport.errors.UnknownEnvError`, which
lists what exists and suggests the closest id.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from envport.env import Env
from envport.errors import UnknownEnvError

EnvFactory = Callable[..., Env[Any, Any]]

_ID = re.compile(r"^(?:(?P<ns>[\w.-]+)/)?(?P<name>[\w.]+(?:-[a-zA-Z][\w]*)*?)(?:-v(?P<ver>\d+))?$")


@dataclass(frozen=True)
class EnvSpec:
    """One registered environment."""

    id: str
    entry_point: str | EnvFactory
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def load(self) -> EnvFactory:
        if callable(self.entry_point):
            return self.entry_point
        return load_entry_point(self.entry_point)

    def make(self, **kwargs: Any) -> Env[Any, Any]:
        return self.load()(**{**self.kwargs, **kwargs})


_registry: dict[str, EnvSpec] = {}
_plugins_loaded = False


def parse_id(env_id: str) -> tuple[str, int | None]:
    """Split ``ns/name-v3`` into ``("ns/name", 3)``."""
    match = _ID.match(env_id)
    if not match:
        raise ValueError(
            f"Malformed environment id {env_id!r}; expected 'name-v1' or 'ns/name-v1'."
        )
    base = (match.group("ns") + "/" if match.group("ns") else "") + match.group("name")
    ver = match.group("ver")
    return base, int(ver) if ver is not None else None


def register(
    env_id: str,
    entry_point: str | EnvFactory,
    *,
    description: str = "",
    **kwargs: Any,
) -> EnvSpec:
    """Register ``env_id`` (e.g. ``"guess-number-v1"``). Re-registering replaces."""
    parse_id(env_id)
    spec = EnvSpec(env_id, entry_point, kwargs, description)
    _registry[env_id] = spec
    return spec


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="envport.envs"):
        ep.load()()


def registered() -> dict[str, EnvSpec]:
    _load_plugins()
    return dict(_registry)


def spec(env_id: str) -> EnvSpec:
    """The spec for ``env_id``; an unversioned id resolves to its highest version."""
    _load_plugins()
    if env_id in _registry:
        return _registry[env_id]
    if ":" in env_id:
        return EnvSpec(env_id, env_id)
    try:
        base, version = parse_id(env_id)
    except ValueError:
        raise UnknownEnvError(env_id, _registry) from None
    if version is None:
        candidates = [(parse_id(k)[1] or 0, k) for k in _registry if parse_id(k)[0] == base]
        if candidates:
            return _registry[max(candidates)[1]]
    raise UnknownEnvError(env_id, _registry)


def make(env_id: str, **kwargs: Any) -> Env[Any, Any]:
    """Build an environment by id (see module docstring)."""
    return spec(env_id).make(**kwargs)


def load_entry_point(path: str) -> EnvFactory:
    """Import ``package.module:Attr``."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"Entry point {path!r} must look like 'package.module:Class'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownEnvError(path, _registry) from exc
    try:
        target = module
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError as exc:
        raise UnknownEnvError(path, _registry) from exc
    if not callable(target):
        raise TypeError(f"{path!r} is not callable")
    return target


def resolve(
    env: str | EnvFactory, options: Mapping[str, Any] | None = None
) -> tuple[Callable[[], Env[Any, Any]], str]:
    """A zero-argument factory and a display name for an id, path or factory.

    ``options`` are keyword arguments for the environment's constructor, on top of
    (and overriding) those its registration gives.
    """
    if isinstance(env, str):
        found = spec(env)
        factory = found.load()
        kwargs = {**found.kwargs, **(options or {})}

        def make() -> Env[Any, Any]:
            return factory(**kwargs)

        make.__name__ = found.id  # so that create_app(make) names the env by its id
        return make, found.id
    name = getattr(env, "__name__", type(env).__name__)
    if options:
        bound = functools.partial(env, **options)
        bound.__name__ = name  # type: ignore[attr-defined]
        return bound, name
    return env, name
