"""The built-in environments: guess-number, guess-word, arithmetic and sql-db."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from envport.check import check_env
from envport.env import Env
from envport.envs.arithmetic import ArithmeticEnv, parse_number
from envport.envs.guess import GuessNumberEnv, GuessWordEnv, score_guess
from envport.envs.sqldb import (
    MAX_CELL_CHARS,
    MAX_PATTERN_CHARS,
    MAX_RESULT_BYTES,
    MAX_SQL_CHARS,
    QUESTIONS,
    SqlDbEnv,
)
from envport.errors import (
    ActionValidationError,
    EnvClosedError,
    EnvNotResetError,
    ToolError,
)
from envport.registry import make, registered
from envport.types import CallToolObservation, ListToolsObservation


def call(tool_name: str, /, **arguments: Any) -> dict[str, Any]:
    return {"type": "call_tool", "tool_name": tool_name, "arguments": arguments}


async def reference(env: Env[Any, Any]) -> Any:
    return (await env.state()).model_dump()["reference_answer"]


# --- registry ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env_id", "cls"),
    [
        ("guess-number-v1", GuessNumberEnv),
        ("guess-word-v1", GuessWordEnv),
        ("arithmetic-v1", ArithmeticEnv),
        ("sql-db-v1", SqlDbEnv),
    ],
)
async def test_builtin_ids_make_their_environment(env_id: str, cls: type) -> None:
    assert env_id in registered()
    assert "echo-v1" in registered()
    env = make(env_id)
    try:
        assert type(env) is cls
        assert env.reward_range == (0.0, 1.0)
    finally:
        await env.close()


@pytest.mark.parametrize(
    "env_id", ["guess-number-v1", "guess-word-v1", "arithmetic-v1", "sql-db-v1"]
)
async def test_builtin_envs_pass_the_environment_checker(env_id: str) -> None:
    report = await check_env(env_id)
    assert report.ok, report.results
    warnings = [r for r in report.results if r.status.value == "warn"]
    assert not warnings, warnings
    statuses = {r.name: r.status.value for r in report.results}
    assert statuses["step"] == "pass"
    assert statuses["reward_range"] == "pass"
    assert statuses["leaks"] == "pass"


# --- guess-number-v1 -----------------------------------------------------------------------


async def play_number(seed: int, guesses: list[int]) -> list[tuple[str, float | None]]:
    async with GuessNumberEnv(high=100, max_steps=len(guesses)) as env:
        await env.reset(seed=seed)
        out = []
        for g in guesses:
            result = await env.step({"guess": g})
            out.append((result.observation.feedback, result.reward))
            if result.done:
                break
        return out


async def test_guess_number_same_seed_same_game_and_seeds_differ() -> None:
    guesses = [50, 25, 75, 10, 90]
    assert await play_number(7, guesses) == await play_number(7, guesses)
    secrets = set()
    for seed in range(10):
        env = GuessNumberEnv()
        first = await env.reset(seed=seed)
        assert first.observation.feedback == "start"
        assert first.observation.attempts_left == 10
        assert first.observation.secret is None
        secrets.add(await reference(env))
        await env.close()
    assert len(secrets) > 1


async def test_guess_number_binary_search_wins_with_consistent_feedback() -> None:
    async with GuessNumberEnv(high=100, max_steps=7) as env:
        await env.reset(seed=3)
        secret = await reference(env)
        lo, hi = 1, 100
        while True:
            mid = (lo + hi) // 2
            result = await env.step({"guess": mid})
            obs = result.observation
            if mid == secret:
                assert obs.feedback == "correct"
                assert result.reward == 1.0
                assert result.terminated
                assert not result.truncated
                assert obs.secret == secret
                break
            assert obs.feedback == ("higher" if mid < secret else "lower")
            assert result.reward == 0.0
            assert not result.done
            assert obs.secret is None
            lo, hi = (mid + 1, hi) if obs.feedback == "higher" else (lo, mid - 1)
        state = (await env.state()).model_dump()
        assert state["solved"] is True
        with pytest.raises(EnvNotResetError, match="reset"):
            await env.step({"guess": secret})


async def test_guess_number_truncates_after_max_steps() -> None:
    async with GuessNumberEnv(high=100, max_steps=3) as env:
        await env.reset(seed=11)
        secret = await reference(env)
        wrong = 1 if secret != 1 else 2
        r1 = await env.step({"guess": wrong})
        r2 = await env.step({"guess": "not a number"})
        r3 = await env.step({"guess": f" {wrong} "})
        assert [r.observation.attempts_left for r in (r1, r2, r3)] == [2, 1, 0]
        assert r2.observation.feedback == "invalid"
        assert r3.observation.last_guess == wrong  # text with spaces is parsed
        assert not r1.done
        assert not r2.done
        assert r3.truncated
        assert not r3.terminated
        assert r3.reward == 0.0
        assert r3.observation.secret == secret
        assert str(secret) in r3.observation.message


async def test_guess_number_text_guesses_are_read_exactly_beyond_float_precision() -> None:
    # A float holds integers exactly only up to 2**53: the secret typed as text was read as
    # a neighbour, answered 'lower' and scored 0.
    async with GuessNumberEnv(high=10**18, max_steps=5) as env:
        await env.reset(seed=1)
        secret = await reference(env)
        assert secret > 2**53
        below = await env.step({"guess": f"{secret - 1:,}"})
        assert below.observation.feedback == "higher"
        assert below.observation.last_guess == secret - 1
        hit = await env.step({"guess": f" {secret} "})
        assert hit.observation.feedback == "correct"
        assert hit.reward == 1.0
        assert hit.terminated
    async with GuessNumberEnv(max_steps=5) as env:
        await env.reset(seed=1)
        read = [(await env.step({"guess": g})).observation for g in ("42.0", "1e2000", "2.5")]
        assert [o.last_guess for o in read] == [42, None, None]
        assert [o.feedback for o in read][1:] == ["invalid", "invalid"]


async def test_guess_number_reset_options_and_unknown_option() -> None:
    async with GuessNumberEnv() as env:
        result = await env.reset(seed=1, high=5, max_steps=2)
        assert result.observation.high == 5
        assert result.observation.attempts_left == 2
        assert 1 <= await reference(env) <= 5
        with pytest.raises(ActionValidationError, match="hgih"):
            await env.reset(seed=1, hgih=5)


async def test_guess_number_tool_through_step_and_call_tool() -> None:
    async with GuessNumberEnv(max_steps=5) as env:
        await env.reset(seed=5)
        secret = await reference(env)
        listing = await env.step({"type": "list_tools"})
        assert isinstance(listing.observation, ListToolsObservation)
        (spec,) = listing.observation.tools
        assert spec.name == "guess"
        assert spec.input_schema["required"] == ["number"]
        assert spec.input_schema["properties"]["number"]["type"] == "integer"

        low = secret - 1 if secret > 1 else secret + 1
        direct = await env.call_tool("guess", {"number": low})
        assert direct["feedback"] == ("higher" if low < secret else "lower")
        assert direct["attempts_left"] == 4
        assert direct["done"] is False

        bad = await env.step(call("guess", number="seven"))
        assert isinstance(bad.observation, CallToolObservation)
        assert bad.observation.error is not None
        assert bad.observation.error.error_type == "invalid_args"

        hit = await env.step(call("guess", number=secret))
        assert isinstance(hit.observation, CallToolObservation)
        assert hit.observation.result.data["feedback"] == "correct"
        assert hit.reward == 1.0
        assert hit.terminated

        after = await env.step(call("guess", number=secret))
        assert after.observation.error is not None
        assert "reset" in after.observation.error.message


# --- guess-word-v1 -------------------------------------------------------------------------


def test_score_guess_marks_letters_and_counts_repeats() -> None:
    assert score_guess("apple", "apple") == "GGGGG"
    assert score_guess("apple", "ppppp") == ".GG.."
    assert score_guess("apple", "lapel") == "YYGY."
    assert score_guess("crane", "zzzzz") == "....."
    assert score_guess("eagle", "eerie") == "G...G"


async def test_guess_word_deterministic_feedback_and_win() -> None:
    async def secret_for(seed: int) -> str:
        async with GuessWordEnv() as env:
            await env.reset(seed=seed)
            return str(await reference(env))

    assert await secret_for(4) == await secret_for(4)
    assert len({await secret_for(s) for s in range(10)}) > 1

    async with GuessWordEnv(max_steps=6) as env:
        await env.reset(seed=4)
        secret = await reference(env)
        probe = "crane" if secret != "crane" else "zebra"
        miss = await env.step({"guess": probe.upper()})
        assert miss.observation.feedback == score_guess(secret, probe)
        assert miss.observation.history == [(probe, score_guess(secret, probe))]
        assert miss.reward == 0.0
        assert not miss.done
        hit = await env.step({"guess": secret})
        assert hit.observation.feedback == "GGGGG"
        assert hit.reward == 1.0
        assert hit.terminated
        assert hit.observation.secret == secret


async def test_guess_word_invalid_guesses_count_and_truncate() -> None:
    async with GuessWordEnv(max_steps=2) as env:
        await env.reset(seed=0)
        secret = await reference(env)
        bad = await env.step({"guess": "toolong"})
        assert bad.observation.valid is False
        assert bad.observation.attempts_left == 1
        assert "five-letter" in bad.observation.message
        wrong = "zebra" if secret != "zebra" else "crane"
        last = await env.step(call("guess", word=wrong))
        assert last.truncated
        assert not last.terminated
        assert last.reward == 0.0
        assert last.observation.result.data["secret"] == secret


# --- arithmetic-v1 -------------------------------------------------------------------------


def expression(question: str) -> str:
    match = re.match(r"What is (.+)\? Answer", question)
    assert match, question
    return match.group(1)


async def test_arithmetic_same_seed_same_question_and_seeds_differ() -> None:
    async def question(seed: int, difficulty: str = "medium") -> str:
        async with ArithmeticEnv() as env:
            result = await env.reset(seed=seed, difficulty=difficulty)
            return str(result.observation.question)

    assert await question(42) == await question(42)
    assert len({await question(s) for s in range(10)}) > 5


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard", 1, 2, 3])
async def test_arithmetic_reference_answer_is_the_value_of_the_question(
    difficulty: str | int,
) -> None:
    async with ArithmeticEnv() as env:
        for seed in range(40):
            result = await env.reset(seed=seed, difficulty=difficulty)
            expr = expression(result.observation.question)
            ref = await reference(env)
            assert Fraction(eval(expr)) == Fraction(ref), expr  # the expression is ours
            assert re.fullmatch(r"-?\d+", ref), ref  # answers are always integers


async def test_arithmetic_difficulty_controls_operands_and_operators() -> None:
    async with ArithmeticEnv() as env:
        for seed in range(30):
            easy = expression((await env.reset(seed=seed, difficulty="easy")).observation.question)
            numbers = re.findall(r"\d+", easy)
            assert len(numbers) == 2
            assert all(len(n) <= 2 for n in numbers)
            assert not set(easy) & set("*/()")
            hard = expression((await env.reset(seed=seed, difficulty="hard")).observation.question)
            assert len(re.findall(r"\d+", hard)) >= 3
            assert (await env.state()).model_dump()["difficulty"] == "hard"
        with pytest.raises(ActionValidationError, match="easy"):
            await env.reset(seed=1, difficulty="impossible")


@pytest.mark.parametrize(
    "variant", ["{ref}", "  {ref}  ", "{ref}.0", "{ref}.", "{grouped}", "\t{grouped}\n"]
)
async def test_arithmetic_correct_answers_in_many_forms_score_one(variant: str) -> None:
    async with ArithmeticEnv(difficulty="medium") as env:
        first = await env.reset(seed=9)
        assert first.reward is None
        assert first.observation.correct is None
        assert first.observation.expected is None  # not revealed before the answer
        ref = await reference(env)
        answer = variant.format(ref=ref, grouped=f"{int(ref):,}")
        result = await env.step({"answer": answer})
        assert result.reward == 1.0
        assert result.terminated
        assert result.observation.correct is True
        assert result.observation.expected == ref


async def test_arithmetic_wrong_and_unreadable_answers_score_zero_single_turn() -> None:
    async with ArithmeticEnv() as env:
        await env.reset(seed=2)
        ref = int(await reference(env))
        wrong = await env.step({"answer": str(ref + 1)})
        assert wrong.reward == 0.0
        assert wrong.terminated
        assert wrong.observation.correct is False
        assert wrong.observation.expected == str(ref)
        with pytest.raises(EnvNotResetError, match="one answer"):
            await env.step({"answer": str(ref)})

        await env.reset(seed=2)
        numeric = await env.step({"answer": ref})  # a JSON number works too
        assert numeric.reward == 1.0

        await env.reset(seed=2)
        words = await env.step({"answer": "about forty"})
        assert words.reward == 0.0
        assert "Could not read" in words.observation.message
        state = (await env.state()).model_dump()
        assert state["reference_answer"] == str(ref)
        assert state["correct"] is False


def test_parse_number_is_lenient_in_form_strict_in_value() -> None:
    assert parse_number(" 1,234 ") == 1234
    assert parse_number("\u22127") == -7
    assert parse_number("+3") == 3
    assert parse_number("1e3") == 1000
    assert parse_number("2.50") == Fraction(5, 2)
    assert parse_number(2.5) == Fraction(5, 2)
    for bad in ["", "forty", "1,5", "12,34", "1_000", "4 apples", True, float("nan")]:
        assert parse_number(bad) is None, bad


CRAFTED_ANSWERS = [
    "1e100000000",
    "1E-100000000",
    "\uff11e100000000",  # a fullwidth digit, which NFKC makes "1e100000000"
    "1.5e+99999999",
    "1" * 5000,
    " " * 10_000 + "7",
    "1e1001",
]


def test_parse_number_refuses_crafted_answers_promptly() -> None:
    # Fraction("1e100000000") computes 10**100000000 holding the GIL: minutes, server-wide.
    for crafted in CRAFTED_ANSWERS:
        started = time.monotonic()
        assert parse_number(crafted) is None, crafted[:20]
        assert time.monotonic() - started < 2.0, crafted[:20]
    assert parse_number("1e1000") == 10**1000  # inside the bounds, still exact
    assert parse_number("-2.5e-3") == Fraction(-1, 400)


async def test_crafted_answers_are_prompt_wrong_answers_in_arithmetic_and_sqldb() -> None:
    for crafted in CRAFTED_ANSWERS:
        async with ArithmeticEnv() as env:
            await env.reset(seed=1)
            started = time.monotonic()
            result = await asyncio.wait_for(env.step({"answer": crafted}), 10)
            assert time.monotonic() - started < 2.0
            assert result.reward == 0.0
            assert result.observation.correct is False
        async with SqlDbEnv() as sql_env:
            await sql_env.reset(seed=0, question_kind="count_employees")
            started = time.monotonic()
            data = await asyncio.wait_for(
                sql_env.call_tool("submit_answer", {"answer": crafted}), 10
            )
            assert time.monotonic() - started < 2.0
            assert data["correct"] is False
            assert data["reward"] == 0.0


# --- sql-db-v1 -----------------------------------------------------------------------------


async def rows(env: SqlDbEnv, sql: str) -> list[list[Any]]:
    result = await env.call_tool("run_query", {"sql": sql})
    return list(result["rows"])


async def test_sqldb_same_seed_same_data_and_question_seeds_differ() -> None:
    async def snapshot(seed: int) -> tuple[str, list[list[Any]]]:
        async with SqlDbEnv(max_rows=100) as env:
            first = await env.reset(seed=seed)
            data = await rows(env, "SELECT * FROM employees ORDER BY id")
            return first.observation.question, data

    assert await snapshot(3) == await snapshot(3)
    snaps = [await snapshot(s) for s in range(5)]
    assert len({repr(s) for s in snaps}) == 5
    assert len({q for q, _ in snaps}) > 1


async def test_sqldb_first_observation_describes_the_task() -> None:
    async with SqlDbEnv() as env:
        first = await env.reset(seed=1)
        obs = first.observation
        assert obs.question.endswith("?")
        assert sorted(obs.tables) == ["departments", "employees", "orders"]
        assert "CREATE TABLE employees" in obs.schema_sql
        assert first.reward is None
        assert not first.done


async def test_sqldb_count_answer_matches_data_and_scores_one() -> None:
    async with SqlDbEnv(max_rows=1000) as env:
        first = await env.reset(seed=8, question_kind="count_employees")
        match = re.search(r"in the (\w+) department", first.observation.question)
        assert match
        depts = {name: i for i, name in await rows(env, "SELECT id, name FROM departments")}
        people = await rows(env, "SELECT department_id FROM employees")
        expected = sum(1 for (d,) in people if d == depts[match.group(1)])
        assert str(expected) == await reference(env)

        result = await env.step(call("submit_answer", answer=f" {expected} "))
        assert isinstance(result.observation, CallToolObservation)
        assert result.observation.result.data == {
            "correct": True,
            "expected": str(expected),
            "reward": 1.0,
            "done": True,
        }
        assert result.reward == 1.0
        assert result.terminated
        again = await env.step(call("submit_answer", answer=str(expected)))
        assert again.observation.error is not None
        assert "over" in again.observation.error.message
        with pytest.raises(EnvNotResetError):
            await env.step({"answer": str(expected)})


@pytest.mark.parametrize("kind", sorted(QUESTIONS))
async def test_sqldb_every_question_kind_accepts_its_reference_only(kind: str) -> None:
    async with SqlDbEnv() as env:
        await env.reset(seed=21, question_kind=kind)
        state = (await env.state()).model_dump()
        assert state["question_kind"] == kind
        ref = state["reference_answer"]
        assert (await rows(env, state["reference_sql"]))[0][0] is not None
        right = await env.step({"answer": ref.upper()})  # names compare case-insensitively
        assert right.reward == 1.0
        assert right.observation.correct is True

        await env.reset(seed=21, question_kind=kind)
        wrong = await env.step({"answer": "Nobody 12345"})
        assert wrong.reward == 0.0
        assert wrong.terminated
        assert wrong.observation.correct is False
        assert wrong.observation.expected == ref


async def test_sqldb_plain_sql_action_returns_rows_and_errors_as_data() -> None:
    async with SqlDbEnv(max_rows=5) as env:
        await env.reset(seed=2)
        result = await env.step({"sql": "SELECT id, name FROM departments ORDER BY id"})
        assert result.observation.columns == ["id", "name"]
        assert result.observation.rows[0][0] == 1
        assert result.observation.error is None
        assert result.reward == 0.0
        assert not result.done

        many = await env.step({"sql": "SELECT * FROM orders"})
        assert len(many.observation.rows) == 5
        assert many.observation.truncated is True

        bad = await env.step({"sql": "SELECT nope FROM employees"})
        assert bad.observation.error == "SQL error: no such column: nope"
        assert not bad.done
        with pytest.raises(ActionValidationError, match="exactly one"):
            await env.step({"sql": "SELECT 1", "answer": "1"})
        with pytest.raises(ActionValidationError, match="exactly one"):
            await env.step({})


def _many_rows(columns: int, value: str, rows: int = 60) -> str:
    cols = ", ".join(f"{value} AS c{i}" for i in range(columns))
    return (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < "
        f"{rows}) SELECT {cols} FROM n"
    )


async def test_sqldb_big_results_are_capped_and_say_they_were_truncated() -> None:
    # Before: max_rows capped rows and SQLite each value, nothing the total; 8 columns of
    # zeroblob(999999) over 50 rows made an 800 MB observation.
    async with SqlDbEnv() as env:
        await env.reset(seed=0)
        for sql in [
            _many_rows(8, "zeroblob(99999)"),
            _many_rows(100, "printf('%.*c', 99999, 'x')"),
        ]:
            result = await env.step({"sql": sql})
            obs = result.observation
            assert obs.error is None
            assert len(obs.model_dump_json()) < MAX_RESULT_BYTES + 10_000
            assert 0 < len(obs.rows) < 50
            assert obs.truncated is True
            assert "only the first" in obs.message
            assert f"longer than {MAX_CELL_CHARS:,} characters were cut" in obs.message
            assert obs.rows[0][0].endswith(" cut]")
            assert len(obs.rows[0][0]) < MAX_CELL_CHARS + 40

            data = await env.call_tool("run_query", {"sql": sql})
            assert data["truncated"] is True
            assert "only the first" in data["note"]
            assert len(json.dumps(data)) < MAX_RESULT_BYTES + 10_000

        too_wide = await env.step({"sql": _many_rows(101, "1", rows=1)})
        assert too_wide.observation.error == "SQL error: too many columns in result set"
        too_big = await env.step({"sql": "SELECT zeroblob(999999)"})
        assert too_big.observation.error == "SQL error: string or blob too big"

        small = await env.step({"sql": "SELECT x'00ff', 'short'"})
        assert small.observation.rows == [["00ff", "short"]]
        assert small.observation.truncated is False
        assert small.observation.message == ""
        many = await env.call_tool("run_query", {"sql": _many_rows(2, "1")})
        assert many["row_count"] == 50
        assert many["note"] == "Result truncated: only the first 50 rows (max_rows) are shown."


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("DELETE FROM employees", "starts with DELETE"),
        ("  -- sneaky\n  DROP TABLE employees", "starts with DROP"),
        ("INSERT INTO departments VALUES (99, 'X', 'Y', 1)", "starts with INSERT"),
        ("PRAGMA writable_schema = 1", "starts with PRAGMA"),
        ("ATTACH DATABASE '/tmp/x.db' AS x", "starts with ATTACH"),
        ("WITH t AS (SELECT 1) DELETE FROM employees", "read-only"),
        ("SELECT 1; DROP TABLE employees", "one statement at a time"),
        ("", "starts with (empty)"),
    ],
)
async def test_sqldb_writes_are_rejected_and_data_is_untouched(sql: str, message: str) -> None:
    async with SqlDbEnv(max_rows=1000) as env:
        await env.reset(seed=4)
        before = await rows(env, "SELECT COUNT(*) FROM employees")
        with pytest.raises(ToolError, match=re.escape(message)) as info:
            await env.call_tool("run_query", {"sql": sql})
        assert info.value.kind == "execution_error"
        through_step = await env.step(call("run_query", sql=sql))
        assert through_step.observation.error is not None
        assert message in through_step.observation.error.message
        assert await rows(env, "SELECT COUNT(*) FROM employees") == before
        assert sorted(await env.call_tool("list_tables")) == ["departments", "employees", "orders"]


async def test_sqldb_tools_are_listed_with_schemas_and_callable() -> None:
    async with SqlDbEnv() as env:
        await env.reset(seed=6)
        listing = await env.step({"type": "list_tools"})
        assert isinstance(listing.observation, ListToolsObservation)
        specs = {t.name: t for t in listing.observation.tools}
        assert set(specs) == {"list_tables", "describe_table", "run_query", "submit_answer"}
        assert specs["run_query"].input_schema["required"] == ["sql"]
        assert "SELECT" in specs["run_query"].input_schema["properties"]["sql"]["description"]
        assert all(spec.description for spec in specs.values())

        tables = await env.step(call("list_tables"))
        assert sorted(tables.observation.result.data) == ["departments", "employees", "orders"]
        assert tables.reward is None
        assert not tables.done

        described = await env.call_tool("describe_table", {"name": "employees"})
        columns = {c["name"]: c for c in described["columns"]}
        assert columns["salary"]["type"] == "INTEGER"
        assert columns["id"]["primary_key"] is True
        assert described["row_count"] == len(await rows(env, "SELECT id FROM employees"))

        missing = await env.step(call("describe_table", name="staff"))
        assert missing.observation.error is not None
        assert "No table named 'staff'" in missing.observation.error.message
        assert "employees" in missing.observation.error.message
        unknown = await env.step(call("drop_everything"))
        assert unknown.observation.error.error_type == "tool_not_found"


async def test_sqldb_concurrent_tool_calls_share_the_database_safely() -> None:
    async with SqlDbEnv() as env:
        await env.reset(seed=1)
        counts = await asyncio.gather(
            *(env.call_tool("run_query", {"sql": "SELECT COUNT(*) FROM orders"}) for _ in range(8))
        )
        assert len({c["rows"][0][0] for c in counts}) == 1


async def test_sqldb_long_query_is_stopped() -> None:
    async with SqlDbEnv(query_timeout_s=0.2) as env:
        await env.reset(seed=1)
        endless = (
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
        )
        with pytest.raises(ToolError, match=r"longer than 0\.2 s"):
            await env.call_tool("run_query", {"sql": endless})
        assert await rows(env, "SELECT 1") == [[1]]


async def test_sqldb_submit_answer_tool_takes_a_number_as_the_plain_action_does() -> None:
    # A model that answers "how many" with a JSON number got invalid_args from the tool,
    # while {"answer": 3} as a plain action was scored.
    async with SqlDbEnv() as env:
        await env.reset(seed=0, question_kind="count_employees")
        expected = int(await reference(env))
        right = await env.step(call("submit_answer", answer=expected))
        assert right.observation.error is None
        assert right.reward == 1.0
        assert right.terminated
        await env.reset(seed=0, question_kind="average_salary")
        value = float(await reference(env))
        assert (await env.call_tool("submit_answer", {"answer": value}))["correct"] is True
        await env.reset(seed=0, question_kind="count_employees")
        wrong = await env.call_tool("submit_answer", {"answer": expected + 0.5})
        assert wrong["correct"] is False
        await env.reset(seed=0)
        with pytest.raises(ToolError, match="answer") as bad:
            await env.call_tool("submit_answer", {"answer": [1]})
        assert bad.value.kind == "invalid_args"
        assert await env.call_tool("list_tables") == ["departments", "employees", "orders"]


async def test_sqldb_costly_like_and_glob_patterns_are_refused() -> None:
    # SQLite matches LIKE/GLOB inside one VM instruction, where no progress handler runs,
    # in time (value length x pattern length): a 40,000-character pattern against a
    # 98,000-character value ran ~5 s past a 0.2 s query_timeout_s, and a row of such
    # calls for minutes, holding the episode's thread. Long patterns and long
    # statements are refused instead, with the limit named; the episode goes on.
    async with SqlDbEnv(query_timeout_s=0.2) as env:
        await env.reset(seed=1)
        value = "hex(zeroblob(49000))"
        for op, wildcard in (("LIKE", "%"), ("GLOB", "*")):
            sql = f"SELECT {value} {op} '{wildcard}' || hex(zeroblob(20000)) || '1'"
            with pytest.raises(ToolError, match="pattern") as refused:
                await env.call_tool("run_query", {"sql": sql})
            assert str(MAX_PATTERN_CHARS) in str(refused.value)
        long_sql = "SELECT " + " + ".join(["1"] * (MAX_SQL_CHARS // 4 + 1))
        result = await env.step({"sql": long_sql})
        assert result.observation.error is not None
        assert f"{MAX_SQL_CHARS:,} characters" in result.observation.error
        assert await rows(env, "SELECT name FROM departments WHERE name LIKE 'S%' LIMIT 0") == []
        assert await rows(env, "SELECT 'Sales' GLOB 'S*', 'Sales' LIKE '%les'") == [[1, 1]]


async def test_sqldb_truncates_after_max_steps() -> None:
    async with SqlDbEnv(max_steps=3) as env:
        await env.reset(seed=1)
        r1 = await env.step({"sql": "SELECT 1"})
        r2 = await env.step(call("list_tables"))
        r3 = await env.step({"sql": "SELECT 2"})
        assert not r1.done
        assert not r2.done
        assert r3.truncated
        assert not r3.terminated
        with pytest.raises(EnvNotResetError):
            await env.step({"answer": "1"})
        assert (await env.reset(seed=1)).observation.steps_left == 3


async def test_sqldb_reset_errors_and_tools_before_reset() -> None:
    async with SqlDbEnv() as env:
        with pytest.raises(ToolError, match="reset"):
            await env.call_tool("list_tables")
        with pytest.raises(ActionValidationError, match="question_kind"):
            await env.reset(seed=1, question_kind="poetry")
        with pytest.raises(ActionValidationError, match="difficulty"):
            await env.reset(seed=1, difficulty=3)


def files_in(directory: Path) -> list[str] | None:
    """The names in ``directory``, or None if it does not exist."""
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else None


async def db_path(env: SqlDbEnv) -> Path:
    return Path((await env.state()).model_dump()["db_path"])


async def test_sqldb_files_live_in_a_private_dir_removed_on_close() -> None:
    env = SqlDbEnv()
    await env.reset(seed=1)
    first_db = await db_path(env)
    workdir = first_db.parent
    assert files_in(workdir) == [first_db.name]
    await env.reset(seed=2)
    second_db = await db_path(env)
    assert second_db.parent == workdir
    assert files_in(workdir) == [second_db.name]  # the old episode's file is gone
    assert second_db != first_db

    await env.close()
    await env.close()  # twice is fine
    assert files_in(workdir) is None
    with pytest.raises(EnvClosedError):
        await env.reset(seed=1)
    with pytest.raises(EnvClosedError):
        await env.call_tool("list_tables")


async def test_sqldb_dropped_without_close_still_removes_its_files() -> None:
    env = SqlDbEnv()
    await env.reset(seed=1)
    workdir = (await db_path(env)).parent
    assert files_in(workdir) is not None
    # Stop the hook thread by hand first: it may hold the last reference for a moment, and
    # only the files are under test here.
    assert env._executor is not None
    env._executor.shutdown(wait=True)
    del env
    gc.collect()
    assert files_in(workdir) is None


@pytest.mark.parametrize("env_id", ["guess-number-v1", "guess-word-v1", "arithmetic-v1"])
async def test_close_twice_is_safe_and_final(env_id: str) -> None:
    env = make(env_id)
    await env.reset(seed=0)
    await env.close()
    await env.close()
    with pytest.raises(EnvClosedError):
        await env.step({"guess": 1} if env_id.startswith("guess") else {"answer": "1"})


async def test_an_invalid_guess_is_echoed_back_cut() -> None:
    """A megabyte guess used to come back whole in the message (and again as the last
    guess): one bad action, megabytes into the agent's context and the trace."""
    huge = "x" * 1_000_000
    async with GuessWordEnv() as env:
        await env.reset(seed=0)
        bad = await env.step({"guess": huge})
        assert bad.observation.valid is False
        assert len(bad.observation.model_dump_json()) < 2_000
        assert "1,000,000 chars" in bad.observation.message
    async with GuessNumberEnv() as env:
        await env.reset(seed=0)
        bad = await env.step({"guess": huge})
        assert bad.observation.feedback == "invalid"
        assert len(bad.observation.model_dump_json()) < 2_000
