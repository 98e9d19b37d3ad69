"""Driving a coroutine that was begun outside ``await``.

envport runs some coroutines eagerly: it calls ``send(None)`` itself, and most of them
finish right there (a step of a fast environment), which saves a deadline timer or an
event-loop round trip. One that suspends instead has yielded the future it waits on;
:func:`resume` hands it to the awaiting task from that point. :func:`step_as` takes
such a first step from a callback, as a given task (the task then resumes the rest).
"""

from __future__ import annotations

import asyncio
import types

# What asyncio's own eager tasks (3.12+) use to run code as a given task; present in
# every CPython envport supports (3.11 on), though not public API.
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


def as_coroutine(awaitable: Awaitable[T]) -> Coroutine[Any, Any, T]:
    """``awaitable`` as a coroutine that can be stepped with ``send``: itself when it is
    one (an ``async def`` call, checked by type first: ``isinstance`` against the
    ``Coroutine`` ABC costs more than the rest of a relay's step), else wrapped."""
    if type(awaitable) is types.CoroutineType or isinstance(awaitable, Coroutine):
        return awaitable
    return _awaited(awaitable)


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


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


def step_as(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], call: Coroutine[Any, Any, T]
) -> tuple[bool, Any]:
    """Take ``call``'s first step as ``task`` would, right now (Python 3.12's eager tasks).

    ``task`` is the current task meanwhile, so ``asyncio.timeout``, ``current_task()``
    and cancellation behave as if it ran the step. Returns ``(True, result)`` when the
    call returned, ``(False, pending)`` when it waits on ``pending``: ``task`` carries on
    with ``await resume(call, pending)``. Raises what the step raised. Only from a
    callback (no task running: ``asyncio.current_task()`` is None).
    """
    _enter_task(loop, task)
    try:
        return False, call.send(None)
    except StopIteration as done:
        return True, done.value
    finally:
        _leave_task(loop, task)
