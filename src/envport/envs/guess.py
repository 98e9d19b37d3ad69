"""Guessing games with partial feedback: ``guess-number-v1`` and ``guess-word-v1``.

Both games hide a secret chosen from ``self.rng`` (so a seed fixes it), answer each guess
with feedback that narrows the search, give reward 1.0 on a hit and 0.0 otherwise, and
truncate the episode once ``max_steps`` guesses are used. Every guess counts, malformed
ones included, so an episode always ends.

A guess can arrive two ways, with the same effect: as a plain step action
(``{"guess": 42}``) or through the ``guess`` tool (``{"type": "call_tool", "tool_name":
"guess", "arguments": {"number": 42}}``). A tool result cannot carry a reward in the
OpenEnv protocol, so the tool returns ``reward`` and ``done`` in its result, and when the
tool is called through ``step`` the step result carries them too.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, ClassVar

from pydantic import ConfigDict, Field

from envport.env import AnyAction, Env
from envport.envs.arithmetic import parse_number
from envport.errors import ActionValidationError, EnvNotResetError, ToolError
from envport.tools import tool
from envport.types import Action, Observation, StepResult


@dataclasses.dataclass(frozen=True)
class _Outcome:
    reward: float
    terminated: bool
    truncated: bool


def _check_options(env_name: str, options: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ActionValidationError(
            f"Unknown reset option(s) for {env_name}: {', '.join(unknown)}. "
            f"Allowed: {', '.join(sorted(allowed)) or '(none)'}."
        )


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ActionValidationError(f"{name} must be a positive integer, got {value!r}.")
    return value


class _GuessGame(Env[Any, Any]):
    """Shared episode bookkeeping: attempts, the end of the episode, tool outcomes."""

    reward_range = (0.0, 1.0)
    version = "1"
    _env_name: ClassVar[str] = "guess"

    def __init__(self, max_steps: int) -> None:
        super().__init__()
        self.max_steps = _positive_int("max_steps", max_steps)
        self._episode_max_steps = self.max_steps
        self.attempts = 0
        self.solved = False
        self.episode_over = False
        self._pending: _Outcome | None = None

    @property
    def attempts_left(self) -> int:
        return max(0, self._episode_max_steps - self.attempts)

    def _start(self, max_steps: int | None) -> None:
        self._episode_max_steps = (
            self.max_steps if max_steps is None else _positive_int("max_steps", max_steps)
        )
        self.attempts = 0
        self.solved = False
        self.episode_over = False
        self._pending = None

    def _record_attempt(self, hit: bool) -> _Outcome:
        """Count one guess and decide whether the episode ends."""
        self.attempts += 1
        self.solved = hit
        truncated = not hit and self.attempts >= self._episode_max_steps
        self.episode_over = hit or truncated
        outcome = _Outcome(reward=1.0 if hit else 0.0, terminated=hit, truncated=truncated)
        self._pending = outcome
        return outcome

    def _require_live_episode(self, *, tool_call: bool) -> None:
        if self.episode_over or self.episode_id is None:
            why = "has not started" if self.episode_id is None else "is over"
            message = f"The {self._env_name} episode {why}; call reset() to start a new one."
            if tool_call:
                raise ToolError(message, kind="execution_error")
            raise EnvNotResetError(message)

    async def step(self, action: Any | AnyAction | dict[str, Any]) -> StepResult[Any]:
        """Like :meth:`Env.step`, but a ``guess`` tool call carries its reward and end."""
        self._pending = None
        result = await super().step(action)
        outcome, self._pending = self._pending, None
        if outcome is not None and result.reward is None:
            result = result.model_copy(
                update={
                    "reward": outcome.reward,
                    "terminated": outcome.terminated,
                    "truncated": outcome.truncated,
                }
            )
        return result

    def extra_state(self) -> dict[str, Any]:
        return {
            "attempts_used": self.attempts,
            "attempts_left": self.attempts_left,
            "max_steps": self._episode_max_steps,
            "solved": self.solved,
            "episode_over": self.episode_over,
        }


# --- guess-number-v1 ---------------------------------------------------------------------


class GuessNumberAction(Action):
    model_config = ConfigDict(json_schema_extra={"examples": [{"guess": 50}]})

    guess: int | str = Field(
        description="Your guess: an integer, or text holding one (e.g. ' 42 ')."
    )


class GuessNumberObservation(Observation):
    message: str = Field(default="", description="What happened, in words.")
    feedback: str = Field(
        default="start",
        description="'start', 'higher' (the secret is higher), 'lower', 'correct' or 'invalid'.",
    )
    low: int = Field(default=1, description="Smallest possible secret.")
    high: int = Field(default=100, description="Largest possible secret.")
    last_guess: int | None = None
    attempts_used: int = 0
    attempts_left: int = 0
    secret: int | None = Field(default=None, description="Revealed once the episode is over.")


SHOWN_CHARS = 80  # of an invalid guess, echoed back: a megabyte guess is not a megabyte reply


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text):,} chars)"


def _shown(raw: int | str) -> str:
    return repr(raw) if not isinstance(raw, str) else repr(_cut(raw))


def _parse_int(value: int | str) -> int | None:
    """An integer guess, or None. Text is read exactly (not through a float, which holds
    integers only up to 2**53), with :func:`parse_number`'s bounds on length and exponent."""
    if isinstance(value, int):
        return value
    number = parse_number(value.replace(",", "").replace("_", ""))
    if number is None or number.denominator != 1:
        return None
    return int(number)


class GuessNumberEnv(_GuessGame):
    """Guess a secret integer between 1 and ``high``; each miss says 'higher' or 'lower'.

    Reward 1.0 when the guess equals the secret (the episode terminates), 0.0 otherwise.
    The episode is truncated after ``max_steps`` guesses. Reset options: ``high``,
    ``max_steps``. Tool: ``guess(number)``.
    """

    action_type = GuessNumberAction
    observation_type = GuessNumberObservation
    check_actions: ClassVar[list[dict[str, Any]]] = [{"guess": 50}, {"guess": "25"}]
    _env_name = "guess-number"

    def __init__(self, high: int = 100, max_steps: int = 10) -> None:
        super().__init__(max_steps)
        self.high = _positive_int("high", high)
        self._episode_high = self.high
        self.secret = 0

    async def on_reset(
        self, seed: int | None, **options: Any
    ) -> StepResult[GuessNumberObservation]:
        _check_options("guess-number-v1", options, {"high", "max_steps"})
        high = options.get("high")
        episode_high = self.high if high is None else _positive_int("high", high)
        if options.get("max_steps") is not None:  # every option checked before any change
            _positive_int("max_steps", options["max_steps"])
        self._episode_high = episode_high
        self._start(options.get("max_steps"))
        self.secret = self.rng.randint(1, self._episode_high)
        message = (
            f"I am thinking of an integer from 1 to {self._episode_high}. "
            f"You have {self.attempts_left} guesses."
        )
        return StepResult(observation=self._observation("start", message, None))

    async def on_step(self, action: GuessNumberAction) -> StepResult[GuessNumberObservation]:
        self._require_live_episode(tool_call=False)
        feedback, message, guess, outcome = self._guess(action.guess)
        return StepResult(
            observation=self._observation(feedback, message, guess),
            reward=outcome.reward,
            terminated=outcome.terminated,
            truncated=outcome.truncated,
        )

    @tool
    async def guess(self, number: int) -> dict[str, Any]:
        """Guess the secret number; the reply says 'higher', 'lower' or 'correct'.

        Args:
            number: Your guess, an integer in the announced range.
        """
        self._require_live_episode(tool_call=True)
        feedback, message, guess, outcome = self._guess(number)
        obs = self._observation(feedback, message, guess)
        return {**obs.model_dump(), "reward": outcome.reward, "done": self.episode_over}

    def extra_state(self) -> dict[str, Any]:
        return {
            **super().extra_state(),
            "high": self._episode_high,
            "reference_answer": self.secret,
        }

    def _guess(self, raw: int | str) -> tuple[str, str, int | None, _Outcome]:
        guess = _parse_int(raw)
        if guess is None:
            feedback = "invalid"
            message = f"{_shown(raw)} is not an integer."
        elif guess == self.secret:
            feedback, message = "correct", f"Correct! The number was {self.secret}."
        elif guess < self.secret:
            feedback, message = "higher", f"{guess} is too low; the number is higher."
        else:
            feedback, message = "lower", f"{guess} is too high; the number is lower."
        outcome = self._record_attempt(feedback == "correct")
        if outcome.truncated:
            message += f" Out of guesses; the number was {self.secret}."
        return feedback, message, guess, outcome

    def _observation(
        self, feedback: str, message: str, guess: int | None
    ) -> GuessNumberObservation:
        return GuessNumberObservation(
            message=message,
            feedback=feedback,
            low=1,
            high=self._episode_high,
            last_guess=guess,
            attempts_used=self.attempts,
            attempts_left=self.attempts_left,
            secret=self.secret if self.episode_over else None,
        )


# --- guess-word-v1 -----------------------------------------------------------------------

WORDS: tuple[str, ...] = (
    "apple", "brave", "crane", "drink", "eagle", "flame", "grape", "house", "input", "joker",
    "knife", "lemon", "mango", "night", "ocean", "piano", "queen", "river", "stone", "tiger",
    "urban", "vivid", "whale", "xenon", "yacht", "zebra", "bloom", "chess", "dwarf", "fjord",
    "glove", "heart", "ivory", "jelly", "karma", "lunar", "mirth", "noble", "olive", "plumb",
    "quilt", "robin", "sweet", "trout", "umbra", "vigor", "wrist", "youth", "zesty", "llama",
)  # fmt: skip

#: Feedback letters, one per position, as in Wordle.
HIT, PRESENT, ABSENT = "G", "Y", "."


def score_guess(secret: str, guess: str) -> str:
    """Wordle feedback for ``guess``: ``G`` right place, ``Y`` elsewhere, ``.`` absent.

    Repeated letters are counted: a letter is marked ``Y`` only as many times as it occurs
    in the secret beyond the ``G`` matches.
    """
    marks = [ABSENT] * len(guess)
    unmatched = Counter(s for s, g in zip(secret, guess, strict=True) if s != g)
    for i, (s, g) in enumerate(zip(secret, guess, strict=True)):
        if s == g:
            marks[i] = HIT
        elif unmatched[g] > 0:
            marks[i] = PRESENT
            unmatched[g] -= 1
    return "".join(marks)


class GuessWordAction(Action):
    model_config = ConfigDict(json_schema_extra={"examples": [{"guess": "crane"}]})

    guess: str = Field(description="A five-letter word.")


class GuessWordObservation(Observation):
    message: str = Field(default="", description="What happened, in words.")
    feedback: str = Field(
        default="",
        description="One mark per letter: 'G' right letter, right place; 'Y' in the word "
        "elsewhere; '.' not in the word. Empty for the first observation or an invalid guess.",
    )
    valid: bool = True
    last_guess: str | None = None
    word_length: int = 5
    history: list[tuple[str, str]] = Field(
        default_factory=list, description="Earlier valid guesses with their feedback."
    )
    attempts_used: int = 0
    attempts_left: int = 0
    secret: str | None = Field(default=None, description="Revealed once the episode is over.")


class GuessWordEnv(_GuessGame):
    """Guess a five-letter word in ``max_steps`` tries, with Wordle letter feedback.

    Each guess gets one mark per letter: ``G`` (right place), ``Y`` (elsewhere in the
    word), ``.`` (absent). Reward 1.0 when the word is found, 0.0 otherwise; truncated
    after ``max_steps`` guesses (malformed ones count). Reset option: ``max_steps``.
    Tool: ``guess(word)``.
    """

    action_type = GuessWordAction
    observation_type = GuessWordObservation
    check_actions: ClassVar[list[dict[str, Any]]] = [{"guess": "crane"}, {"guess": "stone"}]
    _env_name = "guess-word"

    def __init__(self, max_steps: int = 6, words: tuple[str, ...] = WORDS) -> None:
        super().__init__(max_steps)
        if not words or any(len(w) != 5 or not w.isalpha() for w in words):
            raise ValueError("words must be a non-empty list of five-letter words.")
        self.words = tuple(w.lower() for w in words)
        self.secret = ""
        self.history: list[tuple[str, str]] = []

    async def on_reset(self, seed: int | None, **options: Any) -> StepResult[GuessWordObservation]:
        _check_options("guess-word-v1", options, {"max_steps"})
        self._start(options.get("max_steps"))
        self.secret = self.rng.choice(self.words)
        self.history = []
        message = (
            f"Guess the five-letter word. You have {self.attempts_left} guesses. Feedback: "
            "'G' right letter in the right place, 'Y' letter elsewhere in the word, '.' absent."
        )
        return StepResult(observation=self._observation(message, "", None, valid=True))

    async def on_step(self, action: GuessWordAction) -> StepResult[GuessWordObservation]:
        self._require_live_episode(tool_call=False)
        obs, outcome = self._guess(action.guess)
        return StepResult(
            observation=obs,
            reward=outcome.reward,
            terminated=outcome.terminated,
            truncated=outcome.truncated,
        )

    @tool
    async def guess(self, word: str) -> dict[str, Any]:
        """Guess the secret five-letter word and get per-letter feedback.

        Args:
            word: A five-letter word.
        """
        self._require_live_episode(tool_call=True)
        obs, outcome = self._guess(word)
        return {**obs.model_dump(), "reward": outcome.reward, "done": self.episode_over}

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "reference_answer": self.secret}

    def _guess(self, raw: str) -> tuple[GuessWordObservation, _Outcome]:
        word = raw.strip().lower()
        if len(word) != 5 or not word.isalpha() or not word.isascii():
            outcome = self._record_attempt(False)
            message = f"{_shown(raw)} is not a five-letter word (letters a-z only)."
            if outcome.truncated:
                message += f" Out of guesses; the word was {self.secret!r}."
            return self._observation(message, "", _cut(raw), valid=False), outcome
        marks = score_guess(self.secret, word)
        self.history.append((word, marks))
        outcome = self._record_attempt(word == self.secret)
        if outcome.terminated:
            message = f"Correct! The word was {self.secret!r}."
        else:
            message = f"{word}: {marks}"
            if outcome.truncated:
                message += f" Out of guesses; the word was {self.secret!r}."
        return self._observation(message, marks, word, valid=True), outcome

    def _observation(
        self, message: str, feedback: str, guess: str | None, *, valid: bool
    ) -> GuessWordObservation:
        return GuessWordObservation(
            message=message,
            feedback=feedback,
            valid=valid,
            last_guess=guess,
            history=list(self.history),
            attempts_used=self.attempts,
            attempts_left=self.attempts_left,
            secret=self.secret if self.episode_over else None,
        )


__all__ = [
    "GuessNumberAction",
    "GuessNumberEnv",
    "GuessNumberObservation",
    "GuessWordAction",
    "GuessWordEnv",
    "GuessWordObservation",
    "score_guess",
]
