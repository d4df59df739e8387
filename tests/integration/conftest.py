"""A real server for integration tests: ``python -m server`` as a subprocess on a free port.

Fixtures (session-scoped: one server per test session, shared by every folder below):

* ``lgkv_server`` -> :class:`ServerProcess`: the tiny random Llama behind the full server with
  the session KV connector, its own cache folder, vLLM's engine core in a child process that
  also runs the model (:data:`ONE_ENGINE_PROCESS`). ``.base_url``, ``.model`` (the served name),
  ``.cache_dir``, ``.restart()`` (same port and cache folder: sessions must survive it),
  ``.log_tail()``.
* ``server_url`` -> ``str``: ``lgkv_server.base_url``.
* ``start_server`` -> a factory for other configurations (``--no-kv-offload``, ``--api-key``,
  SmolLM2...); servers it starts stop at the end of the test module. Start few: each is a vLLM
  engine (about 15 s and a few hundred MiB).

``ServerProcess.restart()`` is for tests that check persistence; a test that restarts the shared
server must leave it running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import ENGINE_THREADS

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0

ONE_ENGINE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": ENGINE_THREADS}
"""The test servers' default process layout: the API server and one engine process that runs
the scheduler and the model (vLLM's ``uni`` executor), with the cores of this pytest worker
(:data:`tests.conftest.ENGINE_THREADS`). With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (what
``python -m server`` users run) vLLM's CPU platform turns ``uni`` into its ``mp`` executor, a
third process that imports vLLM again: 9 s more per start and 1.5 s more per stop on the 2-core
machine, for the same engine. The connector's metadata then crosses a process boundary
(pickled): the crash tests of ``test_server_faults.py`` and the engine-death test start their
servers with :data:`USERS_PROCESSES` (with the same threads); the tensor-parallel and the
cross-process prefetch tests run that layout in engines of their own."""
USERS_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
"""The layout ``python -m server`` runs by default: API server, engine core, model worker."""

# Small, fast engine settings for the 2-core test machine.
TEST_ENGINE_ARGS: tuple[str, ...] = (
    "--kv-cache-memory-bytes", "128MiB",
    "--max-model-len", "2048",
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--distributed-executor-backend", "uni",
    "--kv-ram-bytes", "256MiB",
    "--kv-disk-bytes", "1GiB",
)  # fmt: skip


def wait_until(check: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``check`` every 0.1 s until it is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """The server could not bind its port: another process took it after it was picked."""


@dataclass
class ServerProcess:
    """One ``python -m server`` subprocess; start/stop/restart keep port and cache folder."""

    model_dir: Path
    model: str
    cache_dir: Path
    log_path: Path
    args: Sequence[str] = ()
    api_key: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (append ``/v1`` for OpenAI clients)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header when the server has an API key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def command(self) -> list[str]:
        """The command line this server runs."""
        cmd = [sys.executable, "-m", "server", "serve", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", self.model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--cache-dir", str(self.cache_dir), *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the process and wait until ``/health`` answers 200. On a first start whose
        port another process took since it was picked (two test workers start servers at
        once), start again on another port."""
        first = self.proc is None
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except PortTaken:
                if not first or attempt == 2:
                    raise
                self.port = free_port()

    def _start_once(self, timeout: float) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        env = {**os.environ, **ONE_ENGINE_PROCESS, **self.env}
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {' '.join(self.command())}\n".encode())
            self.proc = subprocess.Popen(
                self.command(), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                error = (
                    PortTaken
                    if "address already in use" in tail.rsplit("=== start", 1)[-1]
                    else RuntimeError
                )
                raise error(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (clean shutdown of the app and engine), SIGKILL of its group if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and its engine
            return proc.wait(timeout=10)
        finally:
            _reap_group(proc.pid)

    def restart(self) -> None:
        """Stop and start again on the same port and cache folder."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 60) -> str:
        """The end of the server's log (stdout and stderr)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def client(self, **kwargs: object) -> httpx.Client:
        """An httpx client on the base URL, with the API key when there is one."""
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=120.0, **kwargs)


def _reap_group(pgid: int) -> None:
    """Kill what is left of the server's own process group (an orphaned engine core)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


ServerFactory = Callable[..., ServerProcess]


@pytest.fixture(scope="session")
def server_model_dir(tiny_model_dir: Path) -> Path:
    """The random tiny Llama the test servers load (head size 32: vLLM's CPU minimum)."""
    return tiny_model_dir


class ServerStarter:
    """Starts servers (tiny model and :data:`TEST_ENGINE_ARGS` by default) and stops them all
    at once in :meth:`stop_all`. Call it as ``start(*args, model_dir=None, model=None,
    api_key=None, env=None, cache_dir=None, engine_args=TEST_ENGINE_ARGS)``."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> None:
        self._tmp = tmp_path_factory
        self._model_dir = model_dir
        self._started: list[ServerProcess] = []

    def __call__(
        self,
        *args: str,
        model_dir: Path | None = None,
        model: str | None = None,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        cache_dir: Path | None = None,
        engine_args: Sequence[str] = TEST_ENGINE_ARGS,
    ) -> ServerProcess:
        root = self._tmp.mktemp("server")
        server = ServerProcess(
            model_dir=model_dir or self._model_dir,
            model=model or TINY_MODEL_NAME,
            cache_dir=cache_dir or root / "cache",
            log_path=root / "server.log",
            args=[*engine_args, *args],
            api_key=api_key,
            env=dict(env or {}),
        )
        self._started.append(server)
        server.start()
        return server

    def stop_all(self) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(self._started))) as pool:
            list(pool.map(ServerProcess.stop, self._started))  # all at once, not one by one
        self._started.clear()


@pytest.fixture(scope="session")
def _shared_servers(
    tmp_path_factory: pytest.TempPathFactory, server_model_dir: Path
) -> Iterator[ServerStarter]:
    """Starts the servers shared by the whole test session (below); stops them at its end."""
    starter = ServerStarter(tmp_path_factory, server_model_dir)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="module")
def start_server(
    tmp_path_factory: pytest.TempPathFactory, server_model_dir: Path
) -> Iterator[ServerFactory]:
    """A :class:`ServerStarter` for one test module: its servers stop when the module ends, so
    a test process holds at most the shared servers and one module's own (each is a vLLM
    engine of 2 to 3 GB of RAM in three processes)."""
    starter = ServerStarter(tmp_path_factory, server_model_dir)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="session")
def lgkv_server(_shared_servers: ServerStarter) -> ServerProcess:
    """The shared tiny-model server with the session KV connector (see the module doc)."""
    return _shared_servers()


@pytest.fixture(scope="session")
def plain_server(_shared_servers: ServerStarter) -> ServerProcess:
    """A cache-off server (``--no-kv-offload --no-enable-prefix-caching``: every prompt
    recomputed), shared by the tests that compare answers with plain recompute or check what
    the session API says without the connector."""
    return _shared_servers("--no-kv-offload", "--no-enable-prefix-caching")


@pytest.fixture(scope="session")
def server_url(lgkv_server: ServerProcess) -> str:
    """Base URL of the shared server, e.g. ``http://127.0.0.1:43123``."""
    return lgkv_server.base_url


SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_ENGINE_ARGS: tuple[str, ...] = (
    *TEST_ENGINE_ARGS,
    "--block-size", "32",
    "--trust-request-chat-template",
)  # fmt: skip
"""The test engine settings with 32-token KV blocks: a turn's cached share is then never more
than 31 tokens short of its whole prefix (128-token blocks would leave up to 127 uncached).
Requests may bring their own chat template (a reasoning model's, in test_reasoning_reuse.py)."""


@pytest.fixture(scope="session")
def smollm2_server(_shared_servers: ServerStarter, smollm2_dir: Path) -> ServerProcess:
    """The default model (SmolLM2-135M-Instruct) behind the full server, shared by the tests that
    need a model that follows instructions: tool calls, structured output, agent loops.

    Its resident KV cache (128 MiB, about 2,900 SmolLM2 tokens) holds fewer than four agent
    threads' contexts, so interleaved threads hit from the RAM tier, not vLLM's own cache.
    """
    return _shared_servers(
        model_dir=smollm2_dir, model=SMOLLM2_NAME, engine_args=SMOLLM2_ENGINE_ARGS
    )
