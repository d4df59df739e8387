"""The session registry's SQLite schema, its row types and the SQL shared by its writers.

:class:`server.kv.registry.Registry` is the interface; this module holds what its methods share:
the tables (:func:`migrate`, append-only column additions for older files, then the versioned
steps of :mod:`server.kv.registry.migrations`), the row dataclasses,
and the helpers that run inside a writer's transaction (:func:`delete_rows`,
:func:`record_drops`), so a delete and the drops the engine reads commit together.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass

from server.kv.registry.migrations import run_steps

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL, id TEXT NOT NULL,
    num_tokens INTEGER NOT NULL DEFAULT 0, turns INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL, last_used_at REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0, ttl_seconds REAL,
    gap_count INTEGER NOT NULL DEFAULT 0, gap_mean REAL NOT NULL DEFAULT 0,
    managed INTEGER NOT NULL DEFAULT 0, pin_until REAL,
    PRIMARY KEY (tenant, id)
);
CREATE TABLE IF NOT EXISTS session_blocks (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, idx INTEGER NOT NULL, key TEXT NOT NULL,
    PRIMARY KEY (tenant, session_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS session_blocks_key ON session_blocks (key);
CREATE TABLE IF NOT EXISTS blocks (
    key TEXT PRIMARY KEY, nbytes INTEGER NOT NULL,
    ram INTEGER NOT NULL DEFAULT 0, disk INTEGER NOT NULL DEFAULT 0,
    redis INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS drops (seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS stats (name TEXT PRIMARY KEY, value REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL, session_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cursors (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""

DROPS_KEPT = 100_000
"""How many newest ``drops`` and ``changes`` rows are kept (older ones go at TTL purges; an
engine that fell further behind reloads the whole snapshot)."""

SESSION_COLS = (
    "tenant, id, num_tokens, turns, created_at, last_used_at, pinned, ttl_seconds, "
    "gap_count, gap_mean, managed, pin_until"
)


@dataclass(frozen=True)
class SessionRow:
    """One session as stored (times are unix seconds)."""

    tenant: str
    id: str
    num_tokens: int
    turns: int
    created_at: float
    last_used_at: float
    pinned: bool
    ttl_seconds: float | None
    gap_count: int
    gap_mean: float
    managed: bool = False
    """Registered through the session API (by a checkpointer): its owner will come back, so
    the eviction policy keeps it after sessions that only requests created."""
    pin_until: float | None = None
    """When a pin with a lease lapses (unix seconds); None: no lease (pinned until unpinned,
    when pinned)."""
    num_blocks: int = 0

    def pinned_at(self, now: float) -> bool:
        """Whether the session is pinned at ``now`` (a lapsed lease no longer pins)."""
        return self.pinned and (self.pin_until is None or self.pin_until > now)

    @property
    def expires_at(self) -> float | None:
        """When the session expires (last use + TTL), or None without a TTL."""
        return None if self.ttl_seconds is None else self.last_used_at + self.ttl_seconds


@dataclass(frozen=True)
class TierCount:
    """Blocks and bytes of one session in one tier."""

    blocks: int
    bytes: int


def migrate(db: sqlite3.Connection) -> None:
    """Create the tables, add the columns older registry files lack, then run the schema
    steps the file has not run (:mod:`server.kv.registry.migrations`)."""
    for stmt in SCHEMA.strip().split(";"):
        if stmt.strip():
            db.execute(stmt)
    cols = {r[1] for r in db.execute("PRAGMA table_info(blocks)")}
    if "redis" not in cols:  # registries from before the Redis tier
        db.execute("ALTER TABLE blocks ADD COLUMN redis INTEGER NOT NULL DEFAULT 0")
    cols = {r[1] for r in db.execute("PRAGMA table_info(sessions)")}
    if "managed" not in cols:  # registries from before managed sessions
        db.execute("ALTER TABLE sessions ADD COLUMN managed INTEGER NOT NULL DEFAULT 0")
    if "pin_until" not in cols:  # registries from before pin leases
        db.execute("ALTER TABLE sessions ADD COLUMN pin_until REAL")
    run_steps(db)  # the versioned steps after this base schema


def record_drops(db: sqlite3.Connection, keys: Iterable[str]) -> None:
    """Record freed block keys for the engine (which drops them and removes their files)."""
    rows = [(k,) for k in keys]
    if rows:
        db.executemany("INSERT INTO drops (key) VALUES (?)", rows)
        db.executemany("DELETE FROM blocks WHERE key = ?", rows)


def record_change(db: sqlite3.Connection, tenant: str, session_id: str) -> None:
    """Note that a session's row or block list changed (created, updated, deleted), in the
    writer's transaction; the engine reads these rows as increments of its policy state."""
    db.execute("INSERT INTO changes (tenant, session_id) VALUES (?, ?)", (tenant, session_id))


def row_from(r: tuple) -> SessionRow:
    """A ``sessions`` row (``SESSION_COLS`` plus the block count) as a :class:`SessionRow`."""
    return SessionRow(
        tenant=r[0],
        id=r[1],
        num_tokens=int(r[2]),
        turns=int(r[3]),
        created_at=float(r[4]),
        last_used_at=float(r[5]),
        pinned=bool(r[6]),
        ttl_seconds=None if r[7] is None else float(r[7]),
        gap_count=int(r[8]),
        gap_mean=float(r[9]),
        managed=bool(r[10]),
        pin_until=None if r[11] is None else float(r[11]),
        num_blocks=int(r[12]),
    )


def delete_rows(db: sqlite3.Connection, tenant: str, session_id: str) -> list[str] | None:
    """Delete a session's rows; return its keys no other session references (None: unknown)."""
    found = db.execute(
        "SELECT 1 FROM sessions WHERE tenant = ? AND id = ?", (tenant, session_id)
    ).fetchone()
    if found is None:
        return None
    keys = [
        r[0]
        for r in db.execute(
            "SELECT DISTINCT key FROM session_blocks WHERE tenant = ? AND session_id = ?",
            (tenant, session_id),
        )
    ]
    db.execute(
        "DELETE FROM session_blocks WHERE tenant = ? AND session_id = ?", (tenant, session_id)
    )
    db.execute("DELETE FROM sessions WHERE tenant = ? AND id = ?", (tenant, session_id))
    record_change(db, tenant, session_id)
    return [
        k
        for k in keys
        if db.execute("SELECT 1 FROM session_blocks WHERE key = ? LIMIT 1", (k,)).fetchone() is None
    ]


def live(db: sqlite3.Connection, tenant: str, session_id: str, now: float) -> bool:
    """Whether the session exists and has not expired by ``now``: an expired row that the
    engine has not purged yet is missing for every writer."""
    row = db.execute(
        "SELECT ttl_seconds, last_used_at FROM sessions WHERE tenant = ? AND id = ?",
        (tenant, session_id),
    ).fetchone()
    return row is not None and (row[0] is None or row[1] + row[0] >= now)


def snapshot_chunk(
    db: sqlite3.Connection, after: tuple[str, str] | None, chunk: int
) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
    """Up to ``chunk`` sessions after (tenant, id) ``after`` in key order, and their
    (tenant, session id, key) references in block order: two primary-key range reads."""
    where = "" if after is None else "WHERE (tenant, id) > (?, ?) "
    rows = db.execute(
        f"SELECT {SESSION_COLS} FROM sessions {where}ORDER BY tenant, id LIMIT ?",
        (*(after or ()), chunk),
    ).fetchall()
    if not rows:
        return [], []
    refs = db.execute(
        "SELECT tenant, session_id, key FROM session_blocks "
        "WHERE (tenant, session_id) >= (?, ?) AND (tenant, session_id) <= (?, ?) "
        "ORDER BY tenant, session_id, idx",
        (rows[0][0], rows[0][1], rows[-1][0], rows[-1][1]),
    ).fetchall()
    return [row_from((*r, 0)) for r in rows], [(t, s, k) for t, s, k in refs]
