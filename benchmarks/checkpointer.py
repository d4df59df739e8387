"""Checkpointer benchmark: SQLAlchemySaver against SqliteSaver and PostgresSaver.

Threads of 200 and 1000 steps whose message list grows by one 60-word message each step (plus
a retrieved-context channel written once and a step counter), the shape of an agent
conversation. For each length and each saver, on fresh databases (a new SQLite file; a new
PostgreSQL database on the same server), it measures:

- ``invoke``: steps per second of what a graph step writes: ``put`` of the step's checkpoint
  with its new channel versions, then ``put_writes`` of one pending write;
- ``get_tuple``: loads per second of every checkpoint of the thread by id (time travel) and of
  the latest one (``get_tuple`` without id, what every run starts with); and ``new saver``:
  the first latest read of a saver that remembers nothing (a new process: ours then fetches
  and decodes every item, later reads take copies of the decoded messages), its connection
  already open;
- ``list``: checkpoint tuples per second when listing the whole thread;
- size: bytes of the savers' tables after one thread (SQLite file after a WAL checkpoint;
  PostgreSQL ``pg_total_relation_size`` of the tables: heap, free space and visibility maps,
  TOAST and indexes), and bytes per step over the first and the last 100 steps (flat when
  storage grows linearly with the thread). On PostgreSQL also the size after a plain
  ``VACUUM`` of both databases (no rewrite: what a settled database holds once autovacuum has
  run; it adds visibility maps and the free space maps of small tables, and frees nothing in
  an insert-only run), and with ``--pg-detail`` each table's share.

It prints a table with ratios ours/peer (throughput: higher is better; size: lower is better).
Both savers run in lockstep, call by call, alternating which goes first, and each rate is taken
at the operation's median call time, so load from other processes hits both alike. Our reads
go through a second SQLAlchemySaver opened after the writes, so they start with nothing in
memory, as another process would.

Reading the figures: a plain saver stores the whole message list again at every step, so its
size grows with the square of the thread and its ``put`` writes ever more bytes; ours stores
each message once (``langgraph_kvcache/checkpoint/lists.py``). A plain saver's read is bound
by deserializing the message list (rebuilding every message through its constructor); ours
decodes a message once per saver and then hands out copies
(``langgraph_kvcache/checkpoint/item_objects.py``), so its first read is the slow one.

Run: ``python benchmarks/checkpointer.py [--steps 200 1000] [--repeat 2] [--no-postgres]
[--size-only] [--pg-detail]``.
"""

from __future__ import annotations

import argparse
import random
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


LIST_TUPLES = 2000
"""Checkpoints listed per saver and repeat: ``LIST_TUPLES // steps`` whole-thread calls (at
least 2)."""

OPS = (
    "invoke",
    "get_tuple (by id)",
    "get_tuple (latest)",
    "get_tuple (new saver)",
    "list (whole thread)",
)

NEW_SAVER_READS = 10
"""``get_tuple (new saver)``: first latest reads of this many new reading savers per repeat."""

SIZE_ONLY = False
"""``--size-only``: write the threads and measure sizes, no reads (and no read rates)."""

PG_DETAIL = False
"""``--pg-detail``: print each PostgreSQL table's bytes (after VACUUM) for both savers."""

SIZE_AT = 100
"""Bytes per step are measured over the first and the last ``SIZE_AT`` steps."""


@dataclass
class Result:
    """Per-call durations (seconds) of each operation for one saver, and its storage size."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    items: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 1))
    size_bytes: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    """Database size after the first thread's step count (0: before it)."""
    settled_bytes: int | None = None
    """Size after the first thread and a ``VACUUM`` (PostgreSQL only)."""

    def per_step(self, first: int, last: int) -> float:
        """Bytes per step between the sizes after steps ``first`` and ``last``."""
        return (self.sizes[last] - self.sizes[first]) / (last - first)

    def rate(self, op: str) -> float:
        """Items per second at the median call duration."""
        return self.items[op] / statistics.median(self.samples[op])


VOCABULARY = [
    "the", "agent", "looked", "up", "weather", "calendar", "flights", "hotel", "budget",
    "plan", "wrote", "short", "summary", "user", "asked", "about", "trip", "dates", "prices",
    "museum", "dinner", "train", "station", "morning", "evening", "rain", "forecast", "booked",
    "seat", "window", "aisle", "cheaper", "option", "refund", "policy", "luggage", "limit",
    "city", "centre", "walk", "minutes", "late", "checkout", "breakfast", "included", "review",
    "rating", "quiet", "room", "view", "river", "bridge",
]  # fmt: skip


def message(step: int) -> Any:
    """The message added at ``step``: alternating user and assistant turns of 60 words drawn
    at random (seeded by the step) from a small vocabulary, so text compresses as prose does,
    not as one repeated phrase."""
    rng = random.Random(step)
    text = " ".join(["turn", str(step), *rng.choices(VOCABULARY, k=58)])
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
        saver.put_writes(self.config, [("messages", [message(step + 1)])], f"task-{step}", "~0")
        result.samples["invoke"].append(time.perf_counter() - t0)
        self.configs.append(self.config)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_pair(
    writers_: tuple[BaseCheckpointSaver, BaseCheckpointSaver],
    readers: Callable[[], Any],
    sizes: tuple[Callable[[], int], Callable[[], int]],
    steps: int,
    repeat: int,
    settled: tuple[Callable[[], int], Callable[[], int]] | None = None,
) -> tuple[Result, Result]:
    """Run every measurement on both savers in lockstep, alternating which goes first.

    ``writers_`` write (ours, peer); ``readers()`` is a context manager giving the (ours,
    peer) savers that read; ``sizes`` measure each database, ``settled`` (optional) each
    database after a ``VACUUM``, both after the first thread. Interleaving makes both savers
    see the same machine load; the reported rate uses each operation's median call time, which
    a burst of load from other processes barely moves.
    """
    results = (Result(), Result())
    marks = {0, SIZE_AT, steps - SIZE_AT, steps}
    for r in range(repeat):
        writers = [ThreadWriter(s, f"bench-{r}") for s in writers_]
        for step in range(steps):
            if r == 0 and step in marks:
                for side in (0, 1):
                    results[side].sizes[step] = sizes[side]()
            for side in (step % 2, 1 - step % 2):
                writers[side].step(step, results[side])
        if r == 0:
            for side in (0, 1):
                results[side].sizes[steps] = results[side].size_bytes = sizes[side]()
            for side in (0, 1) if settled else ():
                results[side].settled_bytes = settled[side]()  # type: ignore[index]
        if not SIZE_ONLY:
            with readers() as savers:
                _read_pass(savers, writers, results, steps, r)
            for i in range(NEW_SAVER_READS):
                with readers() as savers:
                    _new_saver_read(savers, results, r, i)
    for result in results:
        result.items["list (whole thread)"] = steps
    return results


def _read_pass(
    savers: tuple[BaseCheckpointSaver, BaseCheckpointSaver],
    writers: list[ThreadWriter],
    results: tuple[Result, Result],
    steps: int,
    r: int,
) -> None:
    """Time get_tuple by id and latest on every checkpoint, then whole-thread lists."""
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
    for i in range(max(2, LIST_TUPLES // steps)):
        for side in (i % 2, 1 - i % 2):
            latest = {"configurable": {"thread_id": f"bench-{r}", "checkpoint_ns": ""}}
            results[side].samples["list (whole thread)"].append(
                _timed(lambda s=savers[side], c=latest: list(s.list(c)))
            )


def _new_saver_read(
    savers: tuple[BaseCheckpointSaver, BaseCheckpointSaver],
    results: tuple[Result, Result],
    r: int,
    i: int,
) -> None:
    """Time the first latest read of a new reading saver (ours; the peer remembers nothing
    anyway), with its connection opened before the clock starts."""
    engine = getattr(savers[0], "engine", None)
    if engine is not None:
        engine.connect().close()
    latest = {"configurable": {"thread_id": f"bench-{r}", "checkpoint_ns": ""}}
    for side in (i % 2, 1 - i % 2):
        results[side].samples["get_tuple (new saver)"].append(
            _timed(lambda s=savers[side], c=latest: s.get_tuple(c))
        )


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


def pg_vacuumed_size(url: str, label: str) -> int:
    """``VACUUM`` the database, then :func:`pg_size`; with ``--pg-detail`` print each table's
    rows and bytes (heap, free space and visibility maps, TOAST, indexes)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM")
        if PG_DETAIL:
            rows = conn.execute(
                "SELECT c.relname, c.reltuples::bigint, pg_relation_size(c.oid, 'main'), "
                "pg_relation_size(c.oid, 'fsm') + pg_relation_size(c.oid, 'vm'), "
                "coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0), "
                "pg_indexes_size(c.oid), pg_total_relation_size(c.oid) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind = 'r' ORDER BY 7 DESC"
            ).fetchall()
            print(f"  {label}: bytes after VACUUM")
            print(f"  {'table':<24}{'rows':>7}{'heap':>10}{'fsm+vm':>8}{'toast':>10}{'indexes':>9}")
            for name, n, heap, maps, toast, idx, _ in rows:
                print(f"  {name:<24}{n:>7}{heap:>10}{maps:>8}{toast:>10}{idx:>9}")
    return pg_size(url)


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

    ours_path, peer_path = folder / f"ours-{steps}.db", folder / f"peer-{steps}.db"
    ours_url = f"sqlite:///{ours_path}"
    with (
        SQLAlchemySaver.from_conn_string(ours_url) as ours_saver,
        sqlite3.connect(peer_path, check_same_thread=False) as conn,
    ):
        peer_saver = SqliteSaver(conn)
        ours_saver.setup()
        peer_saver.setup()

        @contextmanager
        def readers() -> Iterator[tuple[BaseCheckpointSaver, BaseCheckpointSaver]]:
            with SQLAlchemySaver.from_conn_string(ours_url) as ours_reader:
                yield ours_reader, peer_saver

        sizes = (lambda: sqlite_size(ours_path), lambda: sqlite_size(peer_path))
        return bench_pair((ours_saver, peer_saver), readers, sizes, steps, repeat)


def run_postgres(steps: int, repeat: int) -> tuple[Result, Result]:
    from langgraph.checkpoint.postgres import PostgresSaver

    with (
        fresh_pg_database() as ours_url,
        fresh_pg_database() as peer_url,
        SQLAlchemySaver.from_conn_string(ours_url) as ours_saver,
        PostgresSaver.from_conn_string(peer_url) as peer_saver,
    ):
        ours_saver.setup()
        peer_saver.setup()

        @contextmanager
        def readers() -> Iterator[tuple[BaseCheckpointSaver, BaseCheckpointSaver]]:
            with SQLAlchemySaver.from_conn_string(ours_url) as ours_reader:
                yield ours_reader, peer_saver

        sizes = (lambda: pg_size(ours_url), lambda: pg_size(peer_url))
        settled = (
            lambda: pg_vacuumed_size(ours_url, "SQLAlchemySaver"),
            lambda: pg_vacuumed_size(peer_url, "PostgresSaver"),
        )
        return bench_pair((ours_saver, peer_saver), readers, sizes, steps, repeat, settled)


def print_table(rows: list[tuple[str, int, str, Result, Result]]) -> None:
    header = (
        f"{'backend':<9} {'steps':>5} {'operation':<26} {'ours':>11} {'peer':>11} {'ours/peer':>9}"
    )
    print(header)
    print("-" * len(header))
    for backend, steps, peer_name, ours, peer in rows:
        lead = f"{backend:<9} {steps:>5}"
        for op in OPS[:1] if SIZE_ONLY else OPS:
            a, b = ours.rate(op), peer.rate(op)
            print(f"{lead} {op + ' /s':<26} {a:>11.1f} {b:>11.1f} {a / b:>8.2f}x")
        a_mb, b_mb = ours.size_bytes / 2**20, peer.size_bytes / 2**20
        ratio = ours.size_bytes / peer.size_bytes
        print(f"{lead} {'size MiB (lower=better)':<26} {a_mb:>11.2f} {b_mb:>11.2f} {ratio:>8.3f}x")
        if ours.settled_bytes is not None and peer.settled_bytes is not None:
            a_mb, b_mb = ours.settled_bytes / 2**20, peer.settled_bytes / 2**20
            ratio = ours.settled_bytes / peer.settled_bytes
            label = "size MiB after VACUUM"
            print(f"{lead} {label:<26} {a_mb:>11.2f} {b_mb:>11.2f} {ratio:>8.3f}x")
        spans = ((0, SIZE_AT, "first"), (steps - SIZE_AT, steps, "last"))
        for first, last, name in spans:
            a, b = ours.per_step(first, last), peer.per_step(first, last)
            label = f"bytes/step {name} {SIZE_AT}"
            print(f"{lead} {label:<26} {a:>11.0f} {b:>11.0f} {a / b:>8.3f}x")
        print(f"{'':<15} (peer: {peer_name})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[200, 1000], help="checkpoints per thread"
    )
    parser.add_argument("--repeat", type=int, default=2, help="threads per saver and length")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    parser.add_argument(
        "--size-only", action="store_true", help="write and measure sizes and invoke only"
    )
    parser.add_argument(
        "--pg-detail", action="store_true", help="print each PostgreSQL table's bytes"
    )
    args = parser.parse_args()
    global SIZE_ONLY, PG_DETAIL
    SIZE_ONLY, PG_DETAIL = args.size_only, args.pg_detail
    if min(args.steps) < 2 * SIZE_AT:
        parser.error(f"--steps must be at least {2 * SIZE_AT} (bytes per step span {SIZE_AT})")
    print(
        f"{' and '.join(map(str, args.steps))}-step threads x {args.repeat} per saver; rates "
        "at the median call time (savers interleaved call by call)\n",
        flush=True,
    )
    for steps in args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            ours, peer = run_sqlite(steps, args.repeat, Path(tmp))
            print_table([("sqlite", steps, "SqliteSaver", ours, peer)])
        if not args.no_postgres:
            ours, peer = run_postgres(steps, args.repeat)
            print_table([("postgres", steps, "PostgresSaver", ours, peer)])


if __name__ == "__main__":
    main()
