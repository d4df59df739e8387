"""Checkpointer benchmark: SQLAlchemySaver against SqliteSaver and PostgresSaver.

A 200-step thread whose message list grows by one message each step (plus a retrieved-context
channel written once and a step counter), the shape of an agent conversation. For each saver,
on fresh databases (a new SQLite file; a new PostgreSQL database on the same server), it
measures:

- ``put``: checkpoints saved per second (each step's checkpoint with its new channel versions);
- ``put_writes``: ``put_writes`` calls per second (one pending write per step);
- ``get_tuple``: loads per second of every checkpoint of the thread by id (time travel) and of
  the latest one (``get_tuple`` without id, what every run starts with);
- ``list``: checkpoint tuples per second when listing the whole thread;
- size: bytes of the savers' tables (SQLite file after a WAL checkpoint; PostgreSQL
  ``pg_total_relation_size`` of the tables).

It prints a table with ratios ours/peer (throughput: higher is better; size: lower is better).
Both savers run in lockstep, call by call, alternating which goes first, and each rate is taken
at the operation's median call time, so load from other processes hits both alike.

Reading the figures: SQLite writes are bound by the WAL fsync of each commit (one per ``put``
and per ``put_writes`` for both savers, ``synchronous=FULL``), so they track the disk; reads are
bound by deserializing the growing message list, identical work for both. What differs is a
constant per-call cost: a pooled connection and a one-statement query joining checkpoint, blobs
and writes for SQLAlchemySaver, against one shared ``sqlite3`` connection for SqliteSaver.

Run: ``python benchmarks/checkpointer.py [--steps 200] [--repeat 3] [--no-postgres]``.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint

from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PG_URL = "postgresql://postgres@127.0.0.1:5432/{name}"
TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes", "writes")
CONTEXT = {"documents": [f"retrieved passage {i}: " + "lorem ipsum " * 60 for i in range(8)]}


LIST_CALLS = 10
"""Whole-thread ``list`` calls per saver and repeat."""

OPS = ("put", "put_writes", "get_tuple (by id)", "get_tuple (latest)", "list (whole thread)")


@dataclass
class Result:
    """Per-call durations (seconds) of each operation for one saver, and its storage size."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    items: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 1))
    size_bytes: int = 0

    def rate(self, op: str) -> float:
        """Items per second at the median call duration."""
        return self.items[op] / statistics.median(self.samples[op])


def message(step: int) -> Any:
    """The message added at ``step``: alternating user and assistant turns of ~300 chars."""
    text = f"turn {step}: " + "some conversational content " * 10
    return HumanMessage(text) if step % 2 == 0 else AIMessage(text)


class ThreadWriter:
    """Builds one growing thread on one saver, a step at a time, timing each call."""

    def __init__(self, saver: BaseCheckpointSaver, thread_id: str) -> None:
        self.saver = saver
        self.config: dict[str, Any] = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": ""}
        }
        self.versions: dict[str, Any] = {}
        self.messages: list[Any] = []
        self.configs: list[Any] = []

    def step(self, step: int, result: Result) -> None:
        saver = self.saver
        self.messages = [*self.messages, message(step)]
        new = {"messages": saver.get_next_version(self.versions.get("messages"), None)}
        if step == 0:
            new["context"] = saver.get_next_version(None, None)
        self.versions.update(new)
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"messages": self.messages, "context": CONTEXT, "step": step}
        checkpoint["channel_versions"] = dict(self.versions)
        metadata = {"source": "loop", "step": step, "parents": {}}
        t0 = time.perf_counter()
        self.config = saver.put(self.config, checkpoint, metadata, new)
        t1 = time.perf_counter()
        saver.put_writes(self.config, [("messages", [message(step + 1)])], f"task-{step}", "~0")
        t2 = time.perf_counter()
        result.samples["put"].append(t1 - t0)
        result.samples["put_writes"].append(t2 - t1)
        self.configs.append(self.config)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_pair(
    ours_saver: BaseCheckpointSaver, peer_saver: BaseCheckpointSaver, steps: int, repeat: int
) -> tuple[Result, Result]:
    """Run every measurement on both savers in lockstep, alternating which goes first.

    Interleaving makes both savers see the same machine load; the reported rate uses each
    operation's median call time, which a burst of load from other processes barely moves.
    """
    results = (Result(), Result())
    savers = (ours_saver, peer_saver)
    for r in range(repeat):
        writers = [ThreadWriter(s, f"bench-{r}") for s in savers]
        for step in range(steps):
            for side in (step % 2, 1 - step % 2):
                writers[side].step(step, results[side])
        for i in range(steps):
            for side in (i % 2, 1 - i % 2):
                saver, config = savers[side], writers[side].configs[i]
                results[side].samples["get_tuple (by id)"].append(
                    _timed(lambda s=saver, c=config: s.get_tuple(c))
                )
                latest = {"configurable": {"thread_id": f"bench-{r}", "checkpoint_ns": ""}}
                results[side].samples["get_tuple (latest)"].append(
                    _timed(lambda s=saver, c=latest: s.get_tuple(c))
                )
        for i in range(LIST_CALLS):
            for side in (i % 2, 1 - i % 2):
                latest = {"configurable": {"thread_id": f"bench-{r}", "checkpoint_ns": ""}}
                results[side].samples["list (whole thread)"].append(
                    _timed(lambda s=savers[side], c=latest: list(s.list(c)))
                )
    for result in results:
        result.items["list (whole thread)"] = steps
    return results


def sqlite_size(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size


def pg_size(url: str) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind = 'r'"
        ).fetchone()
    return int(rows[0]) if rows else 0


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    import psycopg

    name = f"lgkv_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_URL.format(name=name)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_sqlite(steps: int, repeat: int, folder: Path) -> tuple[Result, Result]:
    from langgraph.checkpoint.sqlite import SqliteSaver

    ours_path, peer_path = folder / "ours.db", folder / "peer.db"
    with (
        SQLAlchemySaver.from_conn_string(f"sqlite:///{ours_path}") as ours_saver,
        sqlite3.connect(peer_path, check_same_thread=False) as conn,
    ):
        peer_saver = SqliteSaver(conn)
        ours_saver.setup()
        peer_saver.setup()
        ours, peer = bench_pair(ours_saver, peer_saver, steps, repeat)
    ours.size_bytes = sqlite_size(ours_path)
    peer.size_bytes = sqlite_size(peer_path)
    return ours, peer


def run_postgres(steps: int, repeat: int) -> tuple[Result, Result]:
    from langgraph.checkpoint.postgres import PostgresSaver

    with fresh_pg_database() as ours_url, fresh_pg_database() as peer_url:
        with (
            SQLAlchemySaver.from_conn_string(ours_url) as ours_saver,
            PostgresSaver.from_conn_string(peer_url) as peer_saver,
        ):
            ours_saver.setup()
            peer_saver.setup()
            ours, peer = bench_pair(ours_saver, peer_saver, steps, repeat)
        ours.size_bytes = pg_size(ours_url)
        peer.size_bytes = pg_size(peer_url)
    return ours, peer


def print_table(rows: list[tuple[str, str, Result, Result]]) -> None:
    header = f"{'backend':<10} {'operation':<22} {'ours':>12} {'peer':>12} {'ours/peer':>10}"
    print(header)
    print("-" * len(header))
    for backend, peer_name, ours, peer in rows:
        for op in OPS:
            a, b = ours.rate(op), peer.rate(op)
            print(f"{backend:<10} {op + ' /s':<22} {a:>12.1f} {b:>12.1f} {a / b:>9.2f}x")
        a_mb, b_mb = ours.size_bytes / 2**20, peer.size_bytes / 2**20
        ratio = ours.size_bytes / peer.size_bytes
        label = "size MiB (lower=better)"
        print(f"{backend:<10} {label:<22} {a_mb:>12.2f} {b_mb:>12.2f} {ratio:>9.2f}x")
        print(f"{'':<10} (peer: {peer_name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="checkpoints per thread")
    parser.add_argument("--repeat", type=int, default=3, help="threads/passes; best is kept")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ours, peer = run_sqlite(args.steps, args.repeat, Path(tmp))
        rows.append(("sqlite", "SqliteSaver", ours, peer))
    if not args.no_postgres:
        ours, peer = run_postgres(args.steps, args.repeat)
        rows.append(("postgres", "PostgresSaver", ours, peer))
    print(
        f"\n{args.steps}-step thread x {args.repeat} per saver; rates at the median call time "
        "(savers interleaved call by call)\n"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
