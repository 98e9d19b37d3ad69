"""Driving a coroutine that was begun outside ``await``.

envport runs some coroutines eagerly: it calls ``send(None)`` itself, and most of them
finish right there (a step of a fast environment), which saves a deadline timer or an
event-loop round trip. One that suspends instead has yielded the future it waits on;
:func:`resume` hands it to the awaiting task from that point.
"""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


@types.coroutine
def resume(
    call: Coroutine[Any, Any, T], pending: Any, *, throw: BaseException | None = None
) -> Generator[Any, Any, T]:
    """Await ``call``, which already ran up to a suspension where it yielded ``pending``.

    What ``await`` does for a fresh coroutine, picked up after its first ``send``: the
    task's values and exceptions (a cancellation) go into ``call`` until it returns.
    ``throw``, if given, is thrown into ``call`` first (``pending`` is then unused).
    """
    try:
        if throw is not None:
            pending = call.throw(throw)
        while True:
            try:
                value = yield pending
            except GeneratorExit:
                call.close()
                raise
            except BaseException as exc:  # thrown in by the task (a cancellation)
                pending = call.throw(exc)
            else:
                pending = call.send(value)
    except StopIteration as done:
        result: T = done.value
        return result
