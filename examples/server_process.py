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

The server's output goes to ``<log_dir>/server.log`` (a temp folder by default; ``log_name``
renames it), never to the caller's terminal. Starting, waiting and stopping are
:class:`examples.managed.Managed`'s, shared with the router and Redis helpers.

:class:`PlainVllmProcess` takes the same arguments and runs plain vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``) on the same model, under the same served
name, with the flags given: what the benchmarks compare this server with.

Comparisons (the benchmarks, ``make demo``) give every server the same CPU cores:
:func:`equal_cores_env` is the environment to start each with, :func:`omp_cores` reads back from a
server's log which cores its engine's OpenMP threads got. Left alone, vLLM's CPU backend reserves
one core for its scheduler process without a KV connector and none with one on a 2-core machine
(a connector asks for a second reserved core, which exceeds the cores, so vLLM reserves none).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from examples.managed import Managed, StartError, free_port, log_tail

__all__ = [
    "RESERVED_CPUS",
    "Managed",
    "PlainVllmProcess",
    "ServerProcess",
    "ServerStartError",
    "equal_cores_env",
    "free_port",
    "locate_model",
    "log_tail",
    "omp_cores",
]

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


class ServerStartError(StartError):
    """The server exited or stayed unhealthy while starting; the message holds the log's tail."""


def say(msg: str) -> None:
    """Default progress printer."""
    print(f"[server] {msg}", flush=True)


def locate_model(progress: Callable[[str], None] = say) -> Path:
    """The default model folder (SmolLM2-135M-Instruct), built from the offline GGUF once."""
    from server.model import build_default_model, default_model_dir

    if not (default_model_dir() / "config.json").is_file():
        progress(f"building the default model into {default_model_dir()} (once, ~1 minute)...")
    return build_default_model()


class ServerProcess(Managed):
    """One ``python -m server`` child process on a free port (see the module doc)."""

    name = "the server"
    loading = "loading the engine"
    start_error = ServerStartError

    def __init__(
        self,
        cache_dir: Path | str | None = None,
        flags: Sequence[str] = (),
        *,
        model: Path | str | None = None,
        served_name: str | None = None,
        port: int | None = None,
        log_dir: Path | str | None = None,
        log_name: str = "server.log",
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
            served_name: ``--served-model-name`` (what clients send as ``model``); ``None``:
                the names above.
            port: TCP port; ``None``: a free one.
            log_dir: folder of the log; ``None``: a new temp folder.
            log_name: the log's file name in ``log_dir``.
            env: environment variables for the child that beat ``os.environ``, e.g.
                :func:`equal_cores_env` for a comparison.
            start_timeout_s: how long :meth:`start` waits for ``/health``.
            stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
            progress_every_s: seconds between "still loading" lines while starting.
            progress: where progress lines go (``print`` with a ``[server]`` prefix).
        """
        self._cache_dir = Path(cache_dir) if cache_dir else None
        self.flags = list(flags)
        self.model = Path(model) if model is not None else None
        self.served_name = served_name
        self.port = port or free_port()
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="lgkv-log-")) / log_name
        self.env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.progress_every_s = progress_every_s
        self.progress = progress

    @property
    def cache_dir(self) -> Path:
        """The ``--cache-dir``; without one given, a temp folder made on first use."""
        if self._cache_dir is None:
            self._cache_dir = Path(tempfile.mkdtemp(prefix="lgkv-cache-"))
        return self._cache_dir

    @property
    def model_name(self) -> str:
        """The served model name (``GET /v1/models``), what ``ChatKVCache(model=...)`` sends."""
        return str(httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"])

    def child_env(self) -> dict[str, str]:
        """:data:`SERVER_ENV`, ``os.environ`` over it, ``env`` over both."""
        return {**SERVER_ENV, **os.environ, **self.env}

    def _model_flags(self) -> list[str]:
        """``--model`` and ``--served-model-name`` where given (the server names its default)."""
        if self.model is None:
            locate_model(self.progress)  # the server serves it as "SmolLM2-135M-Instruct"
        model = ["--model", str(self.model)] if self.model is not None else []
        return [*model, *(["--served-model-name", self.served_name] if self.served_name else [])]

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        return [
            sys.executable, "-m", "server", "serve", *self._model_flags(),
            "--port", str(self.port), "--cache-dir", str(self.cache_dir), *self.flags,
        ]  # fmt: skip

    def restart(self) -> ServerProcess:
        """Stop, then start again on the same port and cache dir."""
        self.stop()
        return self.start()

    def omp_cores(self) -> str:
        """The cores its engine bound OpenMP threads to, from its log (:func:`omp_cores`)."""
        return omp_cores(self.log_path)


class PlainVllmProcess(ServerProcess):
    """Plain vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``, prefix
    caching on) as a child process: what this server is measured against. It takes the
    arguments of :class:`ServerProcess` and serves the same model under the same name; port,
    health wait, log, stop, environment and :meth:`omp_cores` are the same. ``flags`` go to
    vLLM as they are (none of this server's own); ``cache_dir`` is not used."""

    name = "plain vLLM"

    def _model_flags(self) -> list[str]:
        """As :class:`ServerProcess` serves them: the default model as SmolLM2-135M-Instruct."""
        from server.model import DEFAULT_MODEL_NAME

        if self.model is not None:
            return super()._model_flags()
        name = self.served_name or DEFAULT_MODEL_NAME
        return ["--model", str(locate_model(self.progress)), "--served-model-name", name]

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self._model_flags(),
            "--port", str(self.port), *self.flags,
        ]  # fmt: skip
