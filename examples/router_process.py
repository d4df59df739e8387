"""Run ``vllm-router`` (PyPI ``vllm-router``, a Rust binary) in front of server replicas.

```python
from examples.router_process import RouterProcess

with RouterProcess([a.url, b.url]) as router:
    model = ChatKVCache(base_url=router.url + "/v1")  # sends X-Session-ID: <thread's session>
    ...
    router.workers()  # {"http://127.0.0.1:8001": True, "http://127.0.0.1:8002": False}
```

The router hashes each request's ``X-Session-ID`` header onto a consistent-hash ring of the
healthy replicas (``--policy consistent_hash``), so every request of a session goes to one
replica while it is healthy, and to another when it is not. :data:`ROUTER_FLAGS` are the
settings this project runs and tests it with; docs/operations.md ("Several replicas behind a
router") says what each one does and which parts of the router's source they rely on.

- :meth:`RouterProcess.start` starts ``python -m vllm_router.launch_router`` and waits until its
  ``/readiness`` answers 200 (the router itself waits for every replica's ``/health``); if the
  process exits first it raises :class:`RouterStartError` with the tail of its log.
- :meth:`RouterProcess.stop` sends SIGTERM, then SIGKILL to its process group if it hangs.
- Leaving the ``with`` block, or the end of the Python process, stops it; on Linux it also gets
  SIGTERM when the thread that started it dies.

Its output goes to ``<log_dir>/router.log`` (a temp folder by default).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from examples.managed import Managed, StartError, free_port, metric_sum

__all__ = ["ROUTER_FLAGS", "RouterProcess", "RouterStartError"]

ROUTER_FLAGS: tuple[str, ...] = (
    "--policy", "consistent_hash",
    "--health-check-endpoint", "/health",
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "2",
    "--retry-max-retries", "5",
    "--retry-initial-backoff-ms", "500",
    "--retry-backoff-multiplier", "2",
    "--retry-max-backoff-ms", "4000",
    "--worker-startup-check-interval", "1",
)  # fmt: skip
"""How ``make cluster`` and the tests run the router: sessions hashed from ``X-Session-ID``;
replicas probed on ``/health`` every second, out of the ring after 2 failed probes and back
after 2 good ones; a failed request (connection error or HTTP 408/429/5xx) tried up to 5 times
in all, 0.5, 1, 2 and 4 s apart, each time on the replica the ring picks then (so a request
that was on a replica killed mid-answer ends on another one once the probes took the dead one
out)."""


def say(msg: str) -> None:
    """Default progress printer."""
    print(f"[router] {msg}", flush=True)


class RouterStartError(StartError):
    """The router exited or did not become ready; the message holds the log's tail."""


class RouterProcess(Managed):
    """One ``vllm-router`` child process on a local port (see the module doc)."""

    name = "vllm-router"
    ready_path = "/readiness"
    unhealthy_hint = " (are the replicas healthy?)"
    start_error = RouterStartError

    def __init__(
        self,
        worker_urls: Sequence[str],
        flags: Sequence[str] = ROUTER_FLAGS,
        *,
        port: int | None = None,
        metrics_port: int | None = None,
        log_dir: Path | str | None = None,
        start_timeout_s: float = 90.0,
        stop_timeout_s: float = 15.0,
        progress: Callable[[str], None] = say,
    ) -> None:
        """Describe the router; nothing starts until :meth:`start` (or ``with``).

        Args:
            worker_urls: the replicas' root URLs, e.g. ``["http://127.0.0.1:8001", ...]``.
            flags: router flags besides host, ports and workers (default :data:`ROUTER_FLAGS`).
            port: the router's TCP port; ``None``: a free one.
            metrics_port: its Prometheus port (``/metrics``); ``None``: a free one (the
                router's own default, 29000, would clash between two routers on one machine).
            log_dir: folder of ``router.log``; ``None``: a new temp folder.
            start_timeout_s: how long :meth:`start` waits for ``/readiness``.
            stop_timeout_s: how long :meth:`stop` waits after SIGTERM before SIGKILL.
            progress: where progress lines go.
        """
        if not worker_urls:
            raise ValueError("give the router at least one replica URL")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.flags = list(flags)
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="lgkv-router-")) / "router.log"
        self.env = {"RUST_LOG_STYLE": "never"}
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.progress = progress

    @property
    def metrics_url(self) -> str:
        """The router's Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        return [
            sys.executable, "-m", "vllm_router.launch_router",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--worker-urls", *self.worker_urls, *self.flags,
        ]  # fmt: skip

    def start(self, wait: bool = True) -> RouterProcess:
        """Start the router and (with ``wait``) wait until ``/readiness`` answers 200.

        Raises:
            RouterStartError: the process exited, or was not ready after ``start_timeout_s``
                (it is stopped first); the message holds the log's last lines. Without the
                ``vllm-router`` package the message says what to install.
        """
        try:
            import vllm_router  # noqa: F401
        except ImportError:
            raise RouterStartError(
                "the vllm-router package is missing: pip install 'langgraph-kvcache[router]' "
                "(or `make setup`)"
            ) from None
        return super().start(wait)

    def workers(self) -> dict[str, bool]:
        """Each replica URL and whether the router counts it healthy now (``GET /workers``)."""
        data = httpx.get(self.url + "/workers", timeout=5).json()
        return {w["url"]: bool(w["is_healthy"]) for w in data["workers"]}

    def wait_worker_health(self, url: str, healthy: bool, timeout_s: float = 30.0) -> float:
        """Wait until the router counts ``url`` as ``healthy`` (or not); return the seconds
        waited. Raises ``TimeoutError`` after ``timeout_s``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.workers().get(url.rstrip("/")) is healthy:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"the router did not mark {url} healthy={healthy} in {timeout_s}s")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the router's Prometheus samples ``name`` whose labels include ``labels``
        (0 when there is none yet), e.g. ``metric("vllm_router_retries_total")``."""
        return metric_sum(httpx.get(self.metrics_url, timeout=5).text, name, **labels)
