"""PostgreSQL size of candidate checkpoint layouts (one or two busy tables), before building.

Issue 12 asks for <= 1/10 of ``PostgresSaver``'s bytes at 200 steps (3.14 MiB in
``benchmarks/checkpointer.py``) and <= 1/50 at 1000 (61.58 MiB). Ours has four busy tables
(checkpoints, list versions, list items, pending writes); each costs a 24 kB free-space map
once it outgrows a page, a TOAST index and a primary key whatever its rows. This script builds
the layout with two busy tables in a fresh database and fills it with rows of the sizes the
benchmark's thread produces, then prints ``pg_total_relation_size`` per table and in all:

- ``checkpoints`` carries its list version inline (``lists``: the digests a leaf, anchor or
  snapshot holds, as in :mod:`langgraph_kvcache.checkpoint.lists`; ``items``: the new items'
  bytes when no pending write stored them, here only the first step's);
- ``checkpoint_writes`` carries the pending write's list item inline (digest and the
  compressed 60-word message: 214 bytes, incompressible random bytes so TOAST cannot shrink
  them);
- ``checkpoint_blobs`` keeps the values that are not lists (the retrieved-context channel,
  written once, compressible text); ``checkpoint_migrations`` as now; with ``--sessions`` the
  two (empty) session tables too.

``--layout one`` puts both row kinds in one table, ``checkpoint_log``, keyed by (thread, namespace,
checkpoint id, task id, idx): a checkpoint is the row with an empty task id, its pending writes
the rows beside it (one index range reads a checkpoint with its writes). One heap, one free space
map, one primary key and one TOAST index instead of two each. ``--layout one-compact`` also
stores the checkpoint, parent and task ids as 16-byte ``bytea`` (a UUID's bytes sort as its
canonical text does) instead of 36-character text.

Nothing here is the saver's code: it measures what a layout would cost, to decide whether it
reaches the goal. Run: ``python benchmarks/pg_layout.py [--steps 200 1000]
[--layout two one one-compact] [--sessions]``.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid

import psycopg

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PEER_MIB = {200: 3.14, 1000: 61.58}
"""``PostgresSaver``'s size in ``benchmarks/checkpointer.py`` (docs/benchmarks.md)."""

SCHEMA = (
    "CREATE TABLE checkpoint_migrations (v INTEGER PRIMARY KEY)",
    """CREATE TABLE checkpoints (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL DEFAULT '',
        checkpoint_id TEXT NOT NULL, parent_checkpoint_id TEXT, run_id TEXT, type TEXT NOT NULL,
        checkpoint BYTEA NOT NULL, metadata JSONB NOT NULL, blob_versions JSONB NOT NULL,
        lists BYTEA, items BYTEA, PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id))""",
    "CREATE INDEX checkpoints_run_id_idx ON checkpoints (run_id) WHERE run_id IS NOT NULL",
    """CREATE TABLE checkpoint_blobs (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL
        DEFAULT '', channel TEXT NOT NULL, version TEXT NOT NULL, type TEXT NOT NULL, blob BYTEA,
        PRIMARY KEY (thread_id, checkpoint_ns, channel, version))""",
    """CREATE TABLE checkpoint_writes (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL
        DEFAULT '', checkpoint_id TEXT NOT NULL, task_id TEXT NOT NULL, idx INTEGER NOT NULL,
        task_path TEXT NOT NULL DEFAULT '', channel TEXT NOT NULL, type TEXT, blob BYTEA NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx))""",
)
ONE_TABLE = """CREATE TABLE checkpoint_log (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT NULL
    DEFAULT '', checkpoint_id {id} NOT NULL, task_id {id} NOT NULL, idx INTEGER NOT NULL,
    parent_checkpoint_id {id}, run_id TEXT, task_path TEXT, channel TEXT, type TEXT NOT NULL,
    data BYTEA NOT NULL, metadata JSONB, blob_versions JSONB, lists BYTEA, items BYTEA,
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx))"""
"""``--layout one``: checkpoints (empty ``task_id``) and pending writes in one table; ``{id}`` is
TEXT, or BYTEA with ``one-compact``."""
ONE_SCHEMA = (
    SCHEMA[0],
    "CREATE INDEX checkpoint_log_run_id_idx ON checkpoint_log (run_id) WHERE run_id IS NOT NULL",
    SCHEMA[3],
)
LAYOUTS = ("two", "one", "one-compact")

SESSIONS = (
    """CREATE TABLE checkpoint_kv_sessions (thread_id TEXT NOT NULL, checkpoint_ns TEXT NOT
        NULL DEFAULT '', session_id TEXT NOT NULL, last_used_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns))""",
    "CREATE INDEX checkpoint_kv_sessions_last_used_idx ON checkpoint_kv_sessions (last_used_at)",
    """CREATE TABLE checkpoint_kv_outbox (id TEXT PRIMARY KEY, op TEXT NOT NULL, session_id TEXT
        NOT NULL, target_id TEXT, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT)""",
)
MESSAGE_BYTES = 214
"""A benchmark message compressed (docs/storage.md, Compact rows)."""
DIGEST = 16
SNAPSHOT_EVERY, ANCHOR_EVERY = 100, 10


def list_digests(step: int) -> int:
    """Digests a list version holds at ``step``: a snapshot all, an anchor those since the
    snapshot, a leaf those since the anchor (one per step here)."""
    count = step % SNAPSHOT_EVERY
    if count == 0:
        return step + 1
    if count % ANCHOR_EVERY == 0:
        return count + 1
    return count % ANCHOR_EVERY


CHECKPOINT_ROW = {
    "two": "INSERT INTO checkpoints VALUES ('bench-0', '', %s, %s, NULL, 'z1:msgpack', %s, %s, "
    "%s, %s, %s)",
    "one": "INSERT INTO checkpoint_log (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, "
    "parent_checkpoint_id, type, data, metadata, blob_versions, lists, items) VALUES "
    "('bench-0', '', %s, '', 0, %s, 'z1:msgpack', %s, %s, %s, %s, %s)",
}
WRITE_ROW = {
    "two": "INSERT INTO checkpoint_writes VALUES ('bench-0', '', %s, %s, 0, '', 'messages', "
    "'lgkv.items', %s)",
    "one": "INSERT INTO checkpoint_log (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, "
    "task_path, channel, type, data) VALUES ('bench-0', '', %s, %s, 0, '~0', 'messages', "
    "'lgkv.items', %s)",
}


def fill(conn: psycopg.Connection, steps: int, sessions: bool, layout: str = "two") -> None:
    """Create ``layout``'s tables and fill them with the benchmark thread's rows: a checkpoint
    row and a pending write row per step (in one table with ``--layout one``)."""
    compact = layout == "one-compact"
    if layout == "two":
        ddl: tuple[str, ...] = SCHEMA
    else:
        ddl = (ONE_SCHEMA[0], ONE_TABLE.format(id="BYTEA" if compact else "TEXT"), *ONE_SCHEMA[1:])
    for sql in ddl + (SESSIONS if sessions else ()):
        conn.execute(sql)
    conn.execute("INSERT INTO checkpoint_migrations SELECT generate_series(0, 7)")
    context = ("retrieved passage: " + "lorem ipsum " * 60).encode() * 8
    version = "0000000000000001.abcdefabcdef"
    conn.execute(
        "INSERT INTO checkpoint_blobs VALUES ('bench-0', '', 'context', %s, 'msgpack', %s)",
        (version, context),
    )

    def ident(value: uuid.UUID | str) -> bytes | str:
        """An id as stored: text, or with ``one-compact`` a UUID's 16 bytes."""
        if not compact:
            return str(value)
        return value.bytes if isinstance(value, uuid.UUID) else value.encode()

    kind = "two" if layout == "two" else "one"
    parent = None
    for step in range(steps):
        checkpoint_id = ident(uuid.uuid1())
        conn.execute(
            CHECKPOINT_ROW[kind],
            (
                checkpoint_id,
                parent,
                os.urandom(47),
                json.dumps({"source": "loop", "step": step, "parents": {}}),
                json.dumps({"context": version}),
                os.urandom(30 + DIGEST * list_digests(step)),
                os.urandom(MESSAGE_BYTES) if step == 0 else None,
            ),
        )
        write = (checkpoint_id, ident(f"task-{step}"), os.urandom(DIGEST + MESSAGE_BYTES + 8))
        conn.execute(WRITE_ROW[kind], write)
        parent = checkpoint_id


def measure(steps: int, sessions: bool, layout: str = "two") -> None:
    name = f"lgkv_layout_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = PG_ADMIN.replace("dbname=postgres", f"dbname={name}")
        with psycopg.connect(url, autocommit=True) as conn:
            fill(conn, steps, sessions, layout)
            rows = conn.execute(
                "SELECT relname, pg_relation_size(oid, 'main'), pg_relation_size(oid, 'fsm'), "
                "coalesce(pg_total_relation_size(nullif(reltoastrelid, 0)), 0), "
                "pg_indexes_size(oid), pg_total_relation_size(oid) FROM pg_class "
                "WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace ORDER BY 6 DESC"
            ).fetchall()
        total = sum(r[5] for r in rows)
        tables = "two busy tables" if layout == "two" else f"one busy table ({layout})"
        print(f"{steps} steps, {tables}{' + session tables' if sessions else ''}:")
        print(f"  {'table':<24}{'heap':>8}{'fsm':>8}{'toast':>8}{'indexes':>9}{'total':>9}")
        for relname, heap, fsm, toast, idx, all_ in rows:
            print(f"  {relname:<24}{heap:>8}{fsm:>8}{toast:>8}{idx:>9}{all_:>9}")
        ratio = total / 2**20 / PEER_MIB[steps] if steps in PEER_MIB else None
        peer = f" = {ratio:.4f}x PostgresSaver ({PEER_MIB[steps]} MiB)" if ratio else ""
        print(f"  total {total} bytes, {total / 2**20:.3f} MiB{peer}", flush=True)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--layout", nargs="+", choices=LAYOUTS, default=["two"])
    parser.add_argument("--sessions", action="store_true", help="add the empty session tables")
    args = parser.parse_args()
    for steps in args.steps:
        for layout in args.layout:
            measure(steps, args.sessions, layout)


if __name__ == "__main__":
    main()
