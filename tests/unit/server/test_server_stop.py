"""Stopping and crashing: a graceful stop by default; shared memory a killed process group
left is reclaimed at the next start, a live owner's is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server import shm

CHILD = """
import sys, time
from multiprocessing import shared_memory
from server.shm import record_segments
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
seg.buf[0] = 1
record_segments(sys.argv[1])
print(seg.name, flush=True)
time.sleep(600)
"""

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


def start_owner(cache_dir: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cache_dir)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def kill_group(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the owner and its resource tracker
    proc.wait()
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def test_kill9_leaves_a_segment_that_the_next_start_reclaims(tmp_path: Path) -> None:
    dead, dead_name = start_owner(tmp_path)
    live, live_name = start_owner(tmp_path)
    try:
        kill_group(dead)
        assert (shm.SHM_DIR / dead_name).exists()  # nothing else would ever remove it
        freed, nbytes = shm.reclaim_segments(tmp_path)
        assert (freed, nbytes >= 1 << 20) == (1, True)
        assert not (shm.SHM_DIR / dead_name).exists()
        assert (shm.SHM_DIR / live_name).exists()  # a running owner's segment stays
        assert [p.stem for p in (tmp_path / shm.RECORD_DIR).glob("*.json")] == [str(live.pid)]
        assert shm.reclaim_segments(tmp_path) == (0, 0)
    finally:
        kill_group(live)
        (shm.SHM_DIR / live_name).unlink(missing_ok=True)
        (shm.SHM_DIR / dead_name).unlink(missing_ok=True)


def test_graceful_stop_is_the_default_unless_a_timeout_is_given(tiny_model_dir: Path) -> None:
    from server.config import ServerConfig
    from server.engine import SHUTDOWN_TIMEOUT_S, vllm_argv

    argv = vllm_argv(ServerConfig(model=str(tiny_model_dir)))
    assert argv[argv.index("--shutdown-timeout") + 1] == str(SHUTDOWN_TIMEOUT_S)
    given = vllm_argv(ServerConfig(model=str(tiny_model_dir), vllm_args=("--shutdown-timeout=5",)))
    assert "--shutdown-timeout" not in given and given[-1] == "--shutdown-timeout=5"
