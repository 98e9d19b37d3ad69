"""``envport init NAME``: a new environment package that passes ``envport check``.

The generated project is the smallest complete one, laid out like envport itself::

    NAME/
      pyproject.toml        registers NAME-v1 in the ``envport.envs`` entry-point group
      README.md
      src/PACKAGE/__init__.py   register(): the entry point
      src/PACKAGE/env.py        the environment: typed action/observation/state, a tool
      tests/test_env.py     plays an episode and runs envport's checker

The example environment is a number-guessing game, chosen because it touches each part
of the contract once: a seeded draw from ``self.rng``, a typed action with bounds, a
reward in a declared ``reward_range``, extra state, a tool, and ``check_actions`` so the
checker can step it. Templates are plain strings formatted with :meth:`str.format`.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Names", "ScaffoldError", "names_for", "render", "scaffold"]

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z][a-z0-9]*)*$")


class ScaffoldError(ValueError):
    """The name or target directory cannot be used; the message says why."""


@dataclass(frozen=True)
class Names:
    """Every spelling of the new environment's name the templates need."""

    name: str  # guess-number
    package: str  # guess_number
    cls: str  # GuessNumber (classes are GuessNumberEnv, GuessNumberAction, ...)
    env_id: str  # guess-number-v1


def names_for(name: str) -> Names:
    """Validate ``name`` and derive the package, class and id spellings."""
    if not _NAME.match(name) or re.search(r"[-_]v\d+$", name):
        raise ScaffoldError(
            f"Invalid environment name {name!r}: use lowercase letters and digits, words "
            "separated by '-' or '_', each word starting with a letter, and no version "
            "suffix (envport init adds '-v1'). Example: guess-number."
        )
    package = name.replace("-", "_")
    if keyword.iskeyword(package) or package == "envport":
        raise ScaffoldError(f"{name!r} cannot be a Python package name; pick another.")
    cls = "".join(part.capitalize() for part in re.split(r"[-_]", name))
    return Names(name=name, package=package, cls=cls, env_id=f"{name}-v1")


def _refuse_taken_package(name: str, package: str) -> None:
    """Refuse a package name that ``import`` would resolve to something else: a standard
    library module (``random``, ``json``) or an installed package. The generated code
    and tests would import that instead and fail."""
    if package in sys.stdlib_module_names:
        raise ScaffoldError(
            f"{name!r} would make the package {package!r}, which is a standard-library "
            "module: the generated code would import that instead. Pick another name."
        )
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    # A namespace package (a plain directory on sys.path, origin None) never shadows a
    # regular one, so only a real module or package counts.
    if spec is not None and spec.origin is not None:
        raise ScaffoldError(
            f"{name!r} would make the package {package!r}, which is already installed "
            f"({spec.origin}): the two would collide on import. Pick another name."
        )


def render(names: Names) -> dict[str, str]:
    """The generated files, by path relative to the project directory."""
    fields = {
        "name": names.name,
        "package": names.package,
        "cls": names.cls,
        "env_id": names.env_id,
    }
    return {
        "pyproject.toml": PYPROJECT.format(**fields),
        "README.md": README.format(**fields),
        f"src/{names.package}/__init__.py": INIT.format(**fields),
        f"src/{names.package}/env.py": ENV.format(**fields),
        "tests/test_env.py": TEST.format(**fields),
    }


def scaffold(name: str, parent: Path) -> Path:
    """Write a new project for ``name`` into ``parent/name`` and return its path.

    Refuses to write into a directory that already has files in it, and a name that is
    already registered (a built-in or an installed package's, in any version): the new
    package's ``NAME-v1`` would collide with it, and ``make(NAME)`` would pick either.
    Refuses too a name whose package is a standard-library module or already installed.
    """
    from envport.registry import parse_id, registered

    names = names_for(name)
    taken = sorted(env_id for env_id in registered() if parse_id(env_id)[0] == name)
    if taken:
        raise ScaffoldError(
            f"{name!r} is already registered ({', '.join(taken)}): a new package's "
            f"{names.env_id!r} would collide with it. Pick another name."
        )
    _refuse_taken_package(name, names.package)
    root = parent / name
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ScaffoldError(f"{root} already exists and is not empty; choose another --dir.")
    for relative, text in render(names).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


# --- templates ------------------------------------------------------------------------
# Literal braces are doubled for str.format.

PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.25"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "0.1.0"
description = "The {env_id} environment for envport."
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["envport"]

[project.optional-dependencies]
test = ["pytest>=8"]

# envport finds the environment through this entry point: `envport envs` lists it and
# `envport serve {env_id}` serves it once the package is installed.
[project.entry-points."envport.envs"]
{package} = "{package}:register"

[tool.hatch.build.targets.wheel]
packages = ["src/{package}"]

[tool.pytest.ini_options]
pythonpath = ["src"]
testpaths = ["tests"]
"""

README = """\
# {name}

`{env_id}`: an [envport](https://github.com/envport/envport) environment. The agent
guesses a number between 1 and 100; each observation says "higher" or "lower"; a
correct guess ends the episode with reward 1.

```bash
pip install -e '.[test]'
envport check {env_id}      # the contract checker
pytest                      # this package's tests
envport serve {env_id}      # OpenEnv-compatible server on 127.0.0.1:8000
```

```python
import asyncio
import envport

async def main() -> None:
    async with envport.make("{env_id}") as env:
        result = await env.reset(seed=7)
        result = await env.step({{"guess": 50}})
        print(result.observation.message, result.reward)

asyncio.run(main())
```

Edit `src/{package}/env.py`: `on_reset` starts an episode (draw randomness from
`self.rng`, which `reset(seed=...)` seeds), `on_step` applies one typed action, methods
marked `@tool` become tools, and `check_actions` lists valid actions for
`envport check`.
"""

INIT = '''\
"""The {env_id} environment for envport."""

from __future__ import annotations

import envport

from {package}.env import (
    {cls}Action,
    {cls}Env,
    {cls}Observation,
    {cls}State,
)

__all__ = [
    "{cls}Action",
    "{cls}Env",
    "{cls}Observation",
    "{cls}State",
    "register",
]


def register() -> None:
    """Entry point of the ``envport.envs`` group: registers ``{env_id}``."""
    envport.register(
        "{env_id}",
        "{package}.env:{cls}Env",
        description="Guess a number from 1 to 100.",
    )
'''

ENV = '''\
"""``{env_id}``: guess a number from 1 to 100."""

from __future__ import annotations

from typing import Any, ClassVar

from envport import Action, Env, Observation, State, StepResult, tool
from pydantic import Field

LOW, HIGH = 1, 100


class {cls}Action(Action):
    guess: int = Field(ge=LOW, le=HIGH, description="Your guess.", examples=[50])


class {cls}Observation(Observation):
    message: str = Field(description="'higher', 'lower', 'correct', or the rules.")
    low: int = Field(description="Smallest number still possible.")
    high: int = Field(description="Largest number still possible.")


class {cls}State(State):
    low: int = LOW
    high: int = HIGH
    solved: bool = False


class {cls}Env(Env[{cls}Action, {cls}Observation]):
    """Guess the hidden number. Reward 1 for the right guess, 0 otherwise."""

    action_type = {cls}Action
    observation_type = {cls}Observation
    state_type = {cls}State
    reward_range = (0.0, 1.0)
    version = "1"
    #: Valid actions ``envport check`` steps with.
    check_actions: ClassVar[list[dict[str, Any]]] = [{{"guess": 50}}, {{"guess": 25}}]

    def __init__(self) -> None:
        super().__init__()
        self.target = LOW
        self.low, self.high = LOW, HIGH
        self.solved = False

    async def on_reset(
        self, seed: int | None, **options: Any
    ) -> StepResult[{cls}Observation]:
        self.target = self.rng.randint(LOW, HIGH)  # self.rng is seeded by reset(seed=...)
        self.low, self.high = LOW, HIGH
        self.solved = False
        rules = f"Guess a number from {{LOW}} to {{HIGH}}."
        return StepResult(observation=self._observe(rules))

    async def on_step(
        self, action: {cls}Action
    ) -> StepResult[{cls}Observation]:
        if action.guess == self.target:
            self.solved = True
            self.low = self.high = self.target
            return StepResult(observation=self._observe("correct"), reward=1.0, terminated=True)
        if action.guess < self.target:
            self.low = max(self.low, action.guess + 1)
            message = "higher"
        else:
            self.high = min(self.high, action.guess - 1)
            message = "lower"
        return StepResult(observation=self._observe(message), reward=0.0)

    def extra_state(self) -> dict[str, Any]:
        return {{"low": self.low, "high": self.high, "solved": self.solved}}

    @tool
    async def midpoint(self) -> int:
        """The middle of the range the number is still known to lie in."""
        return (self.low + self.high) // 2

    def _observe(self, message: str) -> {cls}Observation:
        return {cls}Observation(message=message, low=self.low, high=self.high)
'''

TEST = '''\
"""Tests of {env_id}; ``pytest`` runs them without installing the package."""

from __future__ import annotations

import asyncio

from envport.check import check_env

from {package}.env import {cls}Env


async def _play(seed: int) -> tuple[int, float]:
    """Binary search with the midpoint tool; returns (steps, final reward)."""
    env = {cls}Env()
    try:
        await env.reset(seed=seed)
        for steps in range(1, 101):
            guess = await env.call_tool("midpoint")
            result = await env.step({{"guess": guess}})
            if result.terminated:
                return steps, result.reward or 0.0
        raise AssertionError("binary search did not finish")
    finally:
        await env.close()


def test_binary_search_wins_within_seven_guesses() -> None:
    steps, reward = asyncio.run(_play(seed=3))
    assert reward == 1.0
    assert steps <= 7


def test_same_seed_same_number() -> None:
    assert asyncio.run(_play(seed=11)) == asyncio.run(_play(seed=11))


def test_passes_envport_check() -> None:
    report = asyncio.run(check_env({cls}Env, leak_grace_s=5.0))
    assert report.ok, report.failures
'''
