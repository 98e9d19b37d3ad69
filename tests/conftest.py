from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import openenv_echo_argv, server_process

# openenv-core imports gradio (about 6 s of CPU, in every test process that imports
# openenv) only for its web interface, and leaves that out when gradio cannot be
# imported. No test uses it (tests/support/openenv_echo_server.py does the same).
sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def openenv_echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """OpenEnv's own server (openenv-core) serving an echo env, in a subprocess."""
    log: Path = tmp_path_factory.mktemp("openenv") / "server.log"
    with server_process([*openenv_echo_argv(), "--max-concurrent-envs", "64"], log) as url:
        yield url


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module (``pytestmark = usefixtures(...)``): the tiny
    models gain nothing from more, and the tests' servers keep the other core."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
