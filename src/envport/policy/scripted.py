"""``envport-scripted``: a rule-following stand-in for a model, so demos and tests run offline.

It is **not** a model and says so: its name is ``envport-scripted``. It reads the
conversation and plays the built-in environments by rule:

- an arithmetic question ("What is 12 + 7?") gets the bare number, right with
  probability ``p_correct`` and otherwise off by 1..3; the draw is a hash of the seed,
  the question and (when sampling) the choice, so a run is reproducible;
- with a ``guess`` tool taking an integer, it binary-searches the announced range using
  the "higher"/"lower" feedback in the tool results;
- with the sql env's tools it calls ``list_tables``, then ``describe_table`` for each
  table (parallel calls), then ``run_query`` with SQL for the question, then
  ``submit_answer`` with the first cell;
- with a ``bash`` tool (a coding agent such as mini-swe-agent) and a task asking to
  "create a file NAME containing TEXT", it runs ``echo TEXT > NAME``, then on the next
  turn ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (mini-swe-agent's way to finish:
  a command whose first output line is that marker and which exits 0);
- with ``read_file``, ``write_file`` and ``run`` tools (``sandbox-v1``) and a review note
  "on `FILE`: the code `BAD` should be `GOOD` ... run `COMMAND`" (``builtin:coding``),
  it reads FILE, writes it back with BAD replaced by GOOD (with probability
  ``p_correct``; otherwise it writes the file back unchanged, a failed fix), runs
  COMMAND and reports whether it exited 0 (as a shell comment: sandbox-v1 runs text
  replies as commands);
- anything else is echoed back.

Token ids come from :class:`~envport.policy.tokenizer.ByteTokenizer` over the exact text
the turn renders as, so the ids decode to the text and the template's prefix property
holds. Logprobs are plausible negative numbers hashed from the prompt and the position.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from envport.policy.base import (
    FinishReason,
    Generation,
    Message,
    SamplingParams,
    Tool,
    ToolCall,
)
from envport.policy.tokenizer import (
    ByteTokenizer,
    ParsedToolCall,
    content_text,
    render_assistant,
)

SCRIPTED_MODEL_NAME = "envport-scripted"


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _unit(*parts: object) -> float:
    """A number in [0, 1) drawn deterministically from ``parts``."""
    return stable_hash(*parts) / 2.0**64


# --- arithmetic ------------------------------------------------------------------------------

_QUESTION_RE = re.compile(r"what\s+is\s+(.+?)\s*(?:\?|=|$)", re.IGNORECASE | re.MULTILINE)
_EXPR_CHARS = re.compile(r"[\d\s+\-*/().,]+")
_TOKEN_RE = re.compile(r"\s*(\d+(?:\.\d+)?|[-+*/()])")


def _normalise_expr(text: str) -> str:
    for a, b in (("\u2212", "-"), ("\u00d7", "*"), ("\u00f7", "/"), ("x", "*"), (",", "")):
        text = text.replace(a, b)
    return text.strip()


def evaluate(expression: str) -> Fraction | None:
    """The exact value of ``+ - * /`` and parentheses over numbers, or ``None``."""
    text = _normalise_expr(expression)
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN_RE.match(text, pos)
        if match is None:
            if text[pos:].strip():
                return None
            break
        tokens.append(match.group(1))
        pos = match.end()
    if not tokens or not any(t[0].isdigit() for t in tokens):
        return None
    index = 0

    def peek() -> str | None:
        return tokens[index] if index < len(tokens) else None

    def take() -> str:
        nonlocal index
        index += 1
        return tokens[index - 1]

    def atom() -> Fraction:
        token = take()
        if token == "(":
            value = expr()
            if take() != ")":
                raise ValueError("unbalanced")
            return value
        if token in "+-":
            value = atom()
            return value if token == "+" else -value
        if not token[0].isdigit():
            raise ValueError(token)
        return Fraction(token)

    def term() -> Fraction:
        value = atom()
        while peek() in ("*", "/"):
            op, rhs = take(), atom()
            value = value * rhs if op == "*" else value / rhs
        return value

    def expr() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            op, rhs = take(), term()
            value = value + rhs if op == "+" else value - rhs
        return value

    try:
        value = expr()
    except (ValueError, IndexError, ZeroDivisionError):
        return None
    return value if index == len(tokens) else None


def find_arithmetic(text: str) -> tuple[str, Fraction] | None:
    """The last arithmetic question in ``text`` and its exact value, if there is one."""
    candidates = [m.group(1) for m in _QUESTION_RE.finditer(text)]
    stripped = text.strip().rstrip("?=").strip()
    if _EXPR_CHARS.fullmatch(stripped) and re.search(r"\d\s*[-+*/]", stripped):
        candidates.append(stripped)
    for candidate in reversed(candidates):
        value = evaluate(candidate)
        if value is not None:
            return _normalise_expr(candidate), value
    return None


def format_value(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


# --- reading the conversation ----------------------------------------------------------------


@dataclass(frozen=True)
class _PastCall:
    name: str
    arguments: dict[str, Any]
    result: str | None


def _last_user_index(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return -1


def _calls_since(messages: Sequence[Message], start: int) -> list[_PastCall]:
    """Tool calls the assistant made after ``start``, each with its result (if any)."""
    results: dict[str, str] = {}
    unclaimed: list[str] = []
    for message in messages[start + 1 :]:
        if message.get("role") == "tool":
            text = content_text(message.get("content"))
            call_id = message.get("tool_call_id")
            if isinstance(call_id, str) and call_id:
                results[call_id] = text
            else:
                unclaimed.append(text)
    calls: list[_PastCall] = []
    for message in messages[start + 1 :]:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = {}
            result = results.get(str(call.get("id")))
            if result is None and unclaimed:
                result = unclaimed.pop(0)
            calls.append(
                _PastCall(str(fn.get("name")), args if isinstance(args, dict) else {}, result)
            )
    return calls


def _json_or_none(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _tool_schemas(tools: Sequence[Tool] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = dict(params) if isinstance(params, Mapping) else {}
    return out


def _first_param(schema: Mapping[str, Any], *, of_type: str | None = None) -> str | None:
    props = schema.get("properties")
    if not isinstance(props, Mapping):
        return None
    for name, prop in props.items():
        if of_type is None or (isinstance(prop, Mapping) and prop.get("type") == of_type):
            return str(name)
    return None


# --- SQL ---------------------------------------------------------------------------------------


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


_SQL_RULES: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"How many employees work in the (.+?) department", re.IGNORECASE),
        "SELECT COUNT(*) FROM employees e JOIN departments d ON e.department_id = d.id "
        "WHERE d.name = {0}",
    ),
    (
        re.compile(
            r"total amount of all '(.+?)' orders handled by employees of the (.+?) department",
            re.IGNORECASE,
        ),
        "SELECT COALESCE(SUM(o.amount), 0) FROM orders o JOIN employees e "
        "ON o.employee_id = e.id JOIN departments d ON e.department_id = d.id "
        "WHERE o.status = {0} AND d.name = {1}",
    ),
    (
        re.compile(r"average salary of employees in the (.+?) department", re.IGNORECASE),
        "SELECT ROUND(AVG(e.salary), 2) FROM employees e JOIN departments d "
        "ON e.department_id = d.id WHERE d.name = {0}",
    ),
    (
        re.compile(r"Which department has the highest average employee salary", re.IGNORECASE),
        "SELECT d.name, AVG(e.salary) AS avg_salary FROM employees e JOIN departments d "
        "ON e.department_id = d.id GROUP BY d.id ORDER BY avg_salary DESC LIMIT 1",
    ),
    (
        re.compile(r"Which employee handled the largest total order amount", re.IGNORECASE),
        "SELECT e.name, SUM(o.amount) AS total FROM orders o JOIN employees e "
        "ON o.employee_id = e.id WHERE o.status != 'cancelled' GROUP BY e.id "
        "ORDER BY total DESC LIMIT 1",
    ),
    (
        re.compile(r"hired after (\d+) and earn more than (\d+)", re.IGNORECASE),
        "SELECT COUNT(*) FROM employees WHERE hire_year > {0} AND salary > {1}",
    ),
]


def sql_for(question: str, tables: Sequence[str]) -> str:
    """SQL that answers one of the sql env's question kinds (a row count otherwise)."""
    for pattern, template in _SQL_RULES:
        match = pattern.search(question)
        if match:
            args = [g if g.isdigit() else _q(g) for g in match.groups()]
            return template.format(*args)
    table = tables[0] if tables else "sqlite_master"
    return f'SELECT COUNT(*) FROM "{table}"'


def _first_cell(result: Any) -> str:
    if isinstance(result, Mapping):
        rows = result.get("rows")
        if isinstance(rows, list) and rows and isinstance(rows[0], list) and rows[0]:
            cell = rows[0][0]
            if isinstance(cell, float) and not cell.is_integer():
                return f"{cell:.2f}"
            if isinstance(cell, float):
                return str(int(cell))
            return str(cell)
    return "0"


def _table_names(result_text: str | None) -> list[str]:
    data = _json_or_none(result_text)
    if isinstance(data, Mapping):
        data = data.get("tables", data.get("result"))
    if isinstance(data, list):
        return [str(t) for t in data]
    return re.findall(r"[A-Za-z_][A-Za-z0-9_]*", result_text or "")


# --- bash (coding agents) ----------------------------------------------------------------------

#: The command that ends a mini-swe-agent run: its first output line is this marker.
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_CREATE_FILE_RE = re.compile(
    r"\bcreate\s+(?:a\s+|the\s+)?(?:new\s+)?file\s+(?:named\s+|called\s+)?"
    r"[`'\"]?(?P<path>\w[\w./-]*?)[`'\"]?\s+"
    r"(?:containing|with\s+(?:the\s+)?(?:content|contents|text))\s*:?\s*"
    r"(?:'(?P<single>[^'\n]*)'|\"(?P<double>[^\"\n]*)\"|(?P<bare>[^\n]*?))\.?\s*(?:$|\n)",
    re.IGNORECASE | re.MULTILINE,
)


@dataclass(frozen=True)
class FileTask:
    """A "create a file NAME containing TEXT" request found in a user message."""

    message_index: int
    path: str
    content: str

    @property
    def command(self) -> str:
        return f"echo {shlex.quote(self.content)} > {shlex.quote(self.path)}"


def find_file_task(messages: Sequence[Message]) -> FileTask | None:
    """The latest user message asking to create a file with given content, if any.

    Paths that leave the working directory (absolute, or with ``..``) are not matched.
    """
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") != "user":
            continue
        match = _CREATE_FILE_RE.search(content_text(messages[index].get("content")))
        if match is None:
            continue
        path = match.group("path")
        if path.startswith("/") or ".." in path.split("/"):
            continue
        text = next(g for g in match.group("single", "double", "bare") if g is not None)
        return FileTask(index, path, text.strip())
    return None


# --- review-note fixes (sandbox coding tasks) -------------------------------------------------

_FIX_RE = re.compile(
    r"on\s+`(?P<path>[^`\s]+)`\s*:\s*the\s+code\s+`(?P<bad>[^`]+)`\s+should\s+be\s+"
    r"`(?P<good>[^`]+)`.*?\brun\s+`(?P<command>[^`]+)`",
    re.IGNORECASE | re.DOTALL,
)
_FIX_TOOLS = ("read_file", "write_file", "run")


@dataclass(frozen=True)
class FixTask:
    """A review note found in a user message: replace ``bad`` by ``good`` in ``path``,
    then check with ``command``."""

    message_index: int
    path: str
    bad: str
    good: str
    command: str


def find_fix_task(messages: Sequence[Message]) -> FixTask | None:
    """The latest user message with a review note naming a file, a fix and a test command.

    Paths that leave the working directory (absolute, or with ``..``) are not matched.
    """
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") != "user":
            continue
        match = _FIX_RE.search(content_text(messages[index].get("content")))
        if match is None:
            continue
        path = match.group("path")
        if path.startswith("/") or ".." in path.split("/"):
            continue
        return FixTask(index, path, match.group("bad"), match.group("good"), match.group("command"))
    return None


def _exit_code(result: str | None) -> int | None:
    data = _json_or_none(result)
    if isinstance(data, Mapping) and isinstance(data.get("exit_code"), int):
        return int(data["exit_code"])
    return None


# --- the policy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    """What the script decided: content and/or tool calls (name, arguments)."""

    content: str | None
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()


class ScriptedPolicy:
    """A deterministic, clearly labelled scripted policy (see the module docstring).

    ``seed`` fixes every draw; a request's ``seed`` is mixed in. At ``temperature == 0``
    all choices of a request are the same; otherwise each choice draws on its own.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        p_correct: float = 0.8,
        name: str = SCRIPTED_MODEL_NAME,
        max_model_len: int = 32768,
    ) -> None:
        if not 0.0 <= p_correct <= 1.0:
            raise ValueError(f"p_correct must be in [0, 1], got {p_correct!r}.")
        self.seed = seed
        self.p_correct = p_correct
        self._name = name
        self._max_model_len = max_model_len
        self._tokenizer = ByteTokenizer()

    @property
    def name(self) -> str:
        return self._name

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """Ids of its tokenizer (0..vocab_size - 1); the server refuses others with a 400."""
        return self._tokenizer.vocab_size

    # --- the Policy contract -------------------------------------------------------------------

    async def generate(
        self, messages: Sequence[Message], tools: Sequence[Tool] | None, sampling: SamplingParams
    ) -> Generation:
        prompt = self._tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True)
        prompt_ids = self._tokenizer.encode(prompt)
        usable = None if sampling.tool_choice == "none" else tools
        turn = self._decide(messages, _tool_schemas(usable), sampling)
        key = (self.seed, sampling.seed, _sample_key(sampling), prompt)
        calls = tuple(
            ToolCall(
                id=f"call_{stable_hash(*key, i, name):016x}",
                name=name,
                arguments=json.dumps(args),
            )
            for i, (name, args) in enumerate(turn.calls)
        )
        return self._shape(prompt_ids, turn.content, calls, sampling, key)

    async def complete(self, prompt: str | Sequence[int], sampling: SamplingParams) -> Generation:
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self._tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            text = self._tokenizer.decode(prompt_ids)
        found = find_arithmetic(text)
        if found is not None:
            answer = " " + self._arithmetic_answer(*found, sampling)
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            answer = " " + lines[-1].strip() if lines else " envport-scripted"
        key = (self.seed, sampling.seed, _sample_key(sampling), text)
        gen = self._shape(
            prompt_ids, answer, (), sampling, key, end_id=self._tokenizer.eos_token_id
        )
        if sampling.prompt_logprobs is None:
            return gen
        return self._with_prompt_logprobs(gen, sampling.prompt_logprobs, key)

    def _with_prompt_logprobs(self, gen: Generation, k: int, key: tuple[object, ...]) -> Generation:
        """``gen`` with made-up logprobs for its prompt tokens (the first has none)."""
        ids = gen.prompt_token_ids
        lps = [_logprob(("prompt", *key), i, t) for i, t in enumerate(ids)]
        tops: list[tuple[tuple[int, float], ...] | None] = [None]
        tops += [
            _alternatives(t, lp, k, self._tokenizer.vocab_size) if k else ()
            for t, lp in zip(ids[1:], lps[1:], strict=True)
        ]
        return replace(
            gen,
            prompt_logprobs=(None, *lps[1:]) if ids else (),
            prompt_top_logprobs=tuple(tops) if ids else (),
        )

    # --- deciding -------------------------------------------------------------------------------

    def _decide(
        self,
        messages: Sequence[Message],
        tools: Mapping[str, Mapping[str, Any]],
        sampling: SamplingParams,
    ) -> _Turn:
        start = _last_user_index(messages)
        user_text = content_text(messages[start].get("content")) if start >= 0 else ""
        guess_param = _first_param(tools["guess"], of_type="integer") if "guess" in tools else None
        if guess_param is not None:
            return self._guess_turn(messages, guess_param)
        if "run_query" in tools:
            return self._sql_turn(messages, start, user_text, tools)
        file_task = find_file_task(messages) if "bash" in tools else None
        if file_task is not None:
            return self._bash_turn(messages, file_task, tools["bash"])
        fix_task = find_fix_task(messages) if all(t in tools for t in _FIX_TOOLS) else None
        if fix_task is not None:
            return self._fix_turn(messages, fix_task, sampling)
        found = find_arithmetic(user_text)
        if found is not None:
            answer = self._arithmetic_answer(*found, sampling)
            submit = next((t for t in ("submit_answer", "answer", "submit") if t in tools), None)
            if submit is None:
                return _Turn(answer)
            done = [c for c in _calls_since(messages, start) if c.name == submit]
            if done:
                return _Turn(str(next(iter(done[-1].arguments.values()), answer)))
            param = _first_param(tools[submit]) or "answer"
            return _Turn(None, ((submit, {param: answer}),))
        return _Turn(user_text or "envport-scripted: nothing to echo.")

    def _arithmetic_answer(self, question: str, value: Fraction, sampling: SamplingParams) -> str:
        draw = (self.seed, sampling.seed, _sample_key(sampling), question)
        if _unit("correct", *draw) < self.p_correct:
            return format_value(value)
        offsets = (-3, -2, -1, 1, 2, 3)
        offset = offsets[stable_hash("offset", *draw) % len(offsets)]
        return format_value(value + offset)

    def _guess_turn(self, messages: Sequence[Message], param: str) -> _Turn:
        low, high = 1, 100
        for message in messages:
            if message.get("role") in ("system", "user"):
                text = content_text(message.get("content"))
                match = re.search(r"(?:from|between)\s+(-?\d+)\s+(?:to|and)\s+(-?\d+)", text)
                if match:
                    low, high = int(match.group(1)), int(match.group(2))
        for call in _calls_since(messages, -1):
            if call.name != "guess" or call.result is None:
                continue
            guess = call.arguments.get(param)
            if not isinstance(guess, int):
                continue
            feedback = _feedback(call.result)
            if feedback == "correct":
                return _Turn(f"The number is {guess}.")
            if feedback == "higher":
                low = max(low, guess + 1)
            elif feedback == "lower":
                high = min(high, guess - 1)
            if "out of guesses" in call.result.lower():
                return _Turn("I ran out of guesses.")
        if low > high:
            return _Turn("The feedback contradicts itself; I give up.")
        return _Turn(None, (("guess", {param: (low + high) // 2}),))

    def _sql_turn(
        self,
        messages: Sequence[Message],
        start: int,
        question: str,
        tools: Mapping[str, Mapping[str, Any]],
    ) -> _Turn:
        calls = _calls_since(messages, start)
        last = calls[-1] if calls else None
        tables = next((_table_names(c.result) for c in calls if c.name == "list_tables"), [])
        if last is None and "list_tables" in tools:
            return _Turn(None, (("list_tables", {}),))
        if (last is None or last.name == "list_tables") and tables and "describe_table" in tools:
            return _Turn(None, tuple(("describe_table", {"name": t}) for t in tables))
        if last is None or last.name in ("list_tables", "describe_table"):
            return _Turn(None, (("run_query", {"sql": sql_for(question, tables)}),))
        if last.name == "run_query" and "submit_answer" in tools:
            answer = _first_cell(_json_or_none(last.result))
            return _Turn(None, (("submit_answer", {"answer": answer}),))
        submitted = last.arguments.get("answer", _first_cell(_json_or_none(last.result)))
        return _Turn(f"Answer: {submitted}")

    def _bash_turn(
        self, messages: Sequence[Message], task: FileTask, schema: Mapping[str, Any]
    ) -> _Turn:
        param = _first_param(schema, of_type="string") or "command"
        commands = [
            c.arguments.get(param)
            for c in _calls_since(messages, task.message_index)
            if c.name == "bash"
        ]
        if not commands:
            return _Turn(f"I will create {task.path}.", (("bash", {param: task.command}),))
        if commands[-1] != SUBMIT_COMMAND:
            return _Turn(
                f"{task.path} is written; submitting.", (("bash", {param: SUBMIT_COMMAND}),)
            )
        return _Turn(f"Created {task.path}.")

    def _fix_turn(
        self, messages: Sequence[Message], task: FixTask, sampling: SamplingParams
    ) -> _Turn:
        """read_file -> write_file (the fix, or a failed one) -> run the tests -> report."""
        calls = _calls_since(messages, task.message_index)
        read = next((c for c in calls if c.name == "read_file"), None)
        if read is None:
            return _Turn(f"Reading {task.path}.", (("read_file", {"path": task.path}),))
        if not any(c.name == "write_file" for c in calls):
            original = read.result or ""
            if original.startswith("Error ("):
                return _Turn(f"I cannot read {task.path}: {original}")
            draw = (self.seed, sampling.seed, _sample_key(sampling), task.path, task.bad)
            fixed = _unit("correct", *draw) < self.p_correct
            content = original.replace(task.bad, task.good, 1) if fixed else original
            return _Turn(
                f"Replacing `{task.bad}` with `{task.good}` in {task.path}.",
                (("write_file", {"path": task.path, "content": content}),),
            )
        ran = [c for c in calls if c.name == "run"]
        if not ran:
            return _Turn("Running the tests.", (("run", {"command": task.command}),))
        # A shell comment: an environment that runs text replies as commands (sandbox-v1
        # does) runs it as a no-op.
        code = _exit_code(ran[-1].result)
        if code == 0:
            return _Turn(f"# Fixed {task.path}: {task.command} passes.")
        return _Turn(f"# {task.command} still fails (exit {code}); I stop here.")

    # --- tokens ---------------------------------------------------------------------------------

    def _shape(
        self,
        prompt_ids: list[int],
        content: str | None,
        calls: tuple[ToolCall, ...],
        sampling: SamplingParams,
        key: tuple[object, ...],
        *,
        end_id: int | None = None,
    ) -> Generation:
        """Token ids, logprobs and finish reason for a decided turn, honouring stop/max_tokens."""
        tok = self._tokenizer
        end = tok.im_end_id if end_id is None else end_id
        body = render_assistant(content, [ParsedToolCall(c.name, c.arguments) for c in calls])
        finish: FinishReason = "tool_calls" if calls else "stop"
        stop_reason: str | int | None = None
        if not calls and sampling.stop:
            # A real engine checks stop strings after each token: the one that is complete
            # first ends the completion (the first listed, if two end on the same token).
            # Its tokens were generated, so they stay in the ids; only the text is cut.
            hits = [
                (body.find(s) + len(s), order, s)
                for order, s in enumerate(sampling.stop)
                if s and s in body
            ]
            if hits:
                end_at, _, stop_str = min(hits)
                body, stop_reason = body[:end_at], stop_str
                keep = sampling.include_stop_str_in_output
                content = body if keep else body[: end_at - len(stop_str)]
        ids = tok.encode(body)
        if stop_reason is None:
            ids.append(end)
        budget = sampling.max_tokens
        if budget is None:  # vLLM's default: what the context has left
            budget = max(0, self._max_model_len - len(prompt_ids))
        if len(ids) > budget:
            ids = ids[:budget]
            finish, calls, stop_reason = "length", (), None
            content = tok.decode(ids, skip_special_tokens=True)
        logprobs = [_logprob(key, i, t) for i, t in enumerate(ids)]
        top: tuple[tuple[tuple[int, float], ...], ...] = ()
        if sampling.top_logprobs > 0:
            top = tuple(
                _alternatives(t, lp, sampling.top_logprobs, tok.vocab_size)
                for t, lp in zip(ids, logprobs, strict=True)
            )
        return Generation(
            text=content,
            tool_calls=calls,
            finish_reason=finish,
            prompt_token_ids=tuple(prompt_ids),
            token_ids=tuple(ids),
            logprobs=tuple(logprobs),
            top_logprobs=top,
            stop_reason=stop_reason,
            metadata={"policy": "scripted"},
        )


def _sample_key(sampling: SamplingParams) -> int:
    return 0 if sampling.temperature == 0 else sampling.sample_index


def _feedback(result: str) -> str | None:
    data = _json_or_none(result)
    if isinstance(data, Mapping) and isinstance(data.get("feedback"), str):
        return str(data["feedback"]).lower()
    lowered = result.lower()
    for word in ("correct", "higher", "lower"):
        if re.search(rf"\b{word}\b", lowered):
            return word
    return None


def _logprob(key: tuple[object, ...], position: int, token_id: int) -> float:
    """Mostly near 0, sometimes a few nats down; never 0 or below -8."""
    u = _unit("logprob", *key, position, token_id)
    return round(-0.0005 - 7.5 * u**6, 6)


def _alternatives(
    token_id: int, logprob: float, k: int, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """``k`` candidates including the sampled token, best first, total mass at most 1."""
    rest = 1.0 - math.exp(logprob)
    out = [(token_id, logprob)]
    for j in range(1, k):
        other = (token_id + 37 * j) % vocab_size
        out.append((other, round(math.log(rest * 0.5**j), 6)))
    return tuple(sorted(out, key=lambda pair: -pair[1]))
