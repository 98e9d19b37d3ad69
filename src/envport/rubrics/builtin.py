"""Built-in rubric types, the registry that names them, and :func:`from_specs`.

A task's ``rubric`` is a list of :class:`~envport.tasks.task.RubricSpec`
(``type``, ``weight``, ``params``). Each ``type`` names a *factory* here: a function
that takes the spec's ``params`` as keyword arguments, checks them, and returns the
reward function. So a bad spec (an unknown type, a misspelt parameter, a regex that
does not compile) fails when the rubric is built, not halfway through a run.

=============== ==========================================================================
exact_match     the answer (else the completion) equals the reference, whitespace and case
                normalised by default
numeric_match   the answer (else the last number in the completion) is within ``abs_tol``
                / ``rel_tol`` of the reference
regex           ``pattern`` matches the completion (or the answer)
env_reward      the environment's step rewards on the trace: their sum, or the last
test_command    run ``command`` in the environment; the reward file if it wrote one, else
                1.0 for exit status 0 and 0.0 otherwise (factory: :func:`run_test_command`)
llm_judge       ask a model behind any OpenAI-compatible endpoint; parse a 0-1 score or a
                yes/no verdict (needs the ``openai`` package, imported when first used)
=============== ==========================================================================

A spec's ``params`` may also hold ``name`` (the component's reward name; default: the
type), which is not passed to the factory. Add types with :func:`register`.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from envport.deadlines import GRACE_S, stage_time_left
from envport.rubrics.context import EnvHandle
from envport.rubrics.errors import (
    CommandError,
    JudgeError,
    RubricBuildError,
    RubricError,
    UnknownRubricTypeError,
)
from envport.rubrics.functions import RewardFn, Score
from envport.rubrics.rubric import RewardFunc, Rubric, runs_command
from envport.tasks.task import RubricSpec, Task
from envport.trace.model import Trace

Factory = Callable[..., RewardFn]
F = TypeVar("F", bound=Factory)

_REGISTRY: dict[str, Factory] = {}

#: Seconds a ``test_command`` may run when neither it nor the task says, outside any
#: stage deadline (inside one, it gets the time left but for a grace: see
#: :func:`run_test_command`).
DEFAULT_COMMAND_TIMEOUT_S = 600.0
#: Exit statuses with which a shell says a command could not be run at all.
_CANNOT_RUN = {126: "not executable", 127: "not found"}


def register(type_name: str, *, replace: bool = False) -> Callable[[F], F]:
    """Register a rubric type: ``@register("my_type")`` on a factory.

    The factory takes the spec's ``params`` as keyword arguments and returns a reward
    function (see :mod:`envport.rubrics.functions`).
    """

    def add(factory: F) -> F:
        if type_name in _REGISTRY and not replace and _REGISTRY[type_name] is not factory:
            raise RubricBuildError(
                f"rubric type {type_name!r} is already registered; pass replace=True to override it"
            )
        _REGISTRY[type_name] = factory
        return factory

    return add


def registered_types() -> list[str]:
    """Names of the registered rubric types, sorted."""
    return sorted(_REGISTRY)


def build(spec: RubricSpec) -> RewardFunc:
    """The rubric component one spec describes; :class:`RubricBuildError` if it cannot be."""
    factory = _REGISTRY.get(spec.type)
    if factory is None:
        raise UnknownRubricTypeError(spec.type, _REGISTRY)
    params = dict(spec.params)
    name = params.pop("name", None) or spec.type
    try:
        inspect.signature(factory).bind(**params)
    except TypeError as exc:
        accepted = [
            p.name
            for p in inspect.signature(factory).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        raise RubricBuildError(
            f"rubric {spec.type!r}: {exc}. Its params are: {', '.join(accepted) or '(none)'}.",
            type=spec.type,
        ) from exc
    try:
        fn = factory(**params)
    except RubricBuildError:
        raise
    except (TypeError, ValueError) as exc:
        raise RubricBuildError(f"rubric {spec.type!r}: {exc}", type=spec.type) from exc
    except Exception as exc:  # a factory of any kind fails at build time, as a build error
        raise RubricBuildError(
            f"rubric {spec.type!r}: its factory raised {type(exc).__name__}: {exc}",
            type=spec.type,
        ) from exc
    return RewardFunc(fn, spec.weight, str(name), params=params)


def from_specs(specs: Sequence[RubricSpec], *, timeout_s: float | None = None) -> Rubric:
    """The :class:`Rubric` a task's rubric specs describe (``Task.rubric``).

    Cheap (no environment, no network): call it before a run to check a task's rubric.
    A spec that cannot be built raises :class:`RubricBuildError` (of its own subclass, e.g.
    :class:`UnknownRubricTypeError`), its message starting with the spec's place,
    ``rubric[i]: ``, and ``index`` in its details.
    """
    funcs = []
    for index, spec in enumerate(specs):
        try:
            funcs.append(build(spec))
        except RubricBuildError as exc:
            raise locate(exc, f"rubric[{index}]", index=index) from exc.__cause__
    return Rubric(funcs, timeout_s=timeout_s)


def locate(exc: RubricBuildError, where: str, **details: Any) -> RubricBuildError:
    """``exc`` with ``where`` put in front of its message and ``details`` added; its class
    is kept, so ``except UnknownRubricTypeError`` still catches it."""
    exc.message = f"{where}: {exc.message}"
    exc.args = (exc.message, *exc.args[1:])
    exc.details.update(details)
    return exc


# --- text helpers ---------------------------------------------------------------------------

_WS = re.compile(r"\s+")
# A sign counts only where it is not joined to a word: the '-' in "10-20", "COVID-19" or
# "GPT-4" is a hyphen, not a minus; in "-5", "x = -5" and "answer: -3.2" it is a sign.
_SIGN = r"(?:(?<!\w)[-+\u2212])?"
_NUMBER = re.compile(
    rf"{_SIGN}(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
    rf"|{_SIGN}\.\d+(?:[eE][-+]?\d+)?"
)


def _normalise(text: str, *, case_sensitive: bool, normalize_whitespace: bool) -> str:
    text = text.strip()
    if normalize_whitespace:
        text = _WS.sub(" ", text)
    return text if case_sensitive else text.casefold()


def parse_number(value: Any) -> float | None:
    """``value`` as a float: a number, or text that is exactly one number (``"1,234"``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    text = value.strip().rstrip(".").replace("\u2212", "-")
    if not _NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def last_number(text: str | None) -> float | None:
    """The last number written in ``text`` (``None`` if there is none).

    A ``-`` or ``+`` joined to a word before it is a hyphen, not a sign: the last number of
    ``"range is 10-20"`` is 20, of ``"x = -5"`` it is -5.
    """
    found = _NUMBER.findall(text or "")
    return float(found[-1].replace(",", "").replace("\u2212", "-")) if found else None


def _references(expected: Any, reference: Any) -> list[Any]:
    ref = expected if expected is not None else reference
    if ref is None:
        raise RubricError(
            "no reference answer: the task has no 'answer' and the rubric component no "
            "'expected' param"
        )
    return list(ref) if isinstance(ref, list | tuple) else [ref]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# --- exact_match, numeric_match, regex, env_reward ---------------------------------------------


@register("exact_match")
def exact_match(
    *, case_sensitive: bool = False, normalize_whitespace: bool = True, expected: Any = None
) -> RewardFn:
    """1.0 if the answer (else the whole completion) equals the reference (or one of a
    list of references), after stripping and, by default, collapsing whitespace and
    ignoring case; else 0.0. No reply scores 0.0; no reference is an error."""

    def exact_match(completion: str | None, answer: str | None, reference: Any) -> Score:
        refs = _references(expected, reference)
        given = answer if answer is not None else completion
        if given is None:
            return Score(0.0, "no completion")
        norm = {"case_sensitive": case_sensitive, "normalize_whitespace": normalize_whitespace}
        mine = _normalise(given, **norm)
        hit = any(mine == _normalise(_text(r), **norm) for r in refs)
        return Score(1.0 if hit else 0.0, None if hit else f"{given!r:.200} != {refs[0]!r:.200}")

    return exact_match


@register("numeric_match")
def numeric_match(*, abs_tol: float = 1e-6, rel_tol: float = 0.0, expected: Any = None) -> RewardFn:
    """1.0 if the answer — or, when no answer is marked or it is not a number, the last
    number in the completion — is within ``abs_tol`` or ``rel_tol`` of the reference."""
    if abs_tol < 0 or rel_tol < 0:
        raise RubricBuildError("numeric_match: abs_tol and rel_tol must be >= 0")

    def numeric_match(completion: str | None, answer: str | None, reference: Any) -> Score:
        targets = []
        for ref in _references(expected, reference):
            value = parse_number(ref)
            if value is None:
                raise RubricError(f"numeric_match: the reference {ref!r} is not a number")
            targets.append(value)
        given = parse_number(answer) if answer is not None else None
        if given is None:
            given = last_number(answer if answer is not None else completion)
        if given is None and answer is not None:
            given = last_number(completion)
        if given is None:
            return Score(0.0, "no number in the completion")
        hit = any(math.isclose(given, t, rel_tol=rel_tol, abs_tol=abs_tol) for t in targets)
        return Score(1.0 if hit else 0.0, None if hit else f"{given:g} != {targets[0]:g}")

    return numeric_match


@register("regex")
def regex(
    *,
    pattern: str,
    ignore_case: bool = False,
    fullmatch: bool = False,
    target: Literal["completion", "answer"] = "completion",
) -> RewardFn:
    """1.0 if ``pattern`` is found in (with ``fullmatch``: matches all of) the completion
    (or, with ``target="answer"``, the parsed answer); else 0.0."""
    try:
        compiled = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise RubricBuildError(f"regex: pattern {pattern!r} does not compile: {exc}") from exc
    if target not in ("completion", "answer"):
        raise RubricBuildError(f"regex: target must be 'completion' or 'answer', not {target!r}")

    def regex(completion: str | None, answer: str | None) -> Score:
        text = completion if target == "completion" else answer
        if text is None:
            return Score(0.0, f"no {target}")
        match = compiled.fullmatch(text) if fullmatch else compiled.search(text)
        return Score(1.0 if match else 0.0, None if match else f"no match for {pattern!r}")

    return regex


@register("env_reward")
def env_reward(*, mode: Literal["sum", "last"] = "sum") -> RewardFn:
    """The environment's per-step rewards recorded on the trace: their sum (the return)
    or the last one. A run with no step rewards scores 0.0 (the reason says so)."""
    if mode not in ("sum", "last"):
        raise RubricBuildError(f"env_reward: mode must be 'sum' or 'last', not {mode!r}")

    def env_reward(trace: Trace) -> Score:
        rewards = [r for _, r in trace.step_rewards()]
        if not rewards:
            return Score(0.0, "the environment gave no step rewards")
        value = sum(rewards) if mode == "sum" else rewards[-1]
        return Score(value, metrics={"steps": len(rewards)})

    return env_reward


# --- test_command -------------------------------------------------------------------------


@register("test_command")
def run_test_command(
    *,
    command: str | list[str],
    timeout_s: float | None = None,
    tests_dir: str | None = None,
    tests_mount: str = "/tests",
    reward_file: str | None = None,
    reward_json: str | None = None,
) -> RewardFn:
    """Run ``command`` in the environment and score the run by what it reports.

    If ``tests_dir`` is given (relative to the task's root), it is uploaded to
    ``tests_mount`` first. After the command: the float in ``reward_file``, if given and
    present; else the ``"reward"`` key of ``reward_json`` (its other numeric keys become
    metrics); else 1.0 for exit status 0 and 0.0 for any other. A command that cannot
    be run (it cannot start, the shell says 126/127 and no reward file was written, it
    times out), a reward file that does not hold a number, and a reward file that
    already exists before the command runs (stale, or forged by the agent) are errors,
    not 0.

    The command's timeout is ``timeout_s``, else the task's scoring timeout (a Harbor
    verifier's ``timeout_sec``), else what is left of the scoring stage's deadline
    (:data:`~envport.deadlines.stage_deadline`, set by the rollout controller) less
    :data:`~envport.deadlines.GRACE_S`, else :data:`DEFAULT_COMMAND_TIMEOUT_S`. The first
    two are declared (:func:`~envport.rubrics.rubric.runs_command`): the rubric and the
    controller's scoring stage wait that long plus the grace. So a command that runs too
    long always fails with its own error ("ran past its N s timeout"), never the
    stage's.
    """
    if not command:
        raise RubricBuildError("test_command: 'command' is empty")
    if timeout_s is not None and timeout_s <= 0:
        raise RubricBuildError(f"test_command: timeout_s must be > 0, got {timeout_s!r}")

    async def test_command(env: EnvHandle, task: Task | None) -> Score:
        if tests_dir is not None:
            src = task.resolve(tests_dir) if task is not None else Path(tests_dir)
            if not src.is_dir():
                raise RubricError(f"test_command: tests_dir {str(src)!r} is not a directory")
            await env.upload(src, tests_mount)
        for path in (reward_file, reward_json):
            if path is not None and await _read_optional(env, path) is not None:
                raise RubricError(
                    f"test_command: reward file {path!r} exists before the tests ran; it "
                    "would be read as their result (left from an earlier run, or written by "
                    "the agent). Score in a fresh environment."
                )
        limit = timeout_s or (task.resources.timeouts.scoring if task else None)
        result = await env.run(command, limit or _time_left_s())
        metrics = {"exit_code": float(result.exit_code)}
        from_file = await _read_reward(env, reward_file, reward_json)
        if from_file is not None:
            value, extra, source = from_file
            return Score(value, f"from {source}", {**metrics, **extra})
        if result.exit_code in _CANNOT_RUN:
            raise CommandError(
                f"test_command: {command!r} could not run "
                f"({_CANNOT_RUN[result.exit_code]}, exit {result.exit_code}): "
                f"{_tail(result.stderr or result.stdout)}"
            )
        if result.exit_code == 0:
            return Score(1.0, "exit status 0", metrics)
        detail = _tail(result.stderr or result.stdout)
        return Score(0.0, f"exit status {result.exit_code}: {detail}", metrics)

    return runs_command(test_command, timeout_s)


def _time_left_s() -> float:
    """A command's timeout when nothing declares one: the stage's time left but for a
    grace (so the command's timeout fires first), else the default."""
    left = stage_time_left()
    if left is None:
        return DEFAULT_COMMAND_TIMEOUT_S
    return max(left - min(GRACE_S, left / 2), 0.1)


def _tail(text: str, limit: int = 2000) -> str:
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


async def _read_optional(env: EnvHandle, path: str) -> str | None:
    try:
        return await env.read_file(path)
    except FileNotFoundError:
        return None


async def _read_reward(
    env: EnvHandle, reward_file: str | None, reward_json: str | None
) -> tuple[float, dict[str, float], str] | None:
    """(reward, extra metrics, source) from the reward files, or ``None`` if none exists."""
    if reward_file is not None:
        text = await _read_optional(env, reward_file)
        if text is not None:
            value = parse_number(text)
            if value is None:
                raise RubricError(
                    f"test_command: reward file {reward_file!r} holds {text.strip()!r:.200}, "
                    "not a number"
                )
            return value, {}, reward_file
    if reward_json is not None:
        text = await _read_optional(env, reward_json)
        if text is not None:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise RubricError(
                    f"test_command: reward file {reward_json!r} is not JSON: {exc}"
                ) from exc
            value = parse_number(data.get("reward")) if isinstance(data, dict) else None
            if value is None:
                raise RubricError(
                    f"test_command: reward file {reward_json!r} has no numeric 'reward' "
                    f"key: {text.strip()!r:.200}"
                )
            extra = {
                k: float(v)
                for k, v in data.items()
                if k != "reward" and isinstance(v, int | float) and not isinstance(v, bool)
            }
            return value, extra, reward_json
    return None


# --- llm_judge ----------------------------------------------------------------------------

JUDGE_PROMPT = """\
You are grading a response to a task.

Task:
{question}

Reference answer:
{reference}

Response:
{response}

Is the response correct and complete with respect to the reference answer? Think \
briefly, then end with a line of the form "SCORE: <a number from 0 to 1>", where 1 \
means fully correct and 0 means wrong."""

_SCORE = re.compile(r"\bscore\s*[:=]?\s*(\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*(\d+(?:\.\d+)?))?", re.I)
_VERDICT_WORDS = {"yes": 1.0, "correct": 1.0, "pass": 1.0, "no": 0.0, "incorrect": 0.0, "fail": 0.0}
_VERDICT_LINE = re.compile(
    r"\b(?:verdict|final answer|answer|grade)\s*[:=]\s*\**\s*"
    r"(yes|no|correct|incorrect|pass|fail)\b",
    re.I,
)
_FIRST_WORD = re.compile(r"^\W*(\w+)")


def parse_verdict(reply: str) -> float:
    """A judge's reply as a score in [0, 1]; :class:`JudgeError` if it holds none.

    Reads, in order: the last ``SCORE: x`` (or ``SCORE: x/N``), a reply that is just a
    number, a reply whose first word is yes/no (correct/incorrect, pass/fail), and the
    last ``Verdict: yes``-style line.
    """
    scores = _SCORE.findall(reply)
    if scores:
        raw, scale = scores[-1]
        if scale and float(scale) == 0:
            raise JudgeError(f"judge score {raw}/{scale} divides by zero: {reply!r:.300}")
        value = float(raw) / float(scale) if scale else float(raw)
        if not 0.0 <= value <= 1.0:
            raise JudgeError(f"judge score {value:g} is outside [0, 1]: {reply!r:.300}")
        return value
    bare = parse_number(reply)
    if bare is not None:
        if not 0.0 <= bare <= 1.0:
            raise JudgeError(f"judge score {bare:g} is outside [0, 1]: {reply!r:.300}")
        return bare
    first = _FIRST_WORD.match(reply)
    if first and first.group(1).lower() in _VERDICT_WORDS:
        return _VERDICT_WORDS[first.group(1).lower()]
    lines = _VERDICT_LINE.findall(reply)
    if lines:
        return _VERDICT_WORDS[lines[-1].lower()]
    raise JudgeError(f"no score or yes/no verdict in the judge's reply: {reply!r:.300}")


def _question(task: Task | None) -> str:
    if task is None:
        return ""
    if isinstance(task.prompt, str):
        return task.prompt
    users = [m for m in task.prompt if m.role == "user"]
    content = (users or list(task.prompt))[-1].content
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content)


@register("llm_judge")
def llm_judge(
    *,
    model: str,
    base_url: str | None = None,
    api_key: str | None = None,
    api_key_env: str = "OPENAI_API_KEY",
    prompt: str = JUDGE_PROMPT,
    system_prompt: str | None = None,
    temperature: float = 0.0,
    max_tokens: int | None = 1024,
    timeout_s: float = 60.0,
    max_retries: int = 1,
) -> RewardFn:
    """Ask a model behind an OpenAI-compatible endpoint to grade the completion.

    ``prompt`` is a ``str.format`` template with ``{question}``, ``{reference}`` and
    ``{response}`` (double literal braces). The reply is read by :func:`parse_verdict`;
    its text is the reward's reason. The API key is ``api_key``, else the variable
    ``api_key_env``, else ``"EMPTY"`` when a ``base_url`` is given (local servers). An
    endpoint that fails, and a reply with no verdict, are errors (:class:`JudgeError`).
    No completion scores 0.0 without calling the judge. Needs the ``openai`` package.
    """
    if importlib.util.find_spec("openai") is None:
        raise RubricBuildError(
            "llm_judge needs the 'openai' package, which is not installed: pip install openai"
        )
    try:
        prompt.format(question="", reference="", response="")
    except (KeyError, IndexError, ValueError) as exc:
        raise RubricBuildError(
            f"llm_judge: prompt template is not valid: {exc!r}; it may use {{question}}, "
            "{reference} and {response}; write literal braces doubled"
        ) from exc

    async def llm_judge(task: Task | None, completion: str | None, reference: Any) -> Score:
        if completion is None or not completion.strip():
            return Score(0.0, "no response to judge")
        from openai import AsyncOpenAI, OpenAIError

        text = prompt.format(
            question=_question(task),
            reference="(none given)" if reference is None else _text(reference),
            response=completion,
        )
        messages: list[dict[str, str]] = []
        if system_prompt is not None:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": text})
        key = api_key or os.environ.get(api_key_env) or ("EMPTY" if base_url else None)
        where = base_url or "the OpenAI API"
        try:
            async with AsyncOpenAI(
                base_url=base_url, api_key=key, timeout=timeout_s, max_retries=max_retries
            ) as client:
                response = await client.chat.completions.create(
                    model=model,
                    messages=messages,  # type: ignore[arg-type]
                    temperature=temperature,
                    max_tokens=max_tokens,
                )
        except OpenAIError as exc:
            raise JudgeError(
                f"llm_judge: the judge at {where} (model {model!r}) failed: "
                f"{type(exc).__name__}: {exc}",
                base_url=base_url,
            ) from exc
        if not response.choices or not response.choices[0].message.content:
            raise JudgeError(f"llm_judge: the judge at {where} returned no text")
        reply = response.choices[0].message.content
        return Score(parse_verdict(reply), reply.strip()[:4000])

    return llm_judge
