"""``make cluster``: two server replicas sharing KV through Redis, behind ``vllm-router``.

    python -m examples.cluster                       # what `make cluster` runs
    python -m examples.cluster --turns 6 --kill-after 0   # no failover, just stickiness

What it does, in order (and undoes, in reverse, on exit, Ctrl-C or any error):

1. Redis on ``--redis-url`` (default ``redis://127.0.0.1:6379/0``); when nothing answers
   there and ``redis-server`` is installed, it starts one for the run (no persistence).
2. The checkpointer's database: PostgreSQL at ``--db`` (default the local
   ``postgresql://postgres@127.0.0.1:5432/test``); when it cannot be reached the run says so and
   uses a SQLite file instead.
3. Two replicas (``python -m server``), each with its own cache folder and a small resident
   budget, sharing ``--kv-redis-url``, each naming itself in the ``X-LGKV-Replica`` header.
4. ``vllm-router --policy consistent_hash`` in front of them (:mod:`examples.router_process`).
5. One LangGraph agent thread through the router: ``ChatKVCache`` pointed at the router (it sends
   ``X-Session-ID: <thread>``), the checkpointer with ``kv_server=<router>``. Each turn prints the
   replica that answered, the prompt tokens and how many came from a cache. After
   ``--kill-after`` turns (default 2) the replica serving the thread is killed (``kill -9``):
   the router takes it out of its ring and the next turns run on the other replica, which loads
   the thread's KV from Redis.

:class:`Cluster` (replicas + router as one context manager) is also what
``benchmarks/router.py`` starts.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from examples.managed import Managed
from examples.router_process import ROUTER_FLAGS, RouterProcess
from examples.server_process import ServerProcess

__all__ = ["REPLICA_FLAGS", "Cluster", "ensure_redis", "main", "replica_of"]

REPLICA_FLAGS: tuple[str, ...] = (
    "--max-model-len", "2048",
    "--kv-cache-memory-bytes", "96MiB",
    "--kv-ram-bytes", "256MiB",
    "--kv-disk-bytes", "1GiB",
    "--block-size", "32",
    "--max-num-seqs", "8",
)  # fmt: skip
"""Each replica's budgets: a resident cache of about one 2,048-token SmolLM2 context, so the
tiers (RAM, disk, then the shared Redis) hold the sessions; 32-token blocks."""
DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/test"


def say(msg: str) -> None:
    """Progress printer of the demo."""
    print(f"[cluster] {msg}", flush=True)


def replica_of(response_metadata: dict[str, Any]) -> str:
    """The replica that answered a ``ChatKVCache(include_response_headers=True)`` call."""
    from langgraph_kvcache.contract import REPLICA_HEADER

    headers = {k.lower(): v for k, v in (response_metadata.get("headers") or {}).items()}
    return str(headers.get(REPLICA_HEADER.lower(), "?"))


def _redis_alive(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=2).ping())
    except redis.exceptions.RedisError:
        return False


class RedisServer(Managed):
    """A throwaway ``redis-server`` on the port of ``url``, without persistence (for
    :func:`ensure_redis`)."""

    name = "redis-server"

    def __init__(self, binary: str, url: str, progress: Callable[[str], None] = say) -> None:
        self.binary, self.redis_url = binary, url
        self.port = httpx.URL(url).port or 6379
        self.log_path = Path(tempfile.mkdtemp(prefix="lgkv-redis-")) / "redis.log"
        self.env = {}
        self.start_timeout_s = self.stop_timeout_s = 20.0
        self.progress = progress

    @property
    def url(self) -> str:
        """The Redis URL it serves."""
        return self.redis_url

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        return [self.binary, "--port", str(self.port), "--save", "", "--appendonly", "no"]

    def healthy(self) -> bool:
        """Whether it answers PING."""
        return _redis_alive(self.redis_url)


@contextlib.contextmanager
def ensure_redis(url: str, progress: Callable[[str], None] = say) -> Iterator[bool]:
    """Yield whether Redis at ``url`` answers; start a throwaway ``redis-server`` for the block
    when nothing does on a local port (stopped afterwards)."""
    if _redis_alive(url):
        yield True
        return
    parsed = httpx.URL(url)
    binary = shutil.which("redis-server")
    if binary is None or parsed.host not in ("127.0.0.1", "localhost"):
        raise RuntimeError(
            f"no Redis answers at {url}; start one (e.g. `redis-server --port "
            f"{parsed.port or 6379}`) or pass --redis-url"
        )
    with RedisServer(binary, url, lambda m: progress(f"redis-server for this run: {m}")):
        yield True


class Cluster(Managed):
    """``replicas`` servers sharing ``redis_url`` behind one router; a context manager.

    Replicas are named ``replica-a``, ``replica-b``, ... (their ``--replica-id``); each gets its
    own cache folder under ``root``. They are launched together from the calling thread (the
    servers are tied to the thread that starts them) and the router starts once all are healthy.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        replicas: int = 2,
        model: Path | str | None = None,
        flags: Sequence[str] = REPLICA_FLAGS,
        router_flags: Sequence[str] = ROUTER_FLAGS,
        root: Path | str | None = None,
        ports: Sequence[int] | None = None,
        router_port: int | None = None,
        metrics_port: int | None = None,
        progress: Callable[[str], None] = say,
    ) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="lgkv-cluster-"))
        self.progress = progress
        self.replicas: list[ServerProcess] = []
        self.names = [f"replica-{chr(ord('a') + i)}" for i in range(replicas)]
        for i, name in enumerate(self.names):
            self.replicas.append(
                ServerProcess(
                    self.root / name / "cache",
                    [*flags, "--kv-redis-url", redis_url, "--replica-id", name],
                    model=model,
                    port=ports[i] if ports else None,
                    log_dir=self.root / name,
                    progress=lambda m, n=name: progress(f"{n}: {m}"),
                )
            )
        self.router = RouterProcess(
            [r.url for r in self.replicas],
            router_flags,
            port=router_port,
            metrics_port=metrics_port,
            log_dir=self.root / "router",
            progress=lambda m: progress(f"router: {m}"),
        )

    @property
    def url(self) -> str:
        """The router's root URL (what clients use)."""
        return self.router.url

    def replica(self, name: str) -> ServerProcess:
        """The replica whose ``--replica-id`` is ``name``."""
        return self.replicas[self.names.index(name)]

    def start(self, wait: bool = True) -> Cluster:
        """Launch every replica, wait for all, then start the router (always waits)."""
        try:
            for r in self.replicas:
                r.start(wait=False)
            for r in self.replicas:
                r.wait_healthy()
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the router, then every replica still running (SIGTERM, clean shutdown)."""
        self.router.stop()
        for r in self.replicas:
            r.stop()


# ----------------------------------------------------------------------------- the demo
QUESTIONS = (
    "Hi! I'm planning a small vegetable garden on a sunny balcony. What should I grow first?",
    "Good idea. How often should I water those plants in summer?",
    "What can I do about aphids without chemical sprays?",
    "Which of the plants you named can I still sow in late August?",
    "How do I keep the soil healthy for next year?",
    "Summarise your advice in three short points.",
)


def _open_saver(db: str, kv_server: str) -> contextlib.AbstractContextManager[Any]:
    from langgraph_kvcache import SQLAlchemySaver

    if db.startswith("postgresql"):
        try:
            import psycopg

            plain = db.replace("postgresql+psycopg://", "postgresql://")
            psycopg.connect(plain, connect_timeout=3).close()
        except Exception as exc:
            fallback = f"sqlite:///{tempfile.mkdtemp(prefix='lgkv-cluster-db-')}/agent.db"
            say(f"PostgreSQL at {db} is not reachable ({type(exc).__name__}); using {fallback}")
            db = fallback
    say(f"checkpointer: {db} (kv_server={kv_server})")
    return SQLAlchemySaver.from_conn_string(db, kv_server=kv_server)


def run_agent_thread(cluster: Cluster, db: str, turns: int, kill_after: int) -> None:
    """One LangGraph chat thread through the router; prints a line per turn."""
    from langgraph.graph import START, MessagesState, StateGraph

    from langgraph_kvcache import ChatKVCache

    llm = ChatKVCache(
        base_url=cluster.url + "/v1", include_response_headers=True, max_tokens=96, timeout=600
    )

    def chat(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState).add_node(chat).add_edge(START, "chat")
    thread = f"cluster-{uuid.uuid4().hex[:8]}"
    with _open_saver(db, cluster.url) as saver:
        saver.setup()
        app = graph.compile(checkpointer=saver)
        cfg = {"configurable": {"thread_id": thread}}
        say(f"thread {thread}: {turns} turns through the router at {cluster.url}")
        print(f"{'turn':>4} | {'replica':<10} | {'prompt':>6} | {'cached':>6} | {'share':>5} | "
              f"{'seconds':>7} | answer", flush=True)  # fmt: skip
        try:
            for turn, question in enumerate(QUESTIONS[:turns], start=1):
                t0 = time.monotonic()
                out = app.invoke({"messages": [("user", question)]}, cfg)
                reply = out["messages"][-1]
                usage = reply.usage_metadata or {}
                prompt = int(usage.get("input_tokens", 0))
                cached = int((usage.get("input_token_details") or {}).get("cache_read", 0))
                served_by = replica_of(reply.response_metadata)
                share = f"{cached / prompt:.0%}" if prompt else "-"
                text = " ".join(str(reply.content).split())[:60]
                print(f"{turn:>4} | {served_by:<10} | {prompt:>6} | {cached:>6} | {share:>5} | "
                      f"{time.monotonic() - t0:>7.1f} | {text}", flush=True)  # fmt: skip
                if turn == kill_after and turn < turns:
                    _kill(cluster, served_by)
        finally:
            saver.delete_thread(thread)  # drops the thread's KV session too (via the router)


def _kill(cluster: Cluster, name: str) -> None:
    victim = cluster.replica(name)
    say(f"kill -9 {name} (the replica serving this thread)")
    victim.kill()
    waited = cluster.router.wait_worker_health(victim.url, healthy=False)
    say(f"the router took {name} out of its ring after {waited:.1f} s; next turns go elsewhere")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m examples.cluster`` (``make cluster``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--db", default=DEFAULT_DB, help="checkpointer database URL")
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--kill-after", type=int, default=2, help="kill the thread's replica after "
                   "this turn (0: never)")  # fmt: skip
    p.add_argument("--ports", type=int, nargs=2, default=None, help="the replicas' ports")
    p.add_argument("--router-port", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None, help="the router's Prometheus port")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    try:
        with ensure_redis(args.redis_url), Cluster(
            args.redis_url, model=args.model, ports=args.ports,
            router_port=args.router_port, metrics_port=args.metrics_port,
        ) as cluster:  # fmt: skip
            say(f"replicas: {', '.join(r.url for r in cluster.replicas)}; router: {cluster.url}")
            run_agent_thread(cluster, args.db, args.turns, args.kill_after)
    except KeyboardInterrupt:
        say("interrupted; everything started was stopped")
        return 130
    say("done; everything started was stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
