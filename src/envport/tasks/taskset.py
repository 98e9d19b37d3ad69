"""A taskset: a lazy, re-iterable collection of tasks.

A :class:`Taskset` wraps a *factory*, a zero-argument callable returning a fresh
iterable of tasks, so every ``for task in taskset`` reads the source again from the
start, and nothing is read until someone iterates. Operations (``head``, ``filter``,
``map``, ``shuffle``, ``split``) return new tasksets over the old one and stay lazy:
``head(5)`` of a million-line JSONL file reads five lines.

Order-dependent operations key on :attr:`Task.content_hash`, not on source order:

* ``shuffle(seed)`` sorts by ``sha256(seed, content hash)``: the same set of tasks gives
  the same order whatever order the source lists them in.
* ``split`` places each task by its own hash, so adding tasks never moves an existing task
  to another split, and tasks with identical content always land together. With
  ``exact=True`` split sizes are exact instead (the boundaries then depend on the set).

Python tasksets subclass :class:`Taskset` and override :meth:`Taskset.tasks`; they are
found through the ``envport.tasksets`` entry-point group (see :func:`envport.tasks.load`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import overload

from envport.tasks.errors import TaskNotFoundError
from envport.tasks.task import Task

TaskFactory = Callable[[], Iterable[Task]]


def _unit_interval(seed: int | str, content_hash: str) -> float:
    """A number in [0, 1) fixed by the seed and the task's content."""
    digest = hashlib.sha256(f"{seed}:{content_hash}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _shuffle_key(seed: int | str, task: Task) -> tuple[str, str]:
    digest = hashlib.sha256(f"{seed}:{task.content_hash}".encode()).hexdigest()
    return digest, task.id


class Taskset:
    """A lazy collection of :class:`Task`.

    ``source`` is a factory (called once per iteration) or a re-iterable collection such
    as a list. A one-shot iterator is refused: it could be read only once. Subclasses
    may instead override :meth:`tasks` (and call ``super().__init__(name=..., length=...)``
    to set a name or a known length).
    """

    name: str = ""
    _source: TaskFactory | Iterable[Task] | None = None
    _length: int | None = None
    _index: dict[str, Task] | None = None

    def __init__(
        self,
        source: TaskFactory | Iterable[Task] | None = None,
        *,
        name: str = "",
        length: int | None = None,
    ) -> None:
        if isinstance(source, Iterator):
            raise TypeError(
                "Taskset needs a re-iterable source (a list) or a factory that returns a "
                "fresh iterable (lambda: read_tasks()); a one-shot iterator was given."
            )
        if length is None and isinstance(source, Sized) and not callable(source):
            length = len(source)
        self._source = source
        self._length = length
        self.name = name or type(self).__name__
        self._index: dict[str, Task] | None = None

    # --- reading --------------------------------------------------------------------

    def tasks(self) -> Iterable[Task]:
        """A fresh iterable of the tasks. Subclasses override this."""
        if self._source is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no source: pass one to Taskset(...) "
                "or override tasks()."
            )
        if callable(self._source):
            return self._source()
        return self._source

    def __iter__(self) -> Iterator[Task]:
        for task in self.tasks():
            if not isinstance(task, Task):
                raise TypeError(f"Taskset {self.label!r} yielded {type(task).__name__}, not Task.")
            yield task

    @property
    def label(self) -> str:
        """``name``, or the class name when there is none."""
        return self.name or type(self).__name__

    @property
    def length(self) -> int | None:
        """The number of tasks when known without reading them, else ``None``."""
        return self._length

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(
                f"The length of taskset {self.label!r} is not known without reading it; "
                "use count()."
            )
        return self._length

    def __bool__(self) -> bool:
        if self._length is not None:
            return self._length > 0
        return next(iter(self), None) is not None

    def count(self) -> int:
        """The number of tasks, reading the source if the length is not known."""
        if self._length is not None:
            return self._length
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        size = "?" if self._length is None else str(self._length)
        return f"<Taskset {self.label!r} ({size} tasks)>"

    def get(self, task_id: str) -> Task:
        """The task with this id (the first, if ids repeat). Builds an index once."""
        if self._index is None:
            index: dict[str, Task] = {}
            for task in self:
                index.setdefault(task.id, task)
            self._index = index
        try:
            return self._index[task_id]
        except KeyError:
            raise TaskNotFoundError(task_id, self._index) from None

    def __contains__(self, task_id: object) -> bool:
        if not isinstance(task_id, str):
            return False
        try:
            self.get(task_id)
        except TaskNotFoundError:
            return False
        return True

    # --- derived tasksets -------------------------------------------------------------

    def _derive(self, factory: TaskFactory, suffix: str, length: int | None) -> Taskset:
        return Taskset(factory, name=f"{self.label}{suffix}", length=length)

    def head(self, n: int) -> Taskset:
        """The first ``n`` tasks; reads no further than that."""
        if n < 0:
            raise ValueError(f"head(n) needs n >= 0, got {n}")
        length = None if self._length is None else min(n, self._length)
        return self._derive(lambda: itertools.islice(self, n), f"[:{n}]", length)

    def filter(self, predicate: Callable[[Task], bool]) -> Taskset:
        """The tasks for which ``predicate`` is true, in order."""
        return self._derive(lambda: (t for t in self if predicate(t)), ".filter", None)

    def map(self, fn: Callable[[Task], Task]) -> Taskset:
        """Each task transformed by ``fn`` (e.g. ``lambda t: t.model_copy(update=...)``)."""
        return self._derive(lambda: (fn(t) for t in self), ".map", self._length)

    def shuffle(self, seed: int | str = 0) -> Taskset:
        """The tasks in an order fixed by ``seed`` and their content (see module doc).

        Reads the whole source when iterated.
        """
        return self._derive(
            lambda: sorted(self, key=lambda t: _shuffle_key(seed, t)),
            f".shuffle({seed!r})",
            self._length,
        )

    @overload
    def split(
        self, fractions: Mapping[str, float], *, seed: int | str = 0, exact: bool = False
    ) -> dict[str, Taskset]: ...

    @overload
    def split(
        self, fractions: Sequence[float], *, seed: int | str = 0, exact: bool = False
    ) -> tuple[Taskset, ...]: ...

    def split(
        self,
        fractions: Mapping[str, float] | Sequence[float],
        *,
        seed: int | str = 0,
        exact: bool = False,
    ) -> dict[str, Taskset] | tuple[Taskset, ...]:
        """Split by content hash: ``split({"train": 0.9, "test": 0.1})`` gives a dict,
        ``split([0.9, 0.1])`` a tuple. Fractions must be positive and sum to 1.

        By default each task's split depends only on its own hash and ``seed`` (sizes are
        close to the fractions, not exact). ``exact=True`` orders tasks as
        ``shuffle(seed)`` does and cuts at exact sizes (largest remainder rounding).
        """
        names: list[str] | None
        if isinstance(fractions, Mapping):
            names = list(fractions)
            values = [float(fractions[k]) for k in names]
        else:
            names = None
            values = [float(v) for v in fractions]
        if not values or any(not v > 0 for v in values) or not math.isclose(sum(values), 1.0):
            raise ValueError(f"split fractions must be positive and sum to 1, got {values!r}")
        bounds = [0.0, *itertools.accumulate(values)]
        bounds[-1] = 1.0
        labels = names or [str(i) for i in range(len(values))]

        def part(index: int) -> Taskset:
            lo, hi = bounds[index], bounds[index + 1]

            def by_hash() -> Iterator[Task]:
                return (t for t in self if lo <= _unit_interval(seed, t.content_hash) < hi)

            def by_size() -> list[Task]:
                return self._exact_part(values, index, seed)

            return self._derive(by_size if exact else by_hash, f".split[{labels[index]}]", None)

        parts = [part(i) for i in range(len(values))]
        if names is not None:
            return dict(zip(names, parts, strict=True))
        return tuple(parts)

    def _exact_part(self, fractions: list[float], index: int, seed: int | str) -> list[Task]:
        ordered = sorted(self, key=lambda t: _shuffle_key(seed, t))
        sizes = _largest_remainder(fractions, len(ordered))
        start = sum(sizes[:index])
        return ordered[start : start + sizes[index]]


def _largest_remainder(fractions: list[float], total: int) -> list[int]:
    """Integer sizes summing to ``total``, as close to ``fractions * total`` as can be."""
    raw = [f * total for f in fractions]
    sizes = [math.floor(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - sizes[i]), i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes
