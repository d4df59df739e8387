"""The server process: clean SIGTERM shutdown, and exit when its engine core dies."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

import psutil
import pytest

from tests.integration.conftest import USERS_PROCESSES

if TYPE_CHECKING:
    from tests.integration.conftest import ServerFactory

pytestmark = pytest.mark.vllm


def test_engine_death_stops_the_server_then_sigterm_path_is_clean(
    start_server: ServerFactory,
) -> None:
    server = start_server("--no-kv-offload", env=USERS_PROCESSES)  # the processes users run
    assert server.proc is not None
    api = psutil.Process(server.proc.pid)
    engines = [p for p in api.children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]
    engines = engines or api.children()
    assert engines
    for p in engines:
        os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.proc.poll() is not None, "the API server kept running without its engine"

    server.start()  # same port and cache folder
    assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it handled
