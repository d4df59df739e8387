"""One ``python -m server`` of ``benchmarks/faults.py`` in its own process group, and the
kills (SIGKILL of the whole group: API server, engine core, workers, resource tracker).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from examples.managed import free_port

ROOT = Path(__file__).resolve().parents[1]

ENGINE_ARGS: tuple[str, ...] = (
    "--kv-cache-memory-bytes", "128MiB",
    "--max-model-len", "2048",
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--kv-ram-bytes", "256MiB",
    "--kv-disk-bytes", "1GiB",
)  # fmt: skip


@dataclass
class Server:
    """One ``python -m server`` in its own process group; restarts keep port and folders."""

    model_dir: Path
    cache_dir: Path
    log_path: Path
    args: Sequence[str] = ENGINE_ARGS
    model: str = "tiny-llama"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        cmd = [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.model,
            "--cache-dir",
            str(self.cache_dir),
            *self.args,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {' '.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        kill_server(self)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, as a supervisor stops it; SIGKILL of the group if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None


def kill_server(server: Server) -> None:
    """SIGKILL of the server's whole process group (API, engine core, workers, resource
    tracker). Takes any object with ``proc`` (this module's ``Server``, the tests' one)."""
    proc, server.proc = server.proc, None
    if proc is not None:
        kill_group(proc)


def log_text(server: Server) -> str:
    return server.log_path.read_text(errors="replace")


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group and wait until every member is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
