"""Rubrics: name-based injection, weighted sums, errors as data, advantages, built-ins."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import fractions
import functools
import json
import math
import re
import threading
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from envport.client.client import EnvClient
from envport.client.transports import InProcessTransport
from envport.env import Env
from envport.envs.shell import FileEncoding, file_bytes
from envport.policy import ByteTokenizer, Generation, SamplingParams, create_policy_app
from envport.rubrics import (
    PARAMETERS,
    ClientHandle,
    CommandError,
    CommandTimeoutError,
    JudgeError,
    LocalDirHandle,
    NotSupportedError,
    RewardFunc,
    Rubric,
    RubricBuildError,
    RubricResult,
    Score,
    ScoringContext,
    UnknownRubricTypeError,
    extract_answer,
    from_specs,
    group_advantages,
    parse_verdict,
    register,
    registered_types,
    trace_advantages,
)
from envport.rubrics.builtin import last_number
from envport.rubrics.functions import set_reward_threads
from envport.tasks import RubricSpec, Task, builtin_names, load
from envport.tools import tool
from envport.trace.model import ErrorKind, Reward, StepRecord, Trace
from envport.types import Action, Observation, StepResult
from tests.support.servers import free_port, run_asgi

# --- helpers -----------------------------------------------------------------------------------


def make_trace(reply: str | None = "42", *, step_rewards: Sequence[float | None] = ()) -> Trace:
    trace = Trace(task_id="t")
    trace.reply("user", "What is 6 * 7?")
    if reply is not None:
        trace.reply("assistant", reply)
    trace.steps = [
        StepRecord(index=i, observation={"i": i}, reward=r) for i, r in enumerate(step_rewards)
    ]
    return trace


def ctx_for(reply: str | None = "42", answer: Any = "42", **kw: Any) -> ScoringContext:
    task = Task(prompt="What is 6 * 7?", answer=answer, metadata={"level": 1})
    return ScoringContext(trace=make_trace(reply), task=task, **kw)


async def score_one(spec: dict[str, Any], ctx: ScoringContext) -> tuple[float | None, Any]:
    """Score one built-in component; (total, result)."""
    result = await from_specs([RubricSpec.model_validate(spec)]).score(ctx)
    return result.total, result


# --- injection by name -------------------------------------------------------------------------


async def test_sync_and_async_functions_receive_what_they_name() -> None:
    seen: dict[str, Any] = {}

    def sync_fn(completion: str, reference: str, metadata: dict[str, Any]) -> float:
        seen["sync"] = (completion, reference, metadata)
        return 1.0

    async def async_fn(
        task: Task, trace: Trace, answer: str | None, params: dict[str, Any]
    ) -> bool:
        seen["async"] = (task.prompt, trace.task_id, answer, params)
        return False

    def positional_only(observation: dict[str, Any] | None, /, state: Any) -> int:
        seen["posonly"] = (observation, state)
        return 1

    rubric = Rubric(
        [sync_fn, RewardFunc(async_fn, 0.5, params={"k": 3}), RewardFunc(positional_only, 0.0)]
    )
    ctx = ctx_for("The answer is <answer>42</answer>", state={"s": 1})
    result = await rubric.score(ctx)

    assert result.errors == []
    assert seen["sync"] == ("The answer is <answer>42</answer>", "42", {"level": 1})
    assert seen["async"] == ("What is 6 * 7?", "t", "42", {"k": 3})
    assert seen["posonly"] == (None, {"s": 1})
    assert [r.name for r in result.rewards] == ["sync_fn", "async_fn", "positional_only"]
    assert result.total == 1.0


async def test_sync_functions_run_off_the_event_loop() -> None:
    loop_thread: list[bool] = []

    def blocking(completion: str) -> float:
        try:
            asyncio.get_running_loop()
            loop_thread.append(True)
        except RuntimeError:
            loop_thread.append(False)
        return 1.0

    await Rubric([blocking]).score(ctx_for())
    assert loop_thread == [False]


async def test_kwargs_receive_every_name_and_state_comes_from_the_env() -> None:
    got: dict[str, Any] = {}

    def everything(**kwargs: Any) -> float:
        got.update(kwargs)
        return 0.5

    handle = LocalDirHandle(".", state={"reference_answer": "42"})
    result = await Rubric([everything]).score(ctx_for(env=handle))
    assert set(got) == set(PARAMETERS)
    assert got["state"] == {"reference_answer": "42"}
    assert got["env"] is handle
    assert result.total == 0.5


def test_unknown_parameter_names_fail_when_the_rubric_is_built() -> None:
    def typo(completoin: str, answer: str) -> float:
        return 1.0

    with pytest.raises(RubricBuildError, match=r"'completoin'.*completion, answer, state"):
        Rubric([typo])

    # A keyword-only parameter with a default is configuration, e.g. from functools.partial.
    def thresholded(completion: str, *, threshold: float = 0.5) -> float:
        return float(len(completion) > threshold)

    Rubric([functools.partial(thresholded, threshold=1.0)])
    with pytest.raises(RubricBuildError, match="not callable"):
        RewardFunc(42)  # type: ignore[arg-type]


def test_reward_names_must_be_unique() -> None:
    def a(completion: str) -> float:
        return 1.0

    with pytest.raises(RubricBuildError, match="two rubric components are named 'a'"):
        Rubric([a, RewardFunc(a, 0.0)])


# --- weighted sums, metrics, errors --------------------------------------------------------------


async def test_weighted_sum_metrics_and_apply() -> None:
    def correct(answer: str | None, reference: str) -> float:
        return float(answer == reference)

    def brevity(completion: str) -> Score:
        return Score(0.5, "a bit long", metrics={"chars": len(completion)})

    def length(completion: str) -> float:
        return float(len(completion))

    rubric = Rubric(
        [RewardFunc(correct, 1.0), RewardFunc(brevity, 0.2), RewardFunc(length, 0.0, "len")]
    )
    trace = make_trace("Answer: 42", step_rewards=[0.3, 0.7])
    task = Task(prompt="What is 6 * 7?", answer="42")
    result = await rubric.score_trace(trace, task)

    assert result.total == pytest.approx(1.0 * 1.0 + 0.2 * 0.5)
    assert result.metrics == {"len": 10.0, "brevity/chars": 10.0}
    assert [(r.name, r.value, r.weight) for r in result.rewards] == [
        ("correct", 1.0, 1.0),
        ("brevity", 0.5, 0.2),
        ("len", 10.0, 0.0),
    ]
    assert result.rewards[1].reason == "a bit long"
    # Recorded on the trace; the environment's step rewards stay where they were.
    assert trace.reward == result.total == pytest.approx(trace.weighted_reward())
    assert [r.name for r in trace.rewards] == ["correct", "brevity", "len"]
    assert all(r.step_index is None for r in trace.rewards)
    assert trace.step_rewards() == [(0, 0.3), (1, 0.7)]
    assert trace.metrics["len"] == 10.0
    assert "scoring" in trace.timings
    # Trace survives a JSON round trip with the result on it.
    assert Trace.from_json(trace.to_json()).reward == trace.reward


async def test_a_raising_function_is_an_error_and_the_run_is_unscored() -> None:
    def fine(completion: str) -> float:
        return 1.0

    async def broken(completion: str) -> float:
        raise RuntimeError("grader exploded")

    result = await Rubric([fine, RewardFunc(broken, 0.5)]).score(ctx_for())

    assert result.total is None  # not 0.0
    assert not result.ok
    [error] = result.errors
    assert error.kind is ErrorKind.RUBRIC
    assert error.where == "rubric:broken"
    assert error.type == "RuntimeError"
    assert "grader exploded" in error.message
    assert error.traceback is not None
    assert "grader exploded" in error.traceback
    assert [r.name for r in result.rewards] == ["fine"]  # the others still scored

    trace = result.apply(make_trace())
    assert trace.reward is None
    assert trace.errors[-1].where == "rubric:broken"


async def test_a_failing_metric_is_recorded_but_keeps_the_total() -> None:
    def fine(completion: str) -> float:
        return 1.0

    def flaky_metric(completion: str) -> float:
        raise ValueError("no tokenizer")

    result = await Rubric([fine, RewardFunc(flaky_metric, 0.0)]).score(ctx_for())
    assert result.total == 1.0
    assert [e.where for e in result.errors] == ["rubric:flaky_metric"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "returned NoneType"),
        ("1.0", "returned str"),
        (b"1", "returned bytes"),
        (1 + 0j, "returned complex"),
        (math.nan, "finite"),
        (Score("0.5"), "returned a Score whose value is str"),  # type: ignore[arg-type]
        (Score(1.0, metrics={"m": "2"}), "metric 'm'"),  # type: ignore[dict-item]
    ],
)
async def test_bad_return_values_are_errors_not_zero(value: Any, message: str) -> None:
    def bad(completion: str) -> Any:
        return value

    result = await Rubric([bad]).score(ctx_for())
    assert result.total is None
    assert message in result.errors[0].message


def returning(value: Any) -> Any:
    def fn(completion: str | None) -> Any:
        return value

    return fn


async def test_numpy_numbers_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    returns = {
        "f32": np.float32(0.5),
        "i64": np.int64(2),
        "yes": np.bool_(True),
        "no": np.bool_(False),
        "zero_d": np.array(0.25),
        "fraction": fractions.Fraction(1, 4),
        "score": Score(np.float64(1.5), metrics={"n": np.int32(3), "ok": np.bool_(True)}),
    }
    funcs = [RewardFunc(returning(v), name=name) for name, v in returns.items()]
    result = await Rubric(funcs).score(ctx_for())

    assert result.errors == []
    assert [(r.name, r.value) for r in result.rewards] == [
        ("f32", 0.5),
        ("i64", 2.0),
        ("yes", 1.0),
        ("no", 0.0),
        ("zero_d", 0.25),
        ("fraction", 0.25),
        ("score", 1.5),
    ]
    assert all(type(r.value) is float for r in result.rewards)
    assert result.metrics == {"score/n": 3.0, "score/ok": 1.0}
    assert all(type(v) is float for v in result.metrics.values())
    assert result.total == pytest.approx(0.5 + 2 + 1 + 0 + 0.25 + 0.25 + 1.5)
    assert Trace.from_json(result.apply(make_trace()).to_json()).reward == result.total

    # Not numbers: a complex numpy value, an array of several, a NaN float32.
    for bad, message in [
        (np.complex128(1), "returned complex128"),
        (np.array([0.5, 0.5]), "returned ndarray"),
        (np.float32("nan"), "finite"),
    ]:
        result = await Rubric([returning(bad)]).score(ctx_for())
        assert result.total is None
        assert message in result.errors[0].message


async def test_a_function_past_its_timeout_is_an_error() -> None:
    async def slow(completion: str) -> float:
        await asyncio.sleep(30)
        return 1.0

    result = await Rubric([RewardFunc(slow, timeout_s=0.05)]).score(ctx_for())
    assert result.total is None
    assert "did not finish within 0.05 s" in result.errors[0].message


async def test_system_exit_and_a_stray_cancellation_are_component_failures() -> None:
    def exits(completion: str) -> float:
        raise SystemExit(3)

    async def exits_async(completion: str) -> float:
        raise SystemExit("bye")

    async def awaits_a_cancelled_task(completion: str) -> float:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        inner.cancel()
        await inner
        return 1.0

    def fine(completion: str) -> float:
        return 1.0

    funcs = [fine, exits, exits_async, RewardFunc(awaits_a_cancelled_task, 0.0)]
    result = await Rubric(funcs).score(ctx_for())

    assert result.total is None
    assert [r.name for r in result.rewards] == ["fine"]
    errors = {e.where: e for e in result.errors}
    assert set(errors) == {"rubric:exits", "rubric:exits_async", "rubric:awaits_a_cancelled_task"}
    assert "raised SystemExit(3)" in errors["rubric:exits"].message
    assert "raised SystemExit('bye')" in errors["rubric:exits_async"].message
    assert "scoring was not cancelled" in errors["rubric:awaits_a_cancelled_task"].message
    assert all(e.kind is ErrorKind.RUBRIC for e in result.errors)


async def test_cancelling_the_scoring_still_cancels_it() -> None:
    started = asyncio.Event()

    async def slow(completion: str) -> float:
        started.set()
        await asyncio.sleep(30)
        return 1.0

    scoring = asyncio.ensure_future(Rubric([slow]).score(ctx_for()))
    await asyncio.wait_for(started.wait(), 10)
    scoring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await scoring
    assert scoring.cancelled()


@pytest.fixture
def two_reward_threads() -> Iterator[None]:
    set_reward_threads(2)
    yield
    set_reward_threads(None)


async def test_hung_sync_functions_do_not_starve_asyncio_to_thread() -> None:
    """Sync graders run on envport's own reward threads, not asyncio's default executor:
    graders stuck past their timeouts leave asyncio.to_thread work elsewhere alone."""
    release = threading.Event()
    small = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    asyncio.get_running_loop().set_default_executor(small)

    def hangs(completion: str) -> float:
        release.wait(30)
        return 1.0

    try:
        rubric = Rubric([RewardFunc(hangs, timeout_s=0.2)])
        results = await asyncio.gather(*(rubric.score(ctx_for()) for _ in range(3)))
        assert all(r.total is None for r in results)
        assert all("did not finish within 0.2 s" in r.errors[0].message for r in results)
        # The default executor has 2 threads and 3 graders are stuck: it must still be free.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "done"), 10) == "done"
    finally:
        release.set()
        small.shutdown(wait=False)


@pytest.mark.usefixtures("two_reward_threads")
async def test_a_sync_call_waits_for_a_reward_thread_within_its_timeout() -> None:
    release = threading.Event()
    ran: list[str] = []

    def hangs(completion: str) -> float:
        ran.append(threading.current_thread().name)
        release.wait(30)
        return 1.0

    def quick(completion: str) -> float:
        ran.append("quick")
        return 1.0

    try:
        stuck = await Rubric([RewardFunc(hangs, timeout_s=0.2)]).score(ctx_for())
        stuck_too = await Rubric([RewardFunc(hangs, timeout_s=0.2)]).score(ctx_for())
        assert "did not finish" in stuck.errors[0].message
        assert "did not finish" in stuck_too.errors[0].message
        assert sorted(ran) == ["envport-reward-0", "envport-reward-1"]

        # Both threads are held: a new sync call waits for one, and gives up at its timeout.
        blocked = await Rubric([RewardFunc(quick, timeout_s=0.3)]).score(ctx_for())
        assert blocked.total is None
        assert "did not start within 0.3 s: all 2 reward threads were busy" in (
            blocked.errors[0].message
        )

        # Async functions do not need a thread.
        async def async_quick(completion: str) -> float:
            return 1.0

        assert (await Rubric([async_quick]).score(ctx_for())).total == 1.0

        # A call that gets a thread within its timeout runs.
        asyncio.get_running_loop().call_later(0.2, release.set)
        waited = await Rubric([RewardFunc(quick, timeout_s=10)]).score(ctx_for())
        assert waited.total == 1.0
        assert ran.count("quick") == 1  # the one that gave up never ran
    finally:
        release.set()


async def test_env_without_a_handle_is_an_error() -> None:
    async def needs_env(env: Any) -> float:
        return 1.0

    result = await Rubric([needs_env]).score(ctx_for())
    assert "no environment handle" in result.errors[0].message


async def test_empty_or_metric_only_rubrics_give_no_total_and_no_failure() -> None:
    empty = await Rubric([]).score(ctx_for())
    assert (empty.total, empty.weighted, empty.failed) == (None, False, False)

    def m(completion: str) -> float:
        return 3.0

    def broken(completion: str) -> float:
        raise ValueError("no tokenizer")

    rubric = Rubric([RewardFunc(m, 0.0)])
    assert not rubric.weighted
    result = await rubric.score(ctx_for())
    assert result.total is None
    assert not result.weighted
    assert not result.failed  # nothing to total is not a failed scoring
    assert result.metrics == {"m": 3.0}

    # A failed metric in a metrics-only rubric is recorded, and still is not a failure.
    result = await Rubric([RewardFunc(m, 0.0), RewardFunc(broken, 0.0)]).score(ctx_for())
    assert (result.total, result.failed, result.ok) == (None, False, False)
    assert [e.where for e in result.errors] == ["rubric:broken"]

    # A weighted component that failed is: the same total None, told apart by `failed`.
    result = await Rubric([RewardFunc(m, 0.0), RewardFunc(broken, 1.0)]).score(ctx_for())
    assert (result.total, result.weighted, result.failed) == (None, True, True)
    scored = await Rubric([RewardFunc(m, 1.0), RewardFunc(broken, 0.0)]).score(ctx_for())
    assert (scored.total, scored.weighted, scored.failed) == (3.0, True, False)
    assert RubricResult.model_validate_json(scored.model_dump_json()).weighted


# --- group advantages --------------------------------------------------------------------------


def test_group_advantages_grpo_and_dr_grpo() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0]
    std = math.sqrt((4 * 0.25) / 3)  # sample std, as TRL computes it
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2
    grpo = group_advantages(rewards)
    assert grpo == pytest.approx([expected[0], expected[1], expected[1], expected[0]])
    assert group_advantages(rewards, normalize_std=False) == [0.5, -0.5, -0.5, 0.5]

    # None (an unscored run) is skipped: it keeps its place and does not count.
    with_none = group_advantages([3.0, None, 1.0], normalize_std=False)
    assert with_none == [1.0, None, -1.0]
    assert group_advantages([2.0, 2.0, 2.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]
    assert group_advantages([None, None]) == [None, None]
    assert group_advantages([]) == []


def test_trace_advantages_group_by_group_id() -> None:
    traces = [
        Trace(group_id="a", reward=1.0),
        Trace(group_id="a", reward=0.0),
        Trace(group_id="b", reward=5.0),
        Trace(group_id="b", reward=None),
        Trace(reward=7.0),
    ]
    adv = trace_advantages(traces, normalize_std=False)
    assert [adv[t.trace_id] for t in traces] == [0.5, -0.5, 0.0, None, 0.0]


# --- answers -----------------------------------------------------------------------------------


def test_extract_answer() -> None:
    assert extract_answer("thinking <answer> 7 </answer> then <answer>8</answer>") == "8"
    assert extract_answer(r"so \boxed{\frac{1}{2}} is it") == r"\frac{1}{2}"
    assert extract_answer("work...\nFinal answer: 12\n") == "12"
    assert extract_answer("just 12") is None
    assert extract_answer(None) is None
    assert ScoringContext(trace=make_trace(None)).completion is None


# --- exact_match, numeric_match, regex, env_reward -----------------------------------------------


@pytest.mark.parametrize(
    ("params", "reply", "reference", "expected"),
    [
        ({}, "  Paris \n", "paris", 1.0),
        ({}, "New   York", "new york", 1.0),
        ({"case_sensitive": True}, "paris", "Paris", 0.0),
        ({"normalize_whitespace": False}, "New   York", "New York", 0.0),
        ({}, "<answer>Lyon</answer> (not Paris)", "lyon", 1.0),
        ({}, "Rome", ["Paris", "Rome"], 1.0),
        ({}, "42", 42, 1.0),
        ({"expected": "x"}, "X", "ignored", 1.0),
        ({}, "London", "Paris", 0.0),
        ({}, None, "Paris", 0.0),
    ],
)
async def test_exact_match(
    params: dict[str, Any], reply: str | None, reference: Any, expected: float
) -> None:
    total, _ = await score_one({"type": "exact_match", **params}, ctx_for(reply, reference))
    assert total == expected


async def test_exact_match_without_a_reference_is_an_error() -> None:
    total, result = await score_one({"type": "exact_match"}, ctx_for("x", None))
    assert total is None
    assert "no reference answer" in result.errors[0].message


@pytest.mark.parametrize(
    ("params", "reply", "reference", "expected"),
    [
        ({}, "The total is 1,234.", "1234", 1.0),
        ({}, "First 3, then 5", 5, 1.0),
        ({}, "<answer>0.5</answer> or maybe 7", "0.5", 1.0),
        ({}, "3.1416", "3.14159", 0.0),
        ({"abs_tol": 0.001}, "3.1416", "3.14159", 1.0),
        ({"rel_tol": 0.01}, "99.5", 100, 1.0),
        ({"rel_tol": 0.001}, "99.5", 100, 0.0),
        ({}, "\u22127", "-7", 1.0),
        ({}, "The range is 10-20", 20, 1.0),
        ({}, "x = -5", -5, 1.0),
        ({}, "no digits here", "7", 0.0),
        ({}, None, "7", 0.0),
    ],
)
async def test_numeric_match(
    params: dict[str, Any], reply: str | None, reference: Any, expected: float
) -> None:
    total, _ = await score_one({"type": "numeric_match", **params}, ctx_for(reply, reference))
    assert total == expected


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The range is 10-20", 20.0),
        ("COVID-19", 19.0),
        ("3-5=-2", -2.0),
        ("-5", -5.0),
        ("x = -5", -5.0),
        ("answer: -3.2", -3.2),
        ("(-7)", -7.0),
        ("\u22127", -7.0),
        ("a rate of 1e-5", 1e-5),
        ("-1,234 and +.5", 0.5),
        ("no digits", None),
    ],
)
def test_last_number_reads_a_hyphen_after_a_word_as_no_sign(
    text: str, number: float | None
) -> None:
    assert last_number(text) == number


async def test_numeric_match_with_a_non_numeric_reference_is_an_error() -> None:
    total, result = await score_one({"type": "numeric_match"}, ctx_for("7", "seven"))
    assert total is None
    assert "not a number" in result.errors[0].message


async def test_regex() -> None:
    ctx = ctx_for("def solve():\n    return 42")
    assert (await score_one({"type": "regex", "pattern": r"return \d+"}, ctx))[0] == 1.0
    assert (await score_one({"type": "regex", "pattern": "RETURN"}, ctx))[0] == 0.0
    spec = {"type": "regex", "pattern": "RETURN", "ignore_case": True}
    assert (await score_one(spec, ctx))[0] == 1.0
    spec = {"type": "regex", "pattern": r"\d+", "fullmatch": True}
    assert (await score_one(spec, ctx))[0] == 0.0
    spec = {"type": "regex", "pattern": r"\d+", "fullmatch": True, "target": "answer"}
    assert (await score_one(spec, ctx_for("<answer>42</answer>")))[0] == 1.0
    with pytest.raises(RubricBuildError, match="does not compile"):
        from_specs([RubricSpec(type="regex", params={"pattern": "("})])


async def test_env_reward_sum_and_last_are_separate_from_the_rubric() -> None:
    trace = make_trace(step_rewards=[0.25, None, 0.5, 1.0])
    ctx = ScoringContext(trace=trace)
    assert (await score_one({"type": "env_reward"}, ctx))[0] == 1.75
    total, result = await score_one({"type": "env_reward", "mode": "last"}, ctx)
    assert total == 1.0
    assert result.metrics == {"env_reward/steps": 3.0}
    total, result = await score_one({"type": "env_reward"}, ScoringContext(trace=make_trace()))
    assert total == 0.0
    assert result.rewards[0].reason == "the environment gave no step rewards"
    with pytest.raises(RubricBuildError, match="mode must be"):
        from_specs([RubricSpec(type="env_reward", params={"mode": "max"})])


# --- test_command with a local directory ---------------------------------------------------------


def command_ctx(tmp_path: Path, task: Task | None = None) -> ScoringContext:
    return ScoringContext(trace=make_trace(), task=task, env=LocalDirHandle(tmp_path))


async def test_test_command_reads_the_exit_status(tmp_path: Path) -> None:
    (tmp_path / "solution.txt").write_text("42\n")
    ok = {"type": "test_command", "command": "grep -q 42 solution.txt"}
    total, result = await score_one(ok, command_ctx(tmp_path))
    assert total == 1.0
    assert result.metrics == {"test_command/exit_code": 0.0}

    failing = {"type": "test_command", "command": "echo 'expected 43' >&2; exit 1"}
    total, result = await score_one(failing, command_ctx(tmp_path))
    assert total == 0.0
    assert result.rewards[0].reason == "exit status 1: expected 43"


async def test_test_command_prefers_the_reward_file(tmp_path: Path) -> None:
    spec = {
        "type": "test_command",
        "command": "mkdir -p logs && echo 0.25 > logs/reward.txt; exit 1",
        "reward_file": "logs/reward.txt",
        "reward_json": "logs/reward.json",
    }
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert total == 0.25
    assert result.rewards[0].reason == "from logs/reward.txt"
    assert result.metrics == {"test_command/exit_code": 1.0}


async def test_test_command_reads_reward_json(tmp_path: Path) -> None:
    spec = {
        "type": "test_command",
        "command": """echo '{"reward": 0.75, "passed": 3, "total": 4}' > reward.json""",
        "reward_file": "reward.txt",  # not written: falls through to the JSON file
        "reward_json": "reward.json",
    }
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert total == 0.75
    assert result.metrics == {
        "test_command/exit_code": 0.0,
        "test_command/passed": 3.0,
        "test_command/total": 4.0,
    }


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("echo 'all good' > reward.txt", "not a number"),
        ("echo '{\"score\": 1}' > reward.json", "no numeric 'reward' key"),
    ],
)
async def test_test_command_with_an_unreadable_reward_file_is_an_error(
    tmp_path: Path, command: str, message: str
) -> None:
    spec = {
        "type": "test_command",
        "command": command,
        "reward_file": "reward.txt",
        "reward_json": "reward.json",
    }
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert total is None
    assert message in result.errors[0].message


async def test_test_command_refuses_a_reward_file_written_before_it_ran(tmp_path: Path) -> None:
    (tmp_path / "reward.txt").write_text("1.0\n")  # e.g. forged by the agent
    spec = {"type": "test_command", "command": "exit 1", "reward_file": "reward.txt"}
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert total is None
    assert "exists before the tests ran" in result.errors[0].message


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return bool(re.search(r"^State:\s+Z", status, re.M))  # killed, awaiting its reaper


async def test_test_command_timeout_kills_the_process_group(tmp_path: Path) -> None:
    spec = {
        "type": "test_command",
        "command": "sleep 30 & echo $! > child.pid; wait",
        "timeout_s": 0.5,
    }
    started = time.monotonic()
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert time.monotonic() - started < 20
    assert total is None
    [error] = result.errors
    assert error.type == "CommandTimeoutError"
    assert "ran past its 0.5 s timeout and was killed" in error.message
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, f"grandchild {pid} still alive"
        await asyncio.sleep(0.05)


async def test_test_command_that_leaves_a_server_running_is_scored_when_it_exits(
    tmp_path: Path,
) -> None:
    """A test script that starts a server in the background and exits: its result is its
    exit status, not a timeout (the server holds the output pipes open), and the server
    does not outlive the scoring, whether it kept the pipes or not."""
    spec = {
        "type": "test_command",
        "command": (
            "sleep 300 & echo $! > server.pid; "
            "sleep 300 >/dev/null 2>&1 & echo $! > quiet.pid; "
            "echo '3 passed'"
        ),
        "timeout_s": 30,
    }
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert result.errors == []
    assert total == 1.0
    assert result.rewards[0].reason == "exit status 0"
    for name in ("server.pid", "quiet.pid"):
        pid = int((tmp_path / name).read_text())
        deadline = time.monotonic() + 10
        while not _gone(pid):
            assert time.monotonic() < deadline, f"{name} {pid} still alive after scoring"
            await asyncio.sleep(0.05)
    handle = LocalDirHandle(tmp_path)
    ran = await handle.run("sleep 300 & echo started; echo done >&2", timeout_s=30)
    assert (ran.exit_code, ran.stdout, ran.stderr) == (0, "started\n", "done\n")


async def test_a_grader_flooding_its_output_is_held_in_bounded_memory_tail_kept(
    tmp_path: Path,
) -> None:
    """100 MB of output then a summary line: a bounded tail is kept (the summary is in it,
    and so in the reward's reason), not the whole output in memory. The cut falls inside
    a two-byte character, which is dropped whole rather than shown as U+FFFD."""
    handle = LocalDirHandle(tmp_path)
    command = (
        "printf x; yes \u00e9 | tr -d '\\n' | head -c 100000000; "
        "printf '\\n1 failed, 2 passed.\\n'; exit 1"
    )
    tracemalloc.start()
    try:
        result = await handle.run(command, timeout_s=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, f"{peak} bytes traced while reading the output"
    assert result.exit_code == 1
    assert len(result.stdout.encode()) < 1_100_000
    assert result.stdout.endswith("\u00e9" * 1000 + "\n1 failed, 2 passed.\n")
    assert "earlier bytes of output dropped" in result.stdout
    assert "\ufffd" not in result.stdout

    spec = {"type": "test_command", "command": command, "timeout_s": 60}
    total, scored = await score_one(spec, command_ctx(tmp_path))
    assert total == 0.0
    assert scored.rewards[0].reason is not None
    assert scored.rewards[0].reason.endswith("1 failed, 2 passed.")


async def test_test_command_that_cannot_run_is_an_error_not_zero(tmp_path: Path) -> None:
    spec = {"type": "test_command", "command": "definitely-not-a-command-envport"}
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert total is None
    assert result.errors[0].type == "CommandError"
    assert "could not run (not found, exit 127)" in result.errors[0].message

    spec = {"type": "test_command", "command": ["definitely-not-a-command-envport"]}
    total, result = await score_one(spec, command_ctx(tmp_path))
    assert total is None
    assert "cannot run" in result.errors[0].message

    gone = ScoringContext(trace=make_trace(), env=LocalDirHandle(tmp_path / "missing"))
    total, result = await score_one({"type": "test_command", "command": "true"}, gone)
    assert total is None
    assert "does not exist" in result.errors[0].message


async def test_test_command_uploads_tests_dir_relative_to_the_task(tmp_path: Path) -> None:
    task_root = tmp_path / "task"
    (task_root / "tests").mkdir(parents=True)
    (task_root / "tests" / "test.sh").write_text("grep -q hello ../out.txt\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "out.txt").write_text("hello\n")
    spec = RubricSpec(
        type="test_command",
        params={"command": "cd checks && bash test.sh", "tests_dir": "tests"},
    )
    spec = spec.model_copy(update={"params": {**spec.params, "tests_mount": "checks"}})
    task = Task(prompt="say hello", rubric=(spec,), root=str(task_root))
    result = await Rubric.for_task(task).score(
        ScoringContext(trace=make_trace(), task=task, env=LocalDirHandle(work))
    )
    assert result.total == 1.0, result.errors
    assert (work / "checks" / "test.sh").is_file()


async def test_local_dir_handle_confines_files(tmp_path: Path) -> None:
    (tmp_path / "inside.txt").write_text("ok")
    handle = LocalDirHandle(tmp_path)
    assert await handle.read_file("inside.txt") == "ok"
    assert await handle.read_file(str(tmp_path / "inside.txt")) == "ok"
    with pytest.raises(FileNotFoundError):
        await handle.read_file("absent.txt")
    with pytest.raises(PermissionError, match="outside the working directory"):
        await handle.read_file("../escape.txt")
    with pytest.raises(PermissionError):
        await handle.read_file("/etc/hostname")
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(PermissionError):
        await handle.read_file("link/hostname")
    with pytest.raises(NotSupportedError):
        await handle.call_tool("anything")
    with pytest.raises(CommandTimeoutError):
        await handle.run(["sleep", "10"], timeout_s=0.1)
    result = await handle.run("echo out; echo err >&2; exit 3", timeout_s=10)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")


async def test_harbor_style_spec_reports_paths_outside_a_local_dir(tmp_path: Path) -> None:
    """Harbor's absolute /logs/verifier paths need a sandbox; locally they are an error."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test.sh").write_text("exit 0\n")
    spec = RubricSpec(
        type="test_command",
        params={
            "command": "true",
            "reward_file": "/logs/verifier/reward.txt",
            "reward_json": "/logs/verifier/reward.json",
        },
    )
    result = await from_specs([spec]).score(command_ctx(tmp_path))
    assert result.total is None
    assert "outside the working directory" in result.errors[0].message


# --- environment clients -----------------------------------------------------------------------


async def test_client_handle_state_and_unsupported_operations() -> None:
    async with EnvClient.connect("arithmetic-v1") as client:
        await client.reset(seed=0)
        handle = ClientHandle(client)

        def knows(state: dict[str, Any], completion: str) -> float:
            return float(state["reference_answer"] == completion)

        async def runs(env: Any) -> float:
            await env.run("pytest", timeout_s=5)
            return 1.0

        state = await handle.state()
        result = await Rubric([knows, RewardFunc(runs, 0.0)]).score(
            ScoringContext(trace=make_trace(state["reference_answer"]), env=handle)
        )
    assert result.rewards[0].value == 1.0
    [error] = result.errors
    assert error.type == "NotSupportedError"
    assert "no 'run' tool" in error.message


class ShellEnv(Env[Action, Observation]):
    """An environment with run/read_file tools over a directory (for ClientHandle)."""

    workdir = Path(".")

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[Observation]:
        return StepResult(observation=Observation())

    @tool
    async def run(self, command: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Run a shell command.

        Args:
            command: The command.
            timeout_s: Seconds it may take.
        """
        return dataclasses.asdict(await LocalDirHandle(self.workdir).run(command, timeout_s))

    @tool
    async def read_file(self, path: str) -> str:
        """Read a file.

        Args:
            path: Its path.
        """
        return await LocalDirHandle(self.workdir).read_file(path)

    @tool
    def write_file(self, path: str, content: str, encoding: FileEncoding = "utf-8") -> None:
        """Write a file (as shell-v1's tool does: text, or base64 for any bytes).

        Args:
            path: Its path.
            content: Its text.
            encoding: "utf-8" or "base64".
        """
        target = LocalDirHandle(self.workdir).path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(file_bytes(content, encoding))


async def test_client_handle_runs_commands_through_env_tools(tmp_path: Path) -> None:
    class Env_(ShellEnv):
        workdir = tmp_path

    spec = RubricSpec(
        type="test_command",
        params={"command": "echo 0.5 > r.txt; exit 1", "reward_file": "r.txt"},
    )
    async with EnvClient(InProcessTransport(Env_)) as client:
        await client.reset()
        result = await from_specs([spec]).score(
            ScoringContext(trace=make_trace(), env=ClientHandle(client))
        )
    assert result.total == 0.5, result.errors
    assert result.metrics == {"test_command/exit_code": 1.0}


async def test_client_handle_uploads_tests_and_falls_back_to_reward_json(
    tmp_path: Path,
) -> None:
    class Env_(ShellEnv):
        workdir = tmp_path / "work"

    Env_.workdir.mkdir()
    task_root = tmp_path / "task"
    (task_root / "tests" / "lib").mkdir(parents=True)
    (task_root / "tests" / "test.sh").write_text(
        """. checks/lib/common.sh; echo '{"reward": 0.9}' > logs/reward.json\n"""
    )
    (task_root / "tests" / "lib" / "common.sh").write_text("mkdir -p logs\n")
    fixture = bytes(range(256))  # a binary test fixture: not UTF-8 text
    (task_root / "tests" / "lib" / "fixture.bin").write_bytes(fixture)
    spec = RubricSpec(
        type="test_command",
        params={
            "command": "bash checks/test.sh",
            "tests_dir": "tests",
            "tests_mount": "checks",
            "reward_file": "logs/reward.txt",  # never written: the tool says no such file
            "reward_json": "logs/reward.json",
        },
    )
    task = Task(prompt="p", rubric=(spec,), root=str(task_root))
    async with EnvClient(InProcessTransport(Env_)) as client:
        await client.reset()
        result = await Rubric.for_task(task).score(
            ScoringContext(trace=make_trace(), task=task, env=ClientHandle(client))
        )
    assert result.total == 0.9, result.errors
    assert (Env_.workdir / "checks" / "lib" / "common.sh").is_file()
    assert (Env_.workdir / "checks" / "lib" / "fixture.bin").read_bytes() == fixture


# --- llm_judge against a real OpenAI-compatible server -------------------------------------------


def _section(prompt: str, title: str, next_title: str) -> str:
    return prompt.split(f"{title}:\n", 1)[1].split(f"\n\n{next_title}", 1)[0].strip()


class JudgePolicy:
    """A stand-in judge model: it compares the response with the reference it is shown."""

    def __init__(self, reply: str | None = None) -> None:
        self.fixed_reply = reply
        self.tok = ByteTokenizer()
        self.prompts: list[str] = []

    @property
    def name(self) -> str:
        return "tiny-judge"

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self.tok

    @property
    def max_model_len(self) -> int:
        return 1 << 20

    def verdict(self, prompt: str) -> str:
        if self.fixed_reply is not None:
            return self.fixed_reply
        reference = _section(prompt, "Reference answer", "Response")
        response = _section(prompt, "Response", "Is the response")
        same = reference.lower() in response.lower()
        return f"The response {'matches' if same else 'differs'}.\nSCORE: {1 if same else 0}"

    async def generate(
        self, messages: Sequence[Any], tools: Sequence[Any] | None, sampling: SamplingParams
    ) -> Generation:
        prompt = str(messages[-1]["content"])
        self.prompts.append(prompt)
        text = self.verdict(prompt)
        prompt_ids = self.tok.encode(self.tok.apply_chat_template(messages, tools))
        ids = [*self.tok.encode(text), self.tok.eos_token_id]
        return Generation(
            text=text,
            tool_calls=(),
            finish_reason="stop",
            prompt_token_ids=tuple(prompt_ids),
            token_ids=tuple(ids),
            logprobs=tuple(0.0 for _ in ids),
        )

    async def complete(self, prompt: str | Sequence[int], sampling: SamplingParams) -> Generation:
        raise NotImplementedError


@pytest.fixture(scope="module")
def judge() -> Iterator[tuple[str, JudgePolicy]]:
    policy = JudgePolicy()
    with run_asgi(create_policy_app(policy)) as url:
        yield f"{url}/v1", policy


def judge_spec(base_url: str, **params: Any) -> dict[str, Any]:
    return {"type": "llm_judge", "model": "tiny-judge", "base_url": base_url, **params}


async def test_llm_judge_scores_through_an_openai_compatible_endpoint(
    judge: tuple[str, JudgePolicy],
) -> None:
    base_url, policy = judge
    task = Task(prompt="What is the capital of France?", answer="Paris")
    right = ScoringContext(trace=make_trace("It is Paris."), task=task)
    wrong = ScoringContext(trace=make_trace("It is Lyon."), task=task)

    total, result = await score_one(judge_spec(base_url), right)
    assert total == 1.0, result.errors
    assert result.rewards[0].reason == "The response matches.\nSCORE: 1"
    assert "What is the capital of France?" in policy.prompts[-1]
    assert "It is Paris." in policy.prompts[-1]

    total, result = await score_one(judge_spec(base_url), wrong)
    assert total == 0.0
    assert result.rewards[0].reason == "The response differs.\nSCORE: 0"


async def test_llm_judge_with_its_endpoint_down_is_a_recorded_error() -> None:
    base_url = f"http://127.0.0.1:{free_port()}/v1"
    spec = judge_spec(base_url, max_retries=0, timeout_s=5)
    total, result = await score_one(spec, ctx_for("Paris", "Paris"))
    assert total is None
    [error] = result.errors
    assert error.kind is ErrorKind.RUBRIC
    assert error.type == "JudgeError"
    assert base_url in error.message
    assert "APIConnectionError" in error.message


async def test_llm_judge_reply_without_a_verdict_is_an_error() -> None:
    with run_asgi(create_policy_app(JudgePolicy("I would rather not say."))) as url:
        total, result = await score_one(judge_spec(f"{url}/v1"), ctx_for("Paris", "Paris"))
    assert total is None
    assert "no score or yes/no verdict" in result.errors[0].message


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("Reasoning...\nSCORE: 0.8", 0.8),
        ("score = 1", 1.0),
        ("Score: 7/10", 0.7),
        ("0.25", 0.25),
        ("Yes, it is right.", 1.0),
        ("No.", 0.0),
        ("Incorrect: it says Lyon", 0.0),
        ("The answer matches the reference.\nVerdict: yes", 1.0),
    ],
)
def test_parse_verdict(reply: str, score: float) -> None:
    assert parse_verdict(reply) == pytest.approx(score)


@pytest.mark.parametrize("reply", ["SCORE: 7", "2.5", "maybe", "", "SCORE: 1/0", "score 0/0.0"])
def test_parse_verdict_rejects_what_it_cannot_read(reply: str) -> None:
    with pytest.raises(JudgeError):
        parse_verdict(reply)


def test_llm_judge_template_is_checked_when_built() -> None:
    with pytest.raises(RubricBuildError, match="prompt template"):
        from_specs([RubricSpec(type="llm_judge", params={"model": "m", "prompt": "{nope}"})])


# --- from_specs --------------------------------------------------------------------------------


def test_from_specs_knows_every_type_the_builtin_tasksets_use() -> None:
    assert {"exact_match", "numeric_match", "regex", "env_reward", "test_command"} <= set(
        registered_types()
    )
    assert "llm_judge" in registered_types()
    for name in builtin_names():
        for task in load(f"builtin:{name}"):
            rubric = Rubric.for_task(task)
            assert rubric.names == [s.params.get("name", s.type) for s in task.rubric]
            assert [f.weight for f in rubric.funcs] == [s.weight for s in task.rubric]


def test_from_specs_errors_name_what_exists() -> None:
    with pytest.raises(UnknownRubricTypeError, match=r"'exact_matc'.*Did you mean 'exact_match'"):
        from_specs([RubricSpec(type="exact_matc")])
    with pytest.raises(RubricBuildError, match=r"Its params are: case_sensitive"):
        from_specs([RubricSpec(type="exact_match", params={"case": True})])
    with pytest.raises(RubricBuildError, match="command"):
        from_specs([RubricSpec(type="test_command")])
    with pytest.raises(RubricBuildError, match="named 'exact_match'"):
        from_specs([RubricSpec(type="exact_match"), RubricSpec(type="exact_match", weight=0)])
    named = from_specs(
        [
            RubricSpec(type="exact_match"),
            RubricSpec(type="regex", params={"name": "r", "pattern": "x"}),
        ]
    )
    assert named.names == ["exact_match", "r"]


def test_a_tasks_rubric_is_checked_before_it_runs(tmp_path: Path) -> None:
    """Rubric.for_task builds a task's rubric with no environment: the check to make
    before the agent runs, so a bad spec fails the task at once, naming it and the spec."""
    lines = [
        {
            "id": "typo",
            "prompt": "p",
            "answer": "5",
            "rubric": ["exact_match", {"type": "numeric_match", "abs_tolerance": 0.5}],
        },
        {"id": "nan", "prompt": "p", "rubric": [{"type": "exact_match", "weight": math.nan}]},
        {"id": "unknown", "prompt": "p", "rubric": ["exact_matc"]},
        {
            "id": "ok",
            "prompt": "p",
            "answer": "5",
            "rubric": [
                {"type": "numeric_match", "abs_tol": 0.5},
                {"type": "regex", "pattern": "x", "weight": 0},
            ],
        },
        {"id": "none", "prompt": "p"},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tasks = {t.id: t for t in load(str(path))}

    with pytest.raises(RubricBuildError) as typo:
        Rubric.for_task(tasks["typo"])
    assert str(typo.value).startswith("task 'typo': rubric[1]: rubric 'numeric_match': ")
    assert "'abs_tolerance'" in str(typo.value)
    assert "Its params are: abs_tol, rel_tol, expected" in str(typo.value)
    assert typo.value.details == {"type": "numeric_match", "index": 1, "task": "typo"}

    with pytest.raises(RubricBuildError, match=r"^task 'nan': rubric\[0\]: .*must be finite"):
        Rubric.for_task(tasks["nan"])
    with pytest.raises(UnknownRubricTypeError, match=r"^task 'unknown': rubric\[0\]: Unknown"):
        Rubric.for_task(tasks["unknown"])
    assert Rubric.for_task(tasks["ok"]).weighted
    assert len(Rubric.for_task(tasks["none"])) == 0
    assert not Rubric.for_task(tasks["none"]).weighted


def test_a_factory_that_raises_anything_is_a_build_error() -> None:
    @register("test_flaky_factory", replace=True)
    def flaky(*, path: str = "x") -> Any:
        raise KeyError(path)

    with pytest.raises(RubricBuildError, match=r"rubric\[0\]: .*factory raised KeyError: 'x'"):
        from_specs([RubricSpec(type="test_flaky_factory")])


@pytest.mark.parametrize("correct", [True, False])
async def test_builtin_arithmetic_task_end_to_end(correct: bool) -> None:
    """A builtin task's own rubric, scored against a real episode of its environment."""
    task = next(iter(load("builtin:arithmetic")))
    async with EnvClient.connect(task.env_id or "") as client:
        first = await client.reset(seed=task.seed, **task.env_options)
        handle = ClientHandle(client)
        state = await handle.state()
        assert state["reference_answer"] == task.answer
        reply = task.answer if correct else "-1"
        step = await client.step({"answer": reply})

        trace = Trace(task_id=task.id, env_id=task.env_id)
        trace.reply("user", first.observation["question"])
        trace.reply("assistant", reply)
        trace.steps.append(
            StepRecord(index=0, observation=step.observation, reward=step.reward, terminated=True)
        )
        result = await Rubric.for_task(task).score_trace(trace, task, env=handle)

    expected = 1.0 if correct else 0.0
    assert result.ok
    assert result.total == expected  # env_reward, weight 1
    assert result.metrics == {"exact_match": expected, "env_reward/steps": 1.0}  # weight 0
    assert trace.reward == expected
    assert trace.rewards == [
        Reward(name="env_reward", value=expected, weight=1.0, reason=None),
        Reward(
            name="exact_match",
            value=expected,
            weight=0.0,
            reason=None if correct else f"'-1' != {task.answer!r}",
        ),
    ]
    assert trace.steps[0].reward == expected  # the step reward is still there, separately


def test_parameters_are_documented() -> None:
    assert set(PARAMETERS) == {
        "task",
        "trace",
        "observation",
        "completion",
        "answer",
        "state",
        "env",
        "reference",
        "metadata",
        "params",
    }
    assert issubclass(CommandTimeoutError, CommandError)
