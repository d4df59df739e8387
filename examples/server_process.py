"""Run the bundled server (``python -m server``) as a child process, for examples and notebooks.

```python
from examples.server_process import ServerProcess

with ServerProcess(cache_dir=tmp, flags=["--max-model-len", "4096"]) as server:
    model = ChatKVCache(base_url=server.url + "/v1")
    ...
    server.restart()  # same port, same cache dir: sessions and their KV survive
```

- The server listens on a free local port; :attr:`ServerProcess.url` is its root URL.
- :meth:`ServerProcess.start` waits for ``GET /health`` to answer 200 and prints a progress line
  every ``progress_every_s`` seconds; if the process exits first it raises
  :class:`ServerStartError` with the tail of the server log.
- :meth:`ServerProcess.stop` sends SIGTERM (the server's clean shutdown: it finishes writing
  KV blocks to disk), then SIGKILL to the whole process group if it hangs.
- :meth:`ServerProcess.restart` stops and starts again on the same port and cache dir.
- :meth:`ServerProcess.kill` is a crash: SIGKILL to the server's whole process group (the API
  server and vLLM's engine core), no clean shutdown.
- ``start(wait=False)`` only launches; :meth:`ServerProcess.wait_healthy` waits. Several
  servers start at once that way, all launched from the calling thread (see below).
- Leaving the ``with`` block stops the server, also when the block raised; so does the end of
  the Python process (``atexit``), e.g. a notebook kernel shut down after a failed cell. On
  Linux the server also gets SIGTERM when the thread that started it dies (a killed kernel),
  so call :meth:`ServerProcess.start` from a thread that lives as long as the server.

The server's output goes to ``<log_dir>/server.log`` (a temp folder by default), never to
the caller's terminal.

Comparisons (the benchmarks, ``make demo``) give every server the same CPU cores:
:func:`equal_cores_env` is the environment to start each with, :func:`omp_cores` reads back from a
server's log which cores its engine's OpenMP threads got. Left alone, vLLM's CPU backend reserves
one core for its scheduler process without a KV connector and none with one on a 2-core machine
(a connector asks for a second reserved core, which exceeds the cores, so vLLM reserves none).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import httpx

__all__ = [
    "RESERVED_CPUS",
    "Managed",
    "ServerProcess",
    "ServerStartError",
    "equal_cores_env",
    "free_port",
    "locate_model",
    "log_tail",
    "omp_cores",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment defaults for the child (a variable already set in ``os.environ`` wins)."""
RESERVED_CPUS = 0
"""``VLLM_CPU_NUM_OF_RESERVED_CPU`` of :func:`equal_cores_env`: on a 2-core machine reserving one
core for vLLM's scheduler process halves the OpenMP threads of the forward pass."""


def equal_cores_env(reserved: int = RESERVED_CPUS) -> dict[str, str]:
    """Environment that gives every vLLM server (plain or with a KV connector) the same OpenMP
    cores on CPU: vLLM's automatic binding and the same explicit reservation. Give it to every
    server of a comparison; it beats ``os.environ``."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}


def omp_cores(log: Path | str) -> str:
    """Which cores a vLLM CPU engine bound its OpenMP threads to, from the last "OpenMP thread
    binding info" lines of its log (``vllm/utils/ompmultiprocessing.py``), e.g.
    ``OMP core ids [0, 1], reserved [] (bind 'auto', reserve_cpu_num=0)``."""
    text = Path(log).read_text(errors="replace") if Path(log).is_file() else ""
    start = text.rfind("OpenMP thread binding info")
    if start < 0:
        return "(no OpenMP binding line in the log)"
    block = text[start : start + 2000]

    def field(pattern: str) -> str:
        found = re.search(pattern, block)
        return found.group(1) if found else "?"

    bind = field(r"VLLM_CPU_OMP_THREADS_BIND=('[^']*')")
    if bind == "'nobind'":
        return f"unbound (bind 'nobind'): OpenMP threads float over all {os.cpu_count()} cores"
    cores = " | ".join(re.findall(r"core ids=(\[[^\]]*\])", block)) or "[]"
    reserved, num = field(r"reserved_cpus=(\[[^\]]*\])"), field(r"reserve_cpu_num=(\d+)")
    return f"OMP core ids {cores}, reserved {reserved} (bind {bind}, reserve_cpu_num={num})"


def _die_with_parent() -> None:
    """In the child before exec, on Linux: get SIGTERM when the parent dies, so a killed
    script or notebook kernel leaves no server behind (``PR_SET_PDEATHSIG``)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log file (``""`` before it exists)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


_M = TypeVar("_M", bound="Managed")


class Managed:
    """A child process the helpers start and stop: ``with`` support (enter starts, exit
    stops, always), its URL, and one way of stopping it (SIGTERM, then SIGKILL of its
    process group). Subclasses set ``port``, ``log_path``, ``stop_timeout_s`` and
    ``progress``, and implement :meth:`start`, which puts the child in ``_proc``."""

    port: int
    log_path: Path
    stop_timeout_s: float
    progress: Callable[[str], None]
    _proc: subprocess.Popen[bytes] | None = None

    def start(self: _M) -> _M:
        raise NotImplementedError

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:41234`` (``ChatKVCache`` wants ``url + "/v1"``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM and wait (clean shutdown), SIGKILL of the process group if it hangs.

        Returns the exit code (``None`` if it was not running). A clean stop reads 0 or -15
        (uvicorn re-raises the SIGTERM it handled).
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        atexit.unregister(self.stop)
        if proc.poll() is None:
            self.progress("stopping...")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.progress(f"no exit after {self.stop_timeout_s:.0f}s: SIGKILL")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            clean = proc.returncode in (0, -signal.SIGTERM)
            self.progress("stopped cleanly" if clean else f"exited with {proc.returncode}")
        return proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's log."""
        return log_tail(self.log_path, lines)

    def __enter__(self: _M) -> _M:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy while starting; the message holds the log's tail."""


def say(msg: str) -> None:
    """Default progress printer."""
    print(f"[server] {msg}", flush=True)


def free_port() -> int:
    """A local TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def locate_model(progress: Callable[[str], None] = say) -> Path:
    """The default model folder (SmolLM2-135M-Instruct), built from the offline GGUF once."""
    from server.model import build_default_model, default_model_dir

    if not (default_model_dir() / "config.json").is_file():
        progress(f"building the default model into {default_model_dir()} (once, ~1 minute)...")
    return build_default_model()


class ServerProcess(Managed):
    """One ``python -m server`` child process on a free port (see the module doc)."""

    def __init__(
        self,
        cache_dir: Path | str | None = None,
        flags: Sequence[str] = (),
        *,
        model: Path | str | None = None,
        port: int | None = None,
        log_dir: Path | str | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 60.0,
        progress_every_s: float = 10.0,
        progress: Callable[[str], None] = say,
    ) -> None:
        """Describe the server; nothing starts until :meth:`start` (or ``with``).

        Args:
            cache_dir: the server's ``--cache-dir`` (session registry and KV block files);
                ``None``: a new temp folder, kept across :meth:`restart`.
            flags: further ``python -m server`` flags (ours and vLLM's), e.g.
                ``["--max-model-len", "4096", "--kv-cache-memory-bytes", "256MiB"]``.
            model: model folder, served under its path; ``None``: the default SmolLM2 folder
                (built if missing), served as ``SmolLM2-135M-Instruct``.
            port: TCP port; ``None``: a free one.
            log_dir: folder of ``server.log``; ``None``: a new temp folder.
            env: environment variables for the child that beat ``os.environ``, e.g.
                :func:`equal_cores_env` for a comparison.
            start_timeout_s: how long :meth:`start` waits for ``/health``.
            stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
            progress_every_s: seconds between "still loading" lines while starting.
            progress: where progress lines go (``print`` with a ``[server]`` prefix).
        """
        self.cache_dir = Path(cache_dir or tempfile.mkdtemp(prefix="lgkv-cache-"))
        self.flags = list(flags)
        self.model = Path(model) if model is not None else None
        self.port = port or free_port()
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="lgkv-log-")) / "server.log"
        self.env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.progress_every_s = progress_every_s
        self.progress = progress
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def model_name(self) -> str:
        """The served model name (``GET /v1/models``), what ``ChatKVCache(model=...)`` sends."""
        return str(httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"])

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        if self.model is None:
            locate_model(self.progress)  # the server serves it as "SmolLM2-135M-Instruct"
            model_flags = []
        else:
            model_flags = ["--model", str(self.model)]
        return [
            sys.executable, "-m", "server", "serve", *model_flags,
            "--port", str(self.port), "--cache-dir", str(self.cache_dir), *self.flags,
        ]  # fmt: skip

    def start(self, wait: bool = True) -> ServerProcess:
        """Start the server and (with ``wait``) wait until ``/health`` answers 200.

        Raises:
            ServerStartError: the process exited, or was not healthy after ``start_timeout_s``
                (the process is stopped first); the message holds the log's last lines.
        """
        if self.running:
            return self
        cmd = self.command()
        env = {**SERVER_ENV, **os.environ, **self.env}
        self.progress(f"starting: python {' '.join(cmd[1:])}")
        self.progress(f"log: {self.log_path}")
        atexit.register(self.stop)  # a kernel or script that dies mid-way still stops it
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self) -> ServerProcess:
        """Wait until the started server's ``/health`` answers 200 (see :meth:`start`); stop
        it and raise :class:`ServerStartError` if it exits or stays unhealthy."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        t0 = last = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout_s:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"the server exited with code {self._proc.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.progress(f"ready at {self.url} after {time.monotonic() - t0:.0f}s")
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - last >= self.progress_every_s:
                self.progress(f"loading the engine... {time.monotonic() - t0:.0f}s")
                last = time.monotonic()
            time.sleep(0.25)
        raise ServerStartError(
            f"the server was not healthy after {self.start_timeout_s:.0f}s; raise "
            f"start_timeout_s or read {self.log_path}:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """Crash the server: SIGKILL to its process group (API server and engine core)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.progress(f"killed (SIGKILL to process group {proc.pid})")

    def restart(self) -> ServerProcess:
        """Stop, then start again on the same port and cache dir."""
        self.stop()
        return self.start()

    def omp_cores(self) -> str:
        """The cores its engine bound OpenMP threads to, from its log (:func:`omp_cores`)."""
        return omp_cores(self.log_path)
