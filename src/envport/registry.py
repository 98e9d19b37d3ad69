"""The environment registry: versioned ids to factories.

``make("echo-v1")`` builds a registered environment; ``make("echo")`` takes the highest
registered version; ``make("package.module:Class")`` imports a class directly. Third-party
packages register through the ``envport.envs`` entry-point group (a callable run once,
on first lookup). Unknown ids raise :class:`~envport.errors.UnknownEnvError`, which
lists what exists and suggests the closest id; an import path that does not load raises
it too, saying what failed (the module's import, or the missing attribute).

Import paths import from ``sys.path``. The ``envport`` command and ``python -m
envport.server`` put the current directory first on it (:func:`import_from_cwd`, what
uvicorn's default ``--app-dir .`` does), so ``envport serve mymodule:Env`` works from the
directory holding ``mymodule.py``.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
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


def import_from_cwd() -> None:
    """Put the current directory first on ``sys.path`` (once), so that ``module:Class``
    paths import modules from it, as uvicorn's default ``--app-dir .`` and ``python -m``
    do. Entry points (the CLI, ``python -m envport.server``) call this; the library
    itself never changes ``sys.path``."""
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed: nothing to import from
        return
    if not sys.path or sys.path[0] not in ("", cwd):
        sys.path.insert(0, cwd)


def load_entry_point(path: str) -> EnvFactory:
    """Import ``package.module:Attr``.

    A module that does not import, or lacks the attribute, raises
    :class:`~envport.errors.UnknownEnvError` saying which (the import's own exception is
    its ``__cause__``).
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"Entry point {path!r} must look like 'package.module:Class'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # whatever importing the module raised: one clear error
        reason = f"could not import module {module_name!r} ({type(exc).__name__}: {exc})"
        raise UnknownEnvError(path, _registry, reason=reason) from exc
    try:
        target = module
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError as exc:
        reason = f"module {module_name!r} has no attribute {attr!r}"
        raise UnknownEnvError(path, _registry, reason=reason) from exc
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
