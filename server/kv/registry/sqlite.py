"""The session registry: one SQLite file (WAL mode) shared by the API process and the engine.

Tables:
- ``sessions``: one row per (tenant, session id): tokens, turns, times, pin, TTL and the
  session's turn-gap statistics (count and mean, used by the eviction policy).
- ``session_blocks``: a session's ordered block keys (hex vLLM block hashes). Blocks are
  content-addressed, so a copy is a copy of this list.
- ``blocks``: where the engine last reported each block (``ram``/``disk`` flags, bytes).
- ``drops``: block keys freed by a delete or an expiry, recorded in the same transaction; the
  engine reads new rows, forgets those blocks in every tier and removes their files.
- ``stats``: the engine's counters (added as deltas) and gauges (set), read by ``metrics()``.
- ``changes``: (tenant, session id) of every session write, in the write's transaction; the
  engine's registry thread reads new rows as increments (:meth:`Registry.changes_after`).
- ``cursors``: feed positions this engine saved (with sessions in Redis: where it resumes the
  shared drops stream after a restart).

It implements both parts of :mod:`server.kv.registry.api`: sessions (the default, one node)
and the local part (block locations, counters), which stays here when sessions live in Redis
(:class:`server.kv.registry.shared.SharedRegistry`).

Every method opens its own short transaction; a connection is shared by the threads of one
process behind a lock. Writers use ``BEGIN IMMEDIATE`` and a busy timeout, so two processes
never see half a change. Session ids are data only: never part of a path.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from server.kv.registry import expiry
from server.kv.registry.api import join_snapshot, purge_in_batches
from server.kv.registry.feeds import FeedTables
from server.kv.registry.file_mode import private_file
from server.kv.registry.local import LocalTables
from server.kv.registry.migrations import TENANT, TOTAL
from server.kv.registry.page import parse_session_cursor
from server.kv.registry.sql import (
    SESSION_COLS,
    SessionRow,
    TierCount,
    delete_rows,
    live,
    migrate,
    record_change,
    record_drops,
    row_from,
    snapshot_chunk,
)

__all__ = ["Registry", "SessionRow", "TierCount"]

SNAPSHOT_CHUNK = 10_000
"""Sessions per chunk of :meth:`Registry.iter_policy_snapshot`."""


class Registry(FeedTables, LocalTables):
    """Typed access to the registry file; safe for several threads and several processes."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        private_file(self.path)  # every tenant's sessions: 0600 in a folder it makes 0700
        self._lock = threading.RLock()
        self._db = sqlite3.connect(
            str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        with self._write() as db:
            migrate(db)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: Iterable[object] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def ping(self) -> None:
        """A local file is always reachable (the session store interface's check)."""

    def data_version(self) -> int:
        """A number that changes whenever another connection commits (cheap change check)."""
        return int(self._read("PRAGMA data_version")[0][0])

    # ----------------------------------------------------------------- sessions

    def get_session(self, tenant: str, session_id: str) -> SessionRow | None:
        """The session, or None if unknown (an expired one is returned as stored: readers
        check :attr:`SessionRow.expires_at`; the engine purges it)."""
        rows = self._read(
            f"SELECT {SESSION_COLS}, (SELECT count(*) FROM session_blocks b WHERE "
            "b.tenant = s.tenant AND b.session_id = s.id) FROM sessions s "
            "WHERE tenant = ? AND id = ?",
            (tenant, session_id),
        )
        return row_from(rows[0]) if rows else None

    def list_sessions(
        self, tenant: str, limit: int, offset: int = 0, *, after: str | None = None
    ) -> list[SessionRow]:
        """A tenant's sessions, newest use first (ties by id, descending): see
        :meth:`server.kv.registry.api.SessionStore.list_sessions`. An index range read."""
        where, args = "tenant = ?", [tenant]
        if after is not None:
            last_used_at, session_id = parse_session_cursor(after)
            where += " AND last_used_at <= ? AND (last_used_at < ? OR id < ?)"
            args += [last_used_at, last_used_at, session_id]
        rows = self._read(
            f"SELECT {SESSION_COLS}, (SELECT count(*) FROM session_blocks b WHERE "
            "b.tenant = s.tenant AND b.session_id = s.id) FROM sessions s "
            f"INDEXED BY sessions_recent WHERE {where} "
            "ORDER BY last_used_at DESC, id DESC LIMIT ? OFFSET ?",
            [*args, limit, offset],
        )
        return [row_from(r) for r in rows]

    def count_sessions(self, tenant: str | None = None) -> int:
        """Number of sessions of all tenants, or of ``tenant`` (kept counts: no scan)."""
        name = TOTAL if tenant is None else TENANT + tenant
        rows = self._read("SELECT value FROM counters WHERE name = ?", (name,))
        return int(rows[0][0]) if rows else 0

    def create_session(
        self, tenant: str, session_id: str, *, ttl_seconds: float | None, pinned: bool
    ) -> bool:
        """Insert an empty session; False if it already exists (an expired one that the engine
        has not purged yet counts as gone: it is deleted, its blocks recorded as drops)."""
        now = time.time()
        with self._write() as db:
            old = db.execute(
                "SELECT ttl_seconds, last_used_at FROM sessions WHERE tenant = ? AND id = ?",
                (tenant, session_id),
            ).fetchone()
            if old is not None and old[0] is not None and old[1] + old[0] < now:
                record_drops(db, delete_rows(db, tenant, session_id) or [])
            cur = db.execute(
                "INSERT OR IGNORE INTO sessions (tenant, id, created_at, last_used_at, pinned, "
                "ttl_seconds, managed) VALUES (?, ?, ?, ?, ?, ?, 1)",
                (tenant, session_id, now, now, int(pinned), ttl_seconds),
            )
            if cur.rowcount == 1:
                record_change(db, tenant, session_id)
            return cur.rowcount == 1

    def update_session(
        self,
        tenant: str,
        session_id: str,
        *,
        set_ttl: bool,
        ttl_seconds: float | None,
        pinned: bool | None,
        pin_ttl_s: float | None = None,
    ) -> bool:
        """Change TTL (when ``set_ttl``) and/or pin (``pin_ttl_s``: pinned for that long, then
        an ordinary session again); False if the session is unknown."""
        now = time.time()
        pin_until = None if not pinned or pin_ttl_s is None else now + pin_ttl_s
        with self._write() as db:
            if not live(db, tenant, session_id, now):  # an expired one is gone already
                return False
            db.execute(
                "UPDATE sessions SET managed = 1 WHERE tenant = ? AND id = ?", (tenant, session_id)
            )
            if set_ttl:
                db.execute(
                    "UPDATE sessions SET ttl_seconds = ? WHERE tenant = ? AND id = ?",
                    (ttl_seconds, tenant, session_id),
                )
            if pinned is not None:
                db.execute(
                    "UPDATE sessions SET pinned = ?, pin_until = ? WHERE tenant = ? AND id = ?",
                    (int(pinned), pin_until, tenant, session_id),
                )
            record_change(db, tenant, session_id)
            return True

    def record_turn(
        self,
        tenant: str,
        session_id: str,
        keys: list[str],
        num_tokens: int,
        *,
        default_ttl_s: float | None,
        now: float | None = None,
    ) -> None:
        """Record a finished request of a session: its block list, tokens, turn and gap. A
        session that expired before ``now`` (not purged yet) starts over as a new one."""
        now = time.time() if now is None else now
        with self._write() as db:
            row = db.execute(
                "SELECT turns, last_used_at, gap_count, gap_mean, ttl_seconds FROM sessions "
                "WHERE tenant = ? AND id = ?",
                (tenant, session_id),
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO sessions (tenant, id, num_tokens, turns, created_at, "
                    "last_used_at, ttl_seconds) VALUES (?, ?, ?, 1, ?, ?, ?)",
                    (tenant, session_id, num_tokens, now, now, default_ttl_s),
                )
            elif row[4] is not None and row[1] + row[4] < now:
                # Its superseded blocks stay in the tiers' LRU, as any turn's.
                db.execute(
                    "UPDATE sessions SET num_tokens = ?, turns = 1, created_at = ?, "
                    "last_used_at = ?, pinned = 0, ttl_seconds = ?, gap_count = 0, "
                    "gap_mean = 0, managed = 0, pin_until = NULL WHERE tenant = ? AND id = ?",
                    (num_tokens, now, now, default_ttl_s, tenant, session_id),
                )
            else:
                turns, last_used, gap_count, gap_mean, _ttl = row
                if turns > 0:
                    gap = max(0.0, now - last_used)
                    gap_count += 1
                    gap_mean += (gap - gap_mean) / gap_count
                db.execute(
                    "UPDATE sessions SET num_tokens = ?, turns = turns + 1, last_used_at = ?, "
                    "gap_count = ?, gap_mean = ? WHERE tenant = ? AND id = ?",
                    (num_tokens, now, gap_count, gap_mean, tenant, session_id),
                )
            db.execute(
                "DELETE FROM session_blocks WHERE tenant = ? AND session_id = ?",
                (tenant, session_id),
            )
            db.executemany(
                "INSERT INTO session_blocks (tenant, session_id, idx, key) VALUES (?, ?, ?, ?)",
                [(tenant, session_id, i, k) for i, k in enumerate(keys)],
            )
            record_change(db, tenant, session_id)

    def mark_managed(self, tenant: str, session_id: str) -> None:
        """Note that a client manages the session (e.g. asked to prefetch it on resume)."""
        with self._write() as db:
            db.execute(
                "UPDATE sessions SET managed = 1 WHERE tenant = ? AND id = ?", (tenant, session_id)
            )
            record_change(db, tenant, session_id)

    def pinned_sessions(self, tenant: str, now: float) -> list[SessionRow]:
        """The tenant's sessions pinned at ``now`` (a lapsed lease or an expired session is
        not): a partial index read, O(its pins), with each one's block count."""
        rows = self._read(
            f"SELECT {SESSION_COLS}, (SELECT count(*) FROM session_blocks b WHERE "
            "b.tenant = s.tenant AND b.session_id = s.id) FROM sessions s "
            "WHERE tenant = ? AND pinned = 1 "
            "AND (pin_until IS NULL OR pin_until > ?) "
            "AND (ttl_seconds IS NULL OR last_used_at + ttl_seconds >= ?)",
            (tenant, now, now),
        )
        return [row_from(r) for r in rows]

    def managed_sessions(self, tenant: str) -> list[SessionRow]:
        """The tenant's managed sessions that have not expired: a partial index read,
        O(its managed sessions)."""
        rows = self._read(
            f"SELECT {SESSION_COLS}, (SELECT count(*) FROM session_blocks b WHERE "
            "b.tenant = s.tenant AND b.session_id = s.id) FROM sessions s "
            "WHERE tenant = ? AND managed = 1 "
            "AND (ttl_seconds IS NULL OR last_used_at + ttl_seconds >= ?)",
            (tenant, time.time()),
        )
        return [row_from(r) for r in rows]

    def session_keys(self, tenant: str, session_id: str) -> list[str]:
        """The session's block keys in prefix order."""
        rows = self._read(
            "SELECT key FROM session_blocks WHERE tenant = ? AND session_id = ? ORDER BY idx",
            (tenant, session_id),
        )
        return [r[0] for r in rows]

    def delete_session(self, tenant: str, session_id: str) -> list[str] | None:
        """Delete a session and record its keys no other session references as drops, in one
        transaction; return those keys (None: unknown). The engine removes their files."""
        with self._write() as db:
            orphans = delete_rows(db, tenant, session_id)
            record_drops(db, orphans or [])
            return orphans

    def copy_session(self, tenant: str, source: str, target: str, *, overwrite: bool) -> str:
        """Fork ``source`` into ``target``. Returns "ok", "no_source" or "target_exists". An
        expired source is missing; an expired target is free (deleted, its blocks dropped)."""
        now = time.time()
        with self._write() as db:
            if not live(db, tenant, source, now):
                return "no_source"
            src = db.execute(
                "SELECT num_tokens, turns, pinned, ttl_seconds, gap_count, gap_mean "
                "FROM sessions WHERE tenant = ? AND id = ?",
                (tenant, source),
            ).fetchone()
            exists = db.execute(
                "SELECT ttl_seconds, last_used_at FROM sessions WHERE tenant = ? AND id = ?",
                (tenant, target),
            ).fetchone()
            if exists is not None and exists[0] is not None and exists[1] + exists[0] < now:
                record_drops(db, delete_rows(db, tenant, target) or [])
                exists = None
            if exists is not None and not overwrite:
                return "target_exists"
            if exists is not None:
                # Blocks the old target alone held stay in the tiers' LRU; the engine evicts them.
                delete_rows(db, tenant, target)
            num_tokens, turns, _pinned, ttl, gap_count, gap_mean = src
            db.execute(
                "INSERT INTO sessions (tenant, id, num_tokens, turns, created_at, last_used_at, "
                "pinned, ttl_seconds, gap_count, gap_mean, managed) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?, 1)",
                (tenant, target, num_tokens, turns, now, now, ttl, gap_count, gap_mean),
            )
            db.execute(
                "INSERT INTO session_blocks (tenant, session_id, idx, key) SELECT tenant, ?, idx, "
                "key FROM session_blocks WHERE tenant = ? AND session_id = ?",
                (target, tenant, source),
            )
            record_change(db, tenant, target)
            return "ok"

    def purge_expired(self, now: float | None = None) -> list[str]:
        """Delete every session expired before ``now`` and unpin every session whose pin
        lease lapsed; return the keys no remaining session references. Runs as bounded
        batches (:meth:`purge_expired_batch`), each its own short transaction; with nothing
        due it reads three index entries and takes no write lock."""
        now = time.time() if now is None else now
        return purge_in_batches(self.purge_expired_batch, now)

    def purge_expired_batch(
        self, now: float | None = None, *, limit: int = expiry.PURGE_BATCH
    ) -> tuple[list[str], bool]:
        """One bounded step of :meth:`purge_expired` (:func:`expiry.purge_batch`): (freed
        keys, whether more is due)."""
        now = time.time() if now is None else now
        with self._lock:
            if not expiry.due(self._db, now):
                return [], False
            with self._write() as db:
                return expiry.purge_batch(db, now, limit=limit)

    def policy_snapshot(self) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
        """All sessions and all (tenant, session id, key) references, for the eviction policy
        (the chunks of :meth:`iter_policy_snapshot`, joined)."""
        return join_snapshot(self.iter_policy_snapshot())

    def iter_policy_snapshot(
        self, chunk: int = SNAPSHOT_CHUNK
    ) -> Iterator[tuple[list[SessionRow], list[tuple[str, str, str]]]]:
        """The policy snapshot in chunks of up to ``chunk`` sessions (by tenant and id), each
        with its sessions' (tenant, session id, key) references in block order, each chunk
        read in one short read transaction. Read :meth:`change_seq` before the first chunk:
        a session written while the chunks stream is in :meth:`changes_after` that seq."""
        chunk = max(1, int(chunk))
        after: tuple[str, str] | None = None
        while True:
            with self._lock:
                self._db.execute("BEGIN")
                try:
                    sessions, refs = snapshot_chunk(self._db, after, chunk)
                finally:
                    self._db.execute("COMMIT")
            if sessions:
                yield sessions, refs
            if len(sessions) < chunk:
                return
            after = (sessions[-1].tenant, sessions[-1].id)

    def session_state(self, tenant: str, session_id: str) -> tuple[SessionRow | None, list[str]]:
        """A session's row and block keys, read together (None, []: it is gone)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                return self.get_session(tenant, session_id), self.session_keys(tenant, session_id)
            finally:
                self._db.execute("COMMIT")

    def tier_usage(self, tenant: str, session_id: str) -> dict[str, TierCount]:
        """Blocks and bytes of a session's distinct blocks per tier ("ram", "disk", "redis")."""
        return self.block_usage(self.session_keys(tenant, session_id))
