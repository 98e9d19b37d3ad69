"""The environment checker: passes good environments, names the check a bad one fails."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from typing import IO, Any, ClassVar

import pytest
from pydantic import BaseModel, Field

from envport import Action, Env, Observation, State, StepResult, tool
from envport.check import CheckReport, CheckStatus, check, check_env, example_from_schema
from envport.errors import UnknownEnvError

# --- a good environment and broken variants of it -------------------------------------


class CountAction(Action):
    amount: int = Field(ge=0, le=10, examples=[2])


class CountObservation(Observation):
    total: int = 0
    start: int = 0


class CountEnv(Env[CountAction, CountObservation]):
    """Adds amounts to a seeded starting total; reward is amount / 10."""

    action_type = CountAction
    observation_type = CountObservation
    reward_range = (0.0, 1.0)
    check_actions: ClassVar[list[dict[str, Any]]] = [{"amount": 1}, {"amount": 3}]

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.total = self.rng.randint(0, 1000)
        return StepResult(observation=CountObservation(total=self.total, start=self.total))

    async def on_step(self, action: CountAction) -> StepResult[CountObservation]:
        self.total += action.amount
        obs = CountObservation(total=self.total)
        return StepResult(observation=obs, reward=self.reward(action))

    def reward(self, action: CountAction) -> float:
        return action.amount / 10

    @tool
    async def peek(self) -> int:
        """The current total."""
        return self.total


class SyncCountEnv(CountEnv):
    """The same environment with plain (threaded) hooks."""

    def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.total = self.rng.randint(0, 1000)
        return StepResult(observation=CountObservation(total=self.total, start=self.total))

    def on_step(self, action: CountAction) -> StepResult[CountObservation]:
        self.total += action.amount
        return StepResult(observation=CountObservation(total=self.total), reward=0.5)


class UnseededEnv(CountEnv):
    """Draws its first observation from the OS, ignoring the seed."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.total = uuid.uuid4().int % (1 << 40)  # two draws alike: 1 in 10**12
        return StepResult(observation=CountObservation(total=self.total))


class GlobalRandomEnv(CountEnv):
    """Draws a hidden target from the global random module: the seed fixes nothing, yet
    the first observation, state() and these steps' results look the same every time."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.target = random.randint(1, 10)
        return StepResult(observation=CountObservation(total=0))

    async def on_step(self, action: CountAction) -> StepResult[CountObservation]:
        return StepResult(observation=CountObservation(total=action.amount), reward=0.5)


class SecretInStateEnv(CountEnv):
    """A constant first observation; the unseeded secret shows only in state()."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.secret = uuid.uuid4().hex
        return StepResult(observation=CountObservation(total=0))

    def extra_state(self) -> dict[str, Any]:
        return {"secret": self.secret}


class UnseededStepEnv(CountEnv):
    """Seeded resets, but steps add noise from the OS."""

    async def on_step(self, action: CountAction) -> StepResult[CountObservation]:
        self.total += action.amount + uuid.uuid4().int % (1 << 40)
        return StepResult(observation=CountObservation(total=self.total), reward=0.5)


class SeedsGlobalRandomEnv(CountEnv):
    """Uses the global random module, but seeds it from the seed: deterministic."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        random.seed(seed)
        self.total = random.randint(0, 1000)
        return StepResult(observation=CountObservation(total=self.total, start=self.total))


class ResourceIdsEnv(CountEnv):
    """Names its own per-instance resources in state(): ids and a private directory."""

    def __init__(self) -> None:
        super().__init__()
        self.workdir = tempfile.mkdtemp(prefix="envport-test-")

    def extra_state(self) -> dict[str, Any]:
        return {"sandbox_id": uuid.uuid4().hex, "workdir": self.workdir}

    def on_close(self) -> None:
        os.rmdir(self.workdir)


class CarriesOverEnv(CountEnv):
    """Starts each episode where the last one ended: seeded, yet the seed does not fix it."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.total += self.rng.randint(0, 1000)
        return StepResult(observation=CountObservation(total=self.total, start=self.total))


class SetInfoEnv(CountEnv):
    """A set in every step's info: fine in-process, a 500 on every served /step."""

    async def on_step(self, action: CountAction) -> StepResult[CountObservation]:
        result = await super().on_step(action)
        return result.model_copy(update={"info": {"seen": {action.amount}}})


class HugeIntResetEnv(CountEnv):
    """An integer past 64 bits in the first result's info: orjson cannot encode it."""

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        result = await super().on_reset(seed, **options)
        return result.model_copy(update={"info": {"big": 2**70}})


class HugeIntStateEnv(CountEnv):
    def extra_state(self) -> dict[str, Any]:
        return {"big": 2**70}


class TooRewardingEnv(CountEnv):
    def reward(self, action: CountAction) -> float:
        return 2.0


class NanRewardEnv(CountEnv):
    reward_range = (-math.inf, math.inf)

    def reward(self, action: CountAction) -> float:
        return math.nan


class StuckCountEnv(CountEnv):
    async def state(self) -> State:
        self._check_open()
        return State(episode_id=self.episode_id, step_count=0)


class CloseOnceEnv(CountEnv):
    async def close(self) -> None:
        if getattr(self, "closed_before", False):
            raise RuntimeError("already closed")
        self.closed_before = True
        await super().close()


class OpenAfterCloseEnv(CountEnv):
    async def state(self) -> State:  # forgets the closed check
        return State(episode_id=self.episode_id, step_count=self.step_count)


class StepFailsEnv(CountEnv):
    async def on_step(self, action: CountAction) -> StepResult[CountObservation]:
        raise ZeroDivisionError("oops")


class PlainCountAction(Action):
    amount: int = Field(ge=0, le=10)  # no default, no examples


class NoActionsEnv(CountEnv):
    action_type = PlainCountAction
    check_actions = None  # type: ignore[assignment]


class LeakyThreadEnv(CountEnv):
    release = threading.Event()

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        threading.Thread(target=self.release.wait, name="leaky-worker", daemon=True).start()
        return await super().on_reset(seed, **options)


class LeakyTempFileEnv(CountEnv):
    made: ClassVar[list[str]] = []

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        fd, path = tempfile.mkstemp(prefix="leaky-", suffix=".txt")
        os.close(fd)
        self.made.append(path)
        return await super().on_reset(seed, **options)


class LeakyFileEnv(CountEnv):
    opened: ClassVar[list[IO[str]]] = []

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        self.opened.append(open(os.devnull))  # noqa: ASYNC230, SIM115 - the leak under test
        return await super().on_reset(seed, **options)


class LeakyProcessEnv(CountEnv):
    started: ClassVar[list[subprocess.Popen[bytes]]] = []

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[CountObservation]:
        cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
        self.started.append(subprocess.Popen(cmd))  # noqa: ASYNC220 - the leak under test
        return await super().on_reset(seed, **options)


@pytest.fixture(autouse=True)
def _release_leaks() -> Iterator[None]:
    LeakyThreadEnv.release.clear()
    yield
    LeakyThreadEnv.release.set()
    for path in LeakyTempFileEnv.made:
        if os.path.exists(path):
            os.unlink(path)
    for fh in LeakyFileEnv.opened:
        fh.close()
    for proc in LeakyProcessEnv.started:
        proc.kill()
        proc.wait()
    LeakyTempFileEnv.made.clear()
    LeakyFileEnv.opened.clear()
    LeakyProcessEnv.started.clear()


async def _check(env: Any) -> CheckReport:
    return await check_env(env, leak_grace_s=0.3)


def _failed(report: CheckReport) -> set[str]:
    return {r.name for r in report.failures}


# --- passing --------------------------------------------------------------------------


async def test_echo_passes() -> None:
    report = await check_env("echo-v1")
    assert report.ok, report.failures
    assert report.env_id == "echo-v1"
    for name in ("types", "schemas", "reset", "reset_determinism", "step_count", "leaks"):
        assert report.get(name).status is CheckStatus.PASS, report.get(name)


@pytest.mark.parametrize("env", [CountEnv, SyncCountEnv])
async def test_a_correct_env_passes_every_check(env: type) -> None:
    report = await check_env(env)
    assert [r for r in report.results if r.status is not CheckStatus.PASS] == []
    assert "within (0.0, 1.0)" in report.get("reward_range").message


async def test_without_check_actions_step_is_a_warning_not_a_failure() -> None:
    report = await _check(NoActionsEnv)
    assert report.ok, report.failures
    assert report.get("step").status is CheckStatus.WARN
    assert "check_actions" in report.get("step").message
    assert report.get("action_example").status is CheckStatus.SKIP
    assert "amount" in report.get("action_example").message
    # step_count still runs, stepping with the list_tools action every env accepts.
    assert report.get("step_count").status is CheckStatus.PASS


@pytest.mark.parametrize("numpy_loaded", [False, True])
@pytest.mark.parametrize("env", [SeedsGlobalRandomEnv, ResourceIdsEnv])
async def test_determinism_passes_seeded_global_random_and_per_instance_resources(
    env: type, numpy_loaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With numpy imported too (by anything in the process), an env that seeds `random`
    itself and never touches numpy passes: the two generators are judged apart (both
    together failed it whenever numpy was loaded, as in the full suite)."""
    if numpy_loaded:
        pytest.importorskip("numpy")
    else:
        monkeypatch.delitem(sys.modules, "numpy", raising=False)
    report = await _check(env)
    assert report.ok, report.failures
    assert "3 step result(s)" in report.get("reset_determinism").message


async def test_a_draw_by_someone_else_during_the_determinism_check_is_not_the_env_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread of the process (a library's back-off jitter, say) draws from the
    global generator while the first instance runs: checked again, the env passes; an
    env that draws unseeded fails both times."""
    from envport import check

    reads = 0
    read = check._global_rng_state

    def disturbed() -> tuple[Any, ...]:
        nonlocal reads
        reads += 1
        if reads == 1:
            random.random()  # the other thread's draw, just before the first reading
        return read()

    monkeypatch.setattr(check, "_global_rng_state", disturbed)
    report = await _check(SeedsGlobalRandomEnv)
    assert report.ok, report.failures
    assert reads > 4  # the check ran twice
    bad = await _check(GlobalRandomEnv)
    assert "drew from the global random module" in bad.get("reset_determinism").message


async def test_check_leaves_the_global_random_state_as_it_found_it() -> None:
    random.seed(1234)
    before = random.getstate()
    report = await _check(CountEnv)  # the determinism check seeds it, then restores it
    assert report.ok
    assert random.getstate() == before


def test_sync_check_and_report_rendering() -> None:
    report = check("echo-v1")
    assert report.ok
    assert report.summary().startswith("echo-v1: passed")
    assert report.table().row_count == len(report.results)
    assert CheckReport.model_validate_json(report.model_dump_json()) == report


# --- failing, each with the right check named -----------------------------------------


@pytest.mark.parametrize(
    ("env", "check_name", "words"),
    [
        (UnseededEnv, "reset_determinism", "seed=0"),
        (GlobalRandomEnv, "reset_determinism", "drew from the global random module"),
        (
            SecretInStateEnv,
            "reset_determinism",
            "disagree on state() after reset(): differs in secret",
        ),
        (UnseededStepEnv, "reset_determinism", "disagree on step 1 ({'amount': 1})"),
        (
            CarriesOverEnv,
            "reset_determinism",
            "again on the same instance, after an episode, disagrees with its first "
            "episode on the first observation: differs in start, total",
        ),
        (SetInfoEnv, "step", "step({'amount': 1})'s result cannot be served"),
        (HugeIntResetEnv, "reset", "reset()'s result cannot be served"),
        (HugeIntStateEnv, "state_roundtrip", "state() cannot be served"),
        (TooRewardingEnv, "reward_range", "2.0"),
        (NanRewardEnv, "reward_range", "nan"),
        (StuckCountEnv, "step_count", "step_count is 0 after 1 step(s)"),
        (CloseOnceEnv, "close_twice", "already closed"),
        (OpenAfterCloseEnv, "closed_calls", "state() succeeded"),
        (LeakyThreadEnv, "leaks", "leaky-worker"),
        (LeakyTempFileEnv, "leaks", "temporary files left: leaky-"),
        (LeakyFileEnv, "leaks", "/dev/null"),
        (LeakyProcessEnv, "leaks", "child processes alive"),
    ],
)
async def test_a_broken_env_fails_the_named_check(env: type, check_name: str, words: str) -> None:
    report = await _check(env)
    assert not report.ok
    assert _failed(report) == {check_name}, report.failures
    assert words in report.get(check_name).message


async def test_an_env_that_raises_fails_that_check_and_the_rest_still_run() -> None:
    report = await _check(StepFailsEnv)
    assert "step" in _failed(report)
    assert "ZeroDivisionError" in report.get("step").message
    assert report.get("leaks").status is not CheckStatus.SKIP  # later checks ran
    assert report.get("close_twice").status is CheckStatus.PASS


async def test_a_factory_that_returns_no_env_fails_construct() -> None:
    report = await _check(lambda: object())
    assert [r.name for r in report.results] == ["construct"]
    assert _failed(report) == {"construct"}


async def test_invalid_check_actions_fail() -> None:
    class BadActions(CountEnv):
        check_actions: ClassVar[list[dict[str, Any]]] = [{"amount": 99}]

    report = await _check(BadActions)
    assert "check_actions" in _failed(report)
    assert "check_actions[0]" in report.get("check_actions").message


async def test_unknown_id_raises_with_a_suggestion() -> None:
    with pytest.raises(UnknownEnvError, match="Did you mean 'echo-v1'"):
        await check_env("ecko-v1")


# --- schema examples ------------------------------------------------------------------


class _Inner(BaseModel):
    level: int = Field(examples=[3])


class _Outer(BaseModel):
    name: str = Field(examples=["x"])
    mode: str = Field("fast")
    inner: _Inner
    tag: str | None = None


def test_example_from_schema_uses_examples_defaults_and_refs() -> None:
    example = example_from_schema(_Outer.model_json_schema())
    assert example == {"name": "x", "inner": {"level": 3}}
    assert _Outer.model_validate(example).inner.level == 3


def test_example_from_schema_names_the_missing_field() -> None:
    with pytest.raises(LookupError, match=r"inner\.level"):
        example_from_schema(
            {
                "type": "object",
                "required": ["inner"],
                "properties": {"inner": {"$ref": "#/$defs/I"}},
                "$defs": {"I": {"type": "object", "required": ["level"], "properties": {}}},
            }
        )
