"""One way to run a local child process for the examples and benchmarks: :class:`Managed`.

Every server they start (``python -m server``, plain vLLM's OpenAI server, ``vllm-router``,
a throwaway ``redis-server``) is a :class:`Managed` subclass that says only which command to
run (:meth:`Managed.command`) and with which environment; the rest is shared:

- :meth:`Managed.start` runs the command from the repository root, its output appended to
  :attr:`Managed.log_path`, in a process group of its own; on Linux the child gets SIGTERM when
  the thread that started it dies. ``start(wait=False)`` only launches.
- :meth:`Managed.wait_healthy` waits until :meth:`Managed.healthy` (``GET <ready_path>``
  answers 200); if the process exits first, or stays unhealthy for ``start_timeout_s``, it
  stops it and raises the class's :class:`StartError` with the tail of the log.
- :meth:`Managed.stop` sends SIGTERM, then SIGKILL to the whole process group if it does not
  exit within ``stop_timeout_s``; :meth:`Managed.kill` is a crash (SIGKILL to the group).
- ``with`` starts and always stops; so does the end of the Python process (``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

__all__ = ["REPO_ROOT", "Managed", "StartError", "free_port", "log_tail", "metric_sum"]

REPO_ROOT = Path(__file__).resolve().parents[1]


class StartError(RuntimeError):
    """The child exited or stayed unhealthy while starting; the message holds the log's tail."""


def free_port() -> int:
    """A local TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log file (``""`` before it exists)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples ``name`` in ``text`` (a ``/metrics`` answer) whose labels
    include ``labels``; 0 when there is none yet."""
    total = 0.0
    for line in text.splitlines():
        found = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if found is None:
            continue
        given = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(given.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


def _die_with_parent() -> None:
    """In the child before exec, on Linux: get SIGTERM when the parent dies, so a killed
    script or notebook kernel leaves no server behind (``PR_SET_PDEATHSIG``)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_M = TypeVar("_M", bound="Managed")


class Managed:
    """A child process the helpers start and stop (see the module doc). Subclasses set
    ``port``, ``log_path``, ``env``, ``start_timeout_s``, ``stop_timeout_s`` and ``progress``
    and implement :meth:`command`; the class attributes below name what differs."""

    port: int
    log_path: Path
    env: dict[str, str]
    start_timeout_s: float
    stop_timeout_s: float
    progress: Callable[[str], None]
    progress_every_s: float | None = None
    """Seconds between "still starting" lines while waiting; ``None``: no such lines."""
    name = "the process"
    """How messages name the child."""
    ready_path = "/health"
    """What :meth:`healthy` asks for."""
    loading = "starting"
    """The "still starting" line's words."""
    unhealthy_hint = ""
    """Added to the message of a start that timed out."""
    start_error: type[StartError] = StartError
    _proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        """The child's environment: ``os.environ`` and ``env`` over it."""
        return {**os.environ, **self.env}

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:41234`` (``ChatKVCache`` wants ``url + "/v1"``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        """Whether ``GET <ready_path>`` answers 200 now."""
        try:
            return httpx.get(self.url + self.ready_path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self: _M, wait: bool = True) -> _M:
        """Launch the child and (with ``wait``) :meth:`wait_healthy`; a running one is left
        alone."""
        if self.running:
            return self
        cmd = self.command()
        self.progress(f"starting: {shlex.join([Path(cmd[0]).name, *cmd[1:]])}")
        self.progress(f"log: {self.log_path}")
        atexit.register(self.stop)  # a kernel or script that dies mid-way still stops it
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=self.child_env(), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self: _M) -> _M:
        """Wait until the started child is :meth:`healthy`; stop it and raise
        :attr:`start_error` if it exits first or stays unhealthy for ``start_timeout_s``."""
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
                raise self.start_error(
                    f"{self.name} exited with code {self._proc.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.progress(f"ready at {self.url} after {time.monotonic() - t0:.0f}s")
                return
            if self.progress_every_s and time.monotonic() - last >= self.progress_every_s:
                self.progress(f"{self.loading}... {time.monotonic() - t0:.0f}s")
                last = time.monotonic()
            time.sleep(0.25)
        raise self.start_error(
            f"{self.name} was not healthy after {self.start_timeout_s:.0f}s{self.unhealthy_hint}"
            f"; raise start_timeout_s or read {self.log_path}:\n{self.log_tail()}"
        )

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

    def kill(self) -> None:
        """Crash the child: SIGKILL to its process group (e.g. API server and engine core)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.progress(f"killed (SIGKILL to process group {proc.pid})")

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's log."""
        return log_tail(self.log_path, lines)

    def __enter__(self: _M) -> _M:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
