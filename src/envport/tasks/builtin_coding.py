"""``builtin:coding``: small repositories with one bug each, fixed in ``sandbox-v1``.

Each task ships a tiny repository in the environment's reset options (``files``): a
Python module with one wrong line and a test script that imports it and exits non-zero
on a failed check. The prompt is a code review note naming the file, the wrong line and
the line it should be, and the command that runs the tests. The task is scored by a
``test_command`` rubric: the test script runs *inside* the sandbox after the agent is
done (1.0 for exit status 0, else 0.0), so the reward comes from the repository's own
tests, not from comparing text.

The tasks are generated from a fixed table, in a fixed order: the same ids, files and
prompts every time. The note makes them easy on purpose: they exercise the sandbox, the
tools and the controller (read a file, write the fix, run the tests), not a model's
skill. envport's scripted stand-in solves them by rule (see
:mod:`envport.policy.scripted`).
"""

from __future__ import annotations

from dataclasses import dataclass

from envport.tasks.task import RubricSpec, Task
from envport.tasks.taskset import Taskset

ENV_ID = "sandbox-v1"
#: Steps an agent may take in one episode: read, write, test, finish. sandbox-v1 ends an
#: episode only by this truncation (a text reply is run as a command, not an end).
MAX_STEPS = 4


@dataclass(frozen=True)
class _Bug:
    name: str
    function: str
    code: str  # the correct module; ``good`` occurs in it exactly once
    good: str
    bad: str
    checks: tuple[str, ...]  # expressions over the function that must be true


_BUGS: tuple[_Bug, ...] = (
    _Bug("add", "add", "def add(a, b):\n    return a + b\n", "a + b", "a - b",
         ("add(2, 3) == 5", "add(-1, 1) == 0")),
    _Bug("parity", "is_even", "def is_even(n):\n    return n % 2 == 0\n", "== 0", "== 1",
         ("is_even(4)", "not is_even(7)")),
    _Bug("clamp", "clamp", "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n",
         "max(lo, min(hi, x))", "min(lo, max(hi, x))",
         ("clamp(5, 0, 3) == 3", "clamp(-2, 0, 3) == 0", "clamp(2, 0, 3) == 2")),
    _Bug("factorial", "factorial",
         "def factorial(n):\n    out = 1\n    for i in range(1, n + 1):\n        out *= i\n"
         "    return out\n", "range(1, n + 1)", "range(1, n)",
         ("factorial(0) == 1", "factorial(5) == 120")),
    _Bug("vowels", "count_vowels",
         "def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in \"aeiou\")\n",
         '"aeiou"', '"aeiu"', ("count_vowels('Oregano') == 4", "count_vowels('xyz') == 0")),
    _Bug("reverse", "reverse", "def reverse(s):\n    return s[::-1]\n", "s[::-1]", "s[::1]",
         ("reverse('abc') == 'cba'", "reverse('') == ''")),
    _Bug("mean", "mean", "def mean(xs):\n    return sum(xs) / len(xs)\n",
         "sum(xs) / len(xs)", "sum(xs) / (len(xs) + 1)", ("mean([1, 2, 3]) == 2",)),
    _Bug("last", "last", "def last(xs):\n    return xs[-1]\n", "xs[-1]", "xs[-2]",
         ("last([1, 2, 3]) == 3", "last([9]) == 9")),
    _Bug("ordered", "is_sorted",
         "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n",
         "a <= b", "a < b", ("is_sorted([1, 1, 2])", "not is_sorted([2, 1])")),
    _Bug("words", "word_count", "def word_count(text):\n    return len(text.split())\n",
         "text.split()", 'text.split(",")',
         ("word_count('a b  c') == 3", "word_count('') == 0")),
    _Bug("largest", "largest",
         "def largest(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n"
         "            best = x\n    return best\n", "best = xs[0]", "best = 0",
         ("largest([-5, -2, -9]) == -2", "largest([1, 7, 3]) == 7")),
    _Bug("fahrenheit", "to_fahrenheit", "def to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
         "c * 9 / 5 + 32", "c * 9 / 5 - 32",
         ("to_fahrenheit(100) == 212", "to_fahrenheit(0) == 32")),
)  # fmt: skip


def _test_script(bug: _Bug) -> str:
    lines = [f"from {bug.name} import {bug.function}", "", "failed = 0"]
    for check in bug.checks:
        lines += [
            f"if not ({check}):",
            f"    print('FAIL: {check.replace(chr(39), chr(92) + chr(39))}')",
            "    failed += 1",
        ]
    lines += [
        f"print(f'{{{len(bug.checks)} - failed}}/{len(bug.checks)} checks passed')",
        "raise SystemExit(1 if failed else 0)",
        "",
    ]
    return "\n".join(lines)


def coding_task(index: int, bug: _Bug) -> Task:
    """Task ``index`` of the taskset, made from ``bug``."""
    module, tests = f"{bug.name}.py", f"test_{bug.name}.py"
    buggy = bug.code.replace(bug.good, bug.bad, 1)
    command = f"python3 {tests}"
    prompt = (
        f"The tests of this repository fail. A reviewer's note on `{module}`: the code "
        f"`{bug.bad}` should be `{bug.good}`. Fix `{module}`, then run `{command}` to check "
        "that the tests pass."
    )
    return Task(
        id=f"coding-{index:02d}-{bug.name}",
        prompt=prompt,
        env_id=ENV_ID,
        env_options={
            "files": {module: buggy, tests: _test_script(bug)},
            "max_steps": MAX_STEPS,
        },
        answer=bug.good,
        rubric=(RubricSpec(type="test_command", params={"command": command, "timeout_s": 30}),),
        metadata={"file": module, "function": bug.function, "tests": tests},
    )


def taskset() -> Taskset:
    """The ``builtin:coding`` taskset (12 tasks, always the same)."""
    tasks = [coding_task(i, bug) for i, bug in enumerate(_BUGS)]
    return Taskset(tasks, name="coding", length=len(tasks))
