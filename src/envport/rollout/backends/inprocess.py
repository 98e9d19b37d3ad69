"""The in-process backend: environments live in the controller's own process.

An instance is only a name: each session a client opens on it builds a fresh
environment in this process (:class:`~envport.client.transports.InProcessTransport`)
with the launch's ``options`` as keyword arguments, so there is nothing to start, watch
or stop. ``urls`` maps environment ids that are already served elsewhere (``envport eval
--serve-envs``, a server you started) to their base URL; instances of those ids point
there and are never stopped by this backend. Such a server was built with its own
arguments, so a launch that asks for options there is refused rather than silently
run without them; its ``workspace_roots`` are that server's operator's to grant too
(``envport eval --serve-envs`` grants its tasks' directories to the servers it starts).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field

from envport.client import EnvClient
from envport.client.transports import InProcessTransport
from envport.rollout.backends.base import Backend, BackendError, EnvInstance, EnvLaunch


class InProcessInstance(EnvInstance):
    """An instance whose sessions are environments built here, with ``options``."""

    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for each environment."
    )

    def client(self, *, timeout_s: float = 60.0) -> EnvClient:
        if self.url is not None:
            return super().client(timeout_s=timeout_s)
        return EnvClient(
            InProcessTransport(self.env_id, call_timeout_s=timeout_s, options=self.options)
        )


class InProcessBackend(Backend):
    name: ClassVar[str] = "inprocess"

    def __init__(self, urls: Mapping[str, str] | None = None) -> None:
        self.urls = dict(urls or {})
        self._ids = itertools.count(1)
        self._live: dict[str, EnvInstance] = {}

    async def start(self, launch: EnvLaunch) -> EnvInstance:
        url = self.urls.get(launch.env_id)
        if url is not None and launch.options:
            raise BackendError(
                f"{launch.env_id} is served at {url}, which was started with its own "
                f"arguments; the options {sorted(launch.options)} cannot be applied there. "
                "Drop them, or run that environment in-process (no url)."
            )
        instance = InProcessInstance(
            instance_id=f"inprocess-{next(self._ids)}",
            backend=self.name,
            env_id=launch.env_id,
            url=url,
            labels=dict(launch.labels),
            start_latency_s=0.0,
            options=launch.env_kwargs(),
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
