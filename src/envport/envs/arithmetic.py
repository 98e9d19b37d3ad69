"""``arithmetic-v1``: one arithmetic question, one answer, a verifiable reward.

``reset(seed, difficulty=...)`` draws an expression from ``self.rng`` (a seed fixes it);
``step({"answer": "..."})`` scores the answer 1.0 if it equals the exact value, else 0.0,
and terminates the episode. The reference answer is in ``state()`` as
``reference_answer`` so rubrics can grade traces without re-deriving it.

Values are computed with :class:`fractions.Fraction`, and division only appears where it
is exact, so every answer is an integer and "correct" never depends on float rounding.
Answers are parsed leniently in form (whitespace, thousands separators, ``42.0``,
``1e3``, a Unicode minus, a trailing full stop) but strictly in value.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from pydantic import ConfigDict, Field

from envport.env import Env
from envport.errors import ActionValidationError, EnvNotResetError
from envport.types import Action, Observation, StepResult


@dataclass(frozen=True)
class Level:
    """How hard a question is: operand count, digits per operand, operators."""

    name: str
    operands: int
    digits: tuple[int, int]
    operators: str


LEVELS: dict[int, Level] = {
    1: Level("easy", operands=2, digits=(1, 2), operators="+-"),
    2: Level("medium", operands=2, digits=(2, 3), operators="+-*"),
    3: Level("hard", operands=3, digits=(2, 4), operators="+-*/"),
}
_BY_NAME = {level.name: number for number, level in LEVELS.items()}


def level_of(difficulty: int | str) -> int:
    """The level number for ``1``..``3`` or ``"easy"``/``"medium"``/``"hard"``."""
    if isinstance(difficulty, str) and difficulty.strip().lower() in _BY_NAME:
        return _BY_NAME[difficulty.strip().lower()]
    if isinstance(difficulty, int) and not isinstance(difficulty, bool) and difficulty in LEVELS:
        return difficulty
    choices = ", ".join([*(str(n) for n in LEVELS), *(repr(n) for n in _BY_NAME)])
    raise ActionValidationError(f"Unknown difficulty {difficulty!r}; choose one of {choices}.")


# --- expressions ---------------------------------------------------------------------------

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class Expr:
    text: str
    value: Fraction
    precedence: int  # 3 for a bare number


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def combine(left: Expr, op: str, right: Expr) -> Expr:
    """``left op right`` with the parentheses that keep the written order of operations."""
    prec = _PRECEDENCE[op]
    ltext = f"({left.text})" if left.precedence < prec else left.text
    # The right side of '-' and '/' needs parentheses at equal precedence too.
    tight = op in "-/"
    needs = right.precedence < prec or (tight and right.precedence == prec)
    rtext = f"({right.text})" if needs else right.text
    return Expr(f"{ltext} {op} {rtext}", _apply(op, left.value, right.value), prec)


def generate(rng: random.Random, level: Level) -> Expr:
    """A random expression for ``level``; exact integer value."""

    def number() -> Expr:
        digits = rng.randint(*level.digits)
        value = rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        return Expr(str(value), Fraction(value), 3)

    expr = number()
    for _ in range(level.operands - 1):
        op = rng.choice(level.operators)
        if op == "/":
            whole = abs(expr.value.numerator)
            divisors = [d for d in range(2, 100) if whole and whole % d == 0]
            if divisors:
                divisor = rng.choice(divisors)
                expr = combine(expr, "/", Expr(str(divisor), Fraction(divisor), 3))
                continue
            op = rng.choice([o for o in level.operators if o != "/"])
        operand = number()
        expr = combine(operand, op, expr) if rng.random() < 0.5 else combine(expr, op, operand)
    return expr


# --- answers -------------------------------------------------------------------------------

_GROUPED = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


# Bounds on answer text: ``Fraction("1e100000000")`` computes ``10**100000000`` in C while
# holding the GIL, which would freeze every session in the server (and its watchdog thread)
# for minutes. No question's answer comes near these bounds, so an answer past them is
# simply not read as a number, and is wrong.
MAX_ANSWER_CHARS = 300
MAX_EXPONENT = 1000
_EXPONENT = re.compile(r"[eE]([-+]?\d+)")


def parse_number(answer: str | int | float) -> Fraction | None:
    """The exact value of an answer, or ``None`` if it is not a number.

    Accepts ``" 42 "``, ``"1,234"``, ``"-7"``, ``"\u22127"``, ``"+3"``, ``"42.0"``,
    ``"1e3"``, ``"3/4"`` and ``"42."``; rejects words, ``"1,5"`` and empty text. Text longer
    than ``MAX_ANSWER_CHARS`` (after removing whitespace) or with an exponent beyond
    ``MAX_EXPONENT`` is also ``None``, so a crafted answer cannot make parsing slow.
    """
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        if answer != answer or answer in (float("inf"), float("-inf")):
            return None
        return Fraction(repr(answer))
    if len(answer) > 4 * MAX_ANSWER_CHARS:
        return None
    text = unicodedata.normalize("NFKC", answer).replace("\u2212", "-")
    text = re.sub(r"\s+", "", text)
    if len(text) > MAX_ANSWER_CHARS:
        return None
    if any(abs(int(exp)) > MAX_EXPONENT for exp in _EXPONENT.findall(text)):
        return None
    if text.endswith(".") and text[:-1][-1:].isdigit():
        text = text[:-1]
    if "," in text:
        if not _GROUPED.fullmatch(text):
            return None
        text = text.replace(",", "")
    if not text or "_" in text:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def format_number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(value)


# --- the environment -----------------------------------------------------------------------


class ArithmeticAction(Action):
    model_config = ConfigDict(json_schema_extra={"examples": [{"answer": "42"}]})

    answer: str | int | float = Field(description="Your answer, e.g. '42' or '-1,234'.")


class ArithmeticObservation(Observation):
    question: str = Field(description="The question to answer.")
    difficulty: str = Field(description="'easy', 'medium' or 'hard'.")
    answer: str | None = Field(default=None, description="The answer given, after the step.")
    correct: bool | None = Field(default=None, description="Whether it was right, after the step.")
    expected: str | None = Field(default=None, description="The right answer, after the step.")
    message: str = ""


class ArithmeticEnv(Env[ArithmeticAction, ArithmeticObservation]):
    """Answer one arithmetic question. Reward 1.0 if the answer is exactly right, else 0.0.

    Single-turn: the episode terminates after one answer. Reset option ``difficulty``
    (``"easy"``/``"medium"``/``"hard"`` or 1..3) sets the operand count, the digits per
    operand and the operators; hard questions use parentheses and exact division.
    """

    action_type = ArithmeticAction
    observation_type = ArithmeticObservation
    check_actions: ClassVar[list[dict[str, Any]]] = [{"answer": "42"}]
    reward_range = (0.0, 1.0)
    version = "1"

    def __init__(self, difficulty: int | str = "easy") -> None:
        super().__init__()
        self.difficulty = level_of(difficulty)
        self.level = LEVELS[self.difficulty]
        self.expr: Expr | None = None
        self.answered = False
        self.correct: bool | None = None

    @property
    def reference_answer(self) -> str | None:
        return format_number(self.expr.value) if self.expr is not None else None

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[ArithmeticObservation]:
        unknown = sorted(set(options) - {"difficulty"})
        if unknown:
            raise ActionValidationError(
                f"Unknown reset option(s) for arithmetic-v1: {', '.join(unknown)}. "
                "Allowed: difficulty."
            )
        difficulty = options.get("difficulty")
        self.level = LEVELS[self.difficulty if difficulty is None else level_of(difficulty)]
        self.expr = generate(self.rng, self.level)
        self.answered = False
        self.correct = None
        obs = ArithmeticObservation(
            question=f"What is {self.expr.text}? Answer with a single number.",
            difficulty=self.level.name,
        )
        return StepResult(observation=obs)

    async def on_step(self, action: ArithmeticAction) -> StepResult[ArithmeticObservation]:
        if self.expr is None or self.answered:
            raise EnvNotResetError(
                "arithmetic-v1 takes one answer per episode; call reset() for a new question."
            )
        given = parse_number(action.answer)
        self.answered = True
        self.correct = given is not None and given == self.expr.value
        expected = format_number(self.expr.value)
        if given is None:
            message = f"Could not read {action.answer!r} as a number; the answer is {expected}."
        elif self.correct:
            message = "Correct."
        else:
            message = f"Incorrect; the answer is {expected}."
        obs = ArithmeticObservation(
            question=f"What is {self.expr.text}? Answer with a single number.",
            difficulty=self.level.name,
            answer=str(action.answer),
            correct=self.correct,
            expected=expected,
            message=message,
        )
        return StepResult(observation=obs, reward=1.0 if self.correct else 0.0, terminated=True)

    def extra_state(self) -> dict[str, Any]:
        return {
            "question": self.expr.text if self.expr is not None else None,
            "difficulty": self.level.name,
            "reference_answer": self.reference_answer,
            "answered": self.answered,
            "correct": self.correct,
        }
