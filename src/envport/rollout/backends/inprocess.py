"""The in-process backend: environments live in the controller's own process.

An instance is only a name: each session a client opens on it builds a fresh
environment in this process (:class:`~envport.client.transports.InProcessTransport`),
so there is nothing to start, watch or stop. ``urls`` maps environment ids that are
already served elsewhere (``envport eval --serve-envs``, a server you started) to their
base URL; instances of those ids point there and are never stopped by this backend.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import ClassVar

from envport.rollout.backends.base import Backend, EnvInstance, EnvLaunch


class InProcessBackend(Backend):
    name: ClassVar[str] = "inprocess"

    def __init__(self, urls: Mapping[str, str] | None = None) -> None:
        self.urls = dict(urls or {})
        self._ids = itertools.count(1)
        self._live: dict[str, EnvInstance] = {}

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        instance = EnvInstance(
            instance_id=f"inprocess-{next(self._ids)}",
            backend=self.name,
            env_id=launch.env_id,
            url=self.urls.get(launch.env_id),
            labels=dict(launch.labels),
            start_latency_s=0.0,
        )
        self._live[instance.instance_id] = instance
        return instance

    async def healthy(self, instance: EnvInstance) -> bool:
        return instance.instance_id in self._live

    async def stop(self, instance: EnvInstance) -> None:
        self._live.pop(instance.instance_id, None)

    async def list(self, labels: Mapping[str, str] | None = None) -> list[EnvInstance]:
        want = dict(labels or {})
        return [
            i for i in self._live.values() if all(i.labels.get(k) == v for k, v in want.items())
        ]

    async def aclose(self) -> None:
        self._live.clear()
