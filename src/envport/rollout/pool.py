"""Warm pools of environment instances, one pool per environment type.

``EnvPool(backend, launch, size=4, max_episodes=100)`` keeps ``size`` instances started
ahead of demand and hands out *leases*, one session slot of one instance each::

    async with EnvPool(backend, EnvLaunch(env_id="echo-v1"), size=2) as pool:
        async with pool.lease(timeout_s=30) as lease:
            async with lease.instance.client() as env:
                await env.reset()

* **Slots.** An instance hosts ``launch.sessions`` sessions; a lease takes one. A lease
  prefers a started instance with a free slot, else starts a new one itself (its
  ``env_start_s`` says how long that took; 0 for a warm hit).
* **Backpressure.** With ``max_instances`` instances busy a lease waits for a slot,
  bounded by its ``timeout_s`` (``TimeoutError``), so a saturated backend slows the
  caller down instead of failing or over-committing.
* **Recycling.** An instance is retired after ``max_episodes`` leases, when a lease marks
  it bad (``lease.retire(reason)``: it hung or died under an attempt), or when a health
  check fails. Retired instances are stopped in the background by :meth:`maintain` so a
  retry never waits for an old server to shut down.
* **Maintenance.** :meth:`maintain` (run by the owner's task group, or by ``async with
  pool``) tops the pool up to ``size``, health-checks idle instances every
  ``health_interval_s`` and stops retired ones. :meth:`aclose` stops everything left. A
  warm start that failed is tried again ``health_interval_s`` later, not at once: a start
  that fails at once (an unknown environment) must not spin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from envport.errors import EnvportError
from envport.rollout.backends.base import Backend, EnvInstance, EnvLaunch

_log = logging.getLogger(__name__)


class PoolClosedError(EnvportError):
    """A lease was asked of a pool that is closed (or closed while the lease waited)."""


@dataclass
class _Slot:
    instance: EnvInstance
    leases: int = 0
    episodes: int = 0
    retiring: str | None = None
    lost: int = 0
    checked_at: float = field(default_factory=time.monotonic)


@dataclass
class Lease:
    """One session slot on one instance, held until the ``async with`` ends."""

    instance: EnvInstance
    env_start_s: float
    _retire: str | None = None
    _lost: bool = False

    def retire(self, reason: str) -> None:
        """Recycle the instance when this lease ends (it hung, died or misbehaved)."""
        self._retire = reason

    def lose_session(self) -> None:
        """This lease's session is beyond use (it hung) but the instance is healthy: keep
        the instance; it is recycled once half its sessions were lost this way."""
        self._lost = True


@dataclass(frozen=True)
class PoolStats:
    instances: int
    leased: int
    starting: int
    waiting: int
    started: int
    retired: int
    stop_failures: int = 0  # retired instances the backend failed to stop (logged)


class EnvPool:
    """Instances of one :class:`EnvLaunch` on one :class:`Backend`, leased by slot."""

    def __init__(
        self,
        backend: Backend,
        launch: EnvLaunch,
        *,
        size: int = 0,
        max_instances: int | None = None,
        max_episodes: int | None = None,
        health_interval_s: float = 10.0,
    ) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, not {size}")
        if max_instances is not None and max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, not {max_instances}")
        if max_episodes is not None and max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, not {max_episodes}")
        self.backend = backend
        self.launch = launch
        self.size = size
        self.max_instances = max_instances
        self.max_episodes = max_episodes
        self.health_interval_s = health_interval_s
        self._slots: dict[str, _Slot] = {}
        self._to_stop: list[EnvInstance] = []
        self._stopping: dict[str, EnvInstance] = {}
        self._starting = 0
        self._waiting = 0
        self._started = 0
        self._retired = 0
        self._stop_failures = 0
        self._warm_after = 0.0  # no warm start before this (monotonic): one just failed
        self._closed = False
        self._changed = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._maintainer: asyncio.Task[None] | None = None

    # --- bookkeeping (synchronous: no await between a check and its update) ----------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _count(self) -> int:
        return sum(1 for s in self._slots.values() if s.retiring is None) + self._starting

    def _pick(self) -> _Slot | None:
        best: _Slot | None = None
        for slot in self._slots.values():
            if slot.retiring is not None or slot.leases >= self.launch.sessions:
                continue
            if self.max_episodes is not None and slot.episodes + slot.leases >= self.max_episodes:
                continue
            if best is None or slot.leases < best.leases:
                best = slot
        return best

    def _retire_slot(self, slot: _Slot, reason: str) -> None:
        slot.retiring = slot.retiring or reason
        if slot.leases == 0 and self._slots.pop(slot.instance.instance_id, None) is not None:
            self._retired += 1
            self._to_stop.append(slot.instance)
        self._notify()

    def stats(self) -> PoolStats:
        return PoolStats(
            instances=len(self._slots),
            leased=sum(s.leases for s in self._slots.values()),
            starting=self._starting,
            waiting=self._waiting,
            started=self._started,
            retired=self._retired,
            stop_failures=self._stop_failures,
        )

    def adopt(self, instances: Iterable[EnvInstance]) -> int:
        """Take over instances a previous owner started (a restarted controller)."""
        n = 0
        for instance in instances:
            if instance.instance_id not in self._slots:
                self._slots[instance.instance_id] = _Slot(instance)
                n += 1
        self._notify()
        return n

    # --- leases -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, timeout_s: float | None = None) -> AsyncIterator[Lease]:
        """A slot on a healthy instance; waits (at most ``timeout_s``) when saturated."""
        async with asyncio.timeout(timeout_s):
            slot, started_s = await self._acquire()
        lease = Lease(slot.instance, started_s)
        try:
            yield lease
        finally:
            slot.leases -= 1
            slot.episodes += 1
            slot.lost += lease._lost
            if lease._retire is not None:
                self._retire_slot(slot, lease._retire)
            elif slot.lost and slot.lost >= max(1, self.launch.sessions // 2):
                self._retire_slot(slot, f"lost {slot.lost} sessions")
            elif self.max_episodes is not None and slot.episodes >= self.max_episodes:
                self._retire_slot(slot, f"served {slot.episodes} episodes")
            elif slot.retiring is not None:
                self._retire_slot(slot, slot.retiring)
            self._notify()

    async def _acquire(self) -> tuple[_Slot, float]:
        while True:
            if self._closed:
                raise PoolClosedError(f"the pool for {self.launch.env_id!r} is closed")
            slot = self._pick()
            if slot is not None:
                slot.leases += 1
                return slot, 0.0
            if self.max_instances is None or self._count() < self.max_instances:
                break
            changed = self._changed
            self._waiting += 1
            try:
                await changed.wait()
            finally:
                self._waiting -= 1
        self._starting += 1
        t0 = time.perf_counter()
        try:
            instance = await self.backend.start(self.launch)
        finally:
            self._starting -= 1
            self._notify()
        self._started += 1
        if self._closed:  # closed while it started: do not leak it
            await self._stop_late(instance)
            raise PoolClosedError(f"the pool for {self.launch.env_id!r} is closed")
        slot = _Slot(instance, leases=1)
        self._slots[instance.instance_id] = slot
        return slot, time.perf_counter() - t0

    # --- maintenance --------------------------------------------------------------------

    async def _warm_one(self) -> None:
        self._starting += 1
        try:
            instance = await self.backend.start(self.launch)
        except Exception:
            # Counted as not started; tried again a health interval later, not at once.
            self._warm_after = time.monotonic() + self.health_interval_s
            _log.debug("could not warm an instance of %s", self.launch.env_id, exc_info=True)
            return
        finally:
            self._starting -= 1
            self._notify()
        self._started += 1
        if self._closed:
            await self._stop_late(instance)
            return
        self._slots[instance.instance_id] = _Slot(instance)
        self._notify()

    async def _stop(self, instance: EnvInstance) -> None:
        """Stop a retired instance (already in ``_stopping``). A failure is logged and
        counted, never raised: it runs in the maintainer's task group, where it would
        cancel every rollout. Cancelled midway (the owner exits), the instance stays in
        ``_stopping``, so :meth:`aclose` stops it: the backend may have begun to forget
        it, and nothing else would."""
        try:
            await self.backend.stop(instance)
        except Exception:
            self._stop_failures += 1
            _log.warning(
                "could not stop retired instance %s (%s); it may need cleaning up by hand",
                instance.instance_id,
                instance.env_id,
                exc_info=True,
            )
        self._stopping.pop(instance.instance_id, None)

    async def _stop_late(self, instance: EnvInstance) -> None:
        """Stop an instance whose start ended after :meth:`aclose` ran: nothing else
        would (``aclose`` stopped what it found, and nothing reaps ``_to_stop`` once the
        pool is closed). Shielded: a cancelled caller still leaves it stopping."""
        self._retired += 1
        await asyncio.shield(self._stop(instance))  # logs a failure, never raises one

    async def _check(self, slot: _Slot) -> None:
        try:
            ok = await self.backend.healthy(slot.instance)
        except Exception:  # a check that cannot be made: not healthy (never raised)
            _log.warning("health check of %s failed", slot.instance.instance_id, exc_info=True)
            ok = False
        slot.checked_at = time.monotonic()
        if not ok and slot.instance.instance_id in self._slots:
            self._retire_slot(slot, "failed its health check")

    async def maintain(self) -> None:
        """Keep the pool warm, healthy and reaped; runs until cancelled."""
        async with asyncio.TaskGroup() as tg:
            while not self._closed:
                while self._to_stop:
                    # Out of ``_to_stop``, into ``_stopping`` in the same step: never in
                    # neither, where aclose would not see it.
                    instance = self._to_stop.pop()
                    self._stopping[instance.instance_id] = instance
                    tg.create_task(self._stop(instance))
                now = time.monotonic()
                if now >= self._warm_after:
                    for _ in range(self.size - self._count()):
                        tg.create_task(self._warm_one())
                for slot in list(self._slots.values()):
                    stale = now - slot.checked_at >= self.health_interval_s
                    if slot.retiring is None and slot.leases == 0 and stale:
                        slot.checked_at = now
                        tg.create_task(self._check(slot))
                changed = self._changed
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a
                # cancellation that lands as ``changed`` is set, and this loop (and its
                # owner's task group) would then never end.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.health_interval_s):
                        await changed.wait()

    async def aclose(self) -> None:
        """Stop every instance, leased or not; waiting leases get :class:`PoolClosedError`."""
        self._closed = True
        self._notify()
        instances = [s.instance for s in self._slots.values()]
        instances += self._to_stop + list(self._stopping.values())
        self._slots.clear()
        self._to_stop = []
        self._stopping.clear()
        results = await asyncio.gather(
            *(self.backend.stop(i) for i in instances), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def __aenter__(self) -> EnvPool:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._maintainer = self._tg.create_task(self.maintain())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._tg is not None
        assert self._maintainer is not None
        self._maintainer.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            await self.aclose()
