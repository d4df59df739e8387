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

from server.kv.registry.local import LocalTables
from server.kv.registry.sql import (
    DROPS_KEPT,
    SESSION_COLS,
    SessionRow,
    TierCount,
    delete_rows,
    migrate,
    record_change,
    record_drops,
    row_from,
)

__all__ = ["Registry", "SessionRow", "TierCount"]


class Registry(LocalTables):
    """Typed access to the registry file; safe for several threads and several processes."""

    def __init__(self, path: Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
        """The session, or None if unknown (expired sessions are purged by the caller)."""
        rows = self._read(
            f"SELECT {SESSION_COLS}, (SELECT count(*) FROM session_blocks b WHERE "
            "b.tenant = s.tenant AND b.session_id = s.id) FROM sessions s "
            "WHERE tenant = ? AND id = ?",
            (tenant, session_id),
        )
        return row_from(rows[0]) if rows else None

    def list_sessions(self, tenant: str, limit: int, offset: int) -> list[SessionRow]:
        """A tenant's sessions, most recently used first."""
        rows = self._read(
            f"SELECT {SESSION_COLS}, (SELECT count(*) FROM session_blocks b WHERE "
            "b.tenant = s.tenant AND b.session_id = s.id) FROM sessions s WHERE tenant = ? "
            "ORDER BY last_used_at DESC, id LIMIT ? OFFSET ?",
            (tenant, limit, offset),
        )
        return [row_from(r) for r in rows]

    def count_sessions(self) -> int:
        """Number of sessions of all tenants."""
        return int(self._read("SELECT count(*) FROM sessions")[0][0])

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
        pin_until = None if not pinned or pin_ttl_s is None else time.time() + pin_ttl_s
        with self._write() as db:
            found = db.execute(
                "SELECT 1 FROM sessions WHERE tenant = ? AND id = ?", (tenant, session_id)
            ).fetchone()
            if found is None:
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
        """Record a finished request of a session: its block list, tokens, turn and gap."""
        now = time.time() if now is None else now
        with self._write() as db:
            row = db.execute(
                "SELECT turns, last_used_at, gap_count, gap_mean FROM sessions "
                "WHERE tenant = ? AND id = ?",
                (tenant, session_id),
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO sessions (tenant, id, num_tokens, turns, created_at, "
                    "last_used_at, ttl_seconds) VALUES (?, ?, ?, 1, ?, ?, ?)",
                    (tenant, session_id, num_tokens, now, now, default_ttl_s),
                )
            else:
                turns, last_used, gap_count, gap_mean = row
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
        """Fork ``source`` into ``target``. Returns "ok", "no_source" or "target_exists"."""
        now = time.time()
        with self._write() as db:
            src = db.execute(
                "SELECT num_tokens, turns, pinned, ttl_seconds, gap_count, gap_mean "
                "FROM sessions WHERE tenant = ? AND id = ?",
                (tenant, source),
            ).fetchone()
            if src is None:
                return "no_source"
            exists = db.execute(
                "SELECT 1 FROM sessions WHERE tenant = ? AND id = ?", (tenant, target)
            ).fetchone()
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
        """Delete every expired session and unpin every session whose pin lease lapsed; return
        the keys no remaining session references."""
        now = time.time() if now is None else now
        with self._write() as db:
            expired = db.execute(
                "SELECT tenant, id FROM sessions WHERE ttl_seconds IS NOT NULL "
                "AND last_used_at + ttl_seconds < ?",
                (now,),
            ).fetchall()
            orphans: list[str] = []
            for tenant, sid in expired:
                orphans.extend(delete_rows(db, tenant, sid) or [])
            record_drops(db, sorted(set(orphans)))
            lapsed = db.execute(
                "SELECT tenant, id FROM sessions WHERE pin_until IS NOT NULL AND pin_until < ?",
                (now,),
            ).fetchall()
            for tenant, sid in lapsed:  # leases that ran out: ordinary sessions again
                db.execute(
                    "UPDATE sessions SET pinned = 0, pin_until = NULL WHERE tenant = ? AND id = ?",
                    (tenant, sid),
                )
                record_change(db, tenant, sid)
            # Bounded history of drops: engines read them within seconds of their writing.
            for table in ("drops", "changes"):
                db.execute(
                    f"DELETE FROM {table} WHERE seq <= (SELECT max(seq) FROM {table}) - ?",
                    (DROPS_KEPT,),
                )
            return sorted(set(orphans))

    def policy_snapshot(self) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
        """All sessions and all (tenant, session id, key) references, for the eviction policy."""
        sessions = [row_from((*r, 0)) for r in self._read(f"SELECT {SESSION_COLS} FROM sessions")]
        refs = self._read(
            "SELECT tenant, session_id, key FROM session_blocks ORDER BY tenant, session_id, idx"
        )
        return sessions, [(t, s, k) for t, s, k in refs]

    def change_seq(self) -> int:
        """The newest ``changes`` sequence number (0 when none)."""
        return int(self._read("SELECT coalesce(max(seq), 0) FROM changes")[0][0])

    def changes_after(self, seq: int) -> tuple[int, list[tuple[str, str]] | None]:
        """Sessions written after ``seq``: (the newest seq, distinct (tenant, id) in order of
        their last change). None instead of the list when rows after ``seq`` were trimmed
        already (the caller reloads :meth:`policy_snapshot`)."""
        with self._lock:
            oldest = self._db.execute("SELECT min(seq) FROM changes").fetchone()[0]
            rows = self._db.execute(
                "SELECT seq, tenant, session_id FROM changes WHERE seq > ? ORDER BY seq", (seq,)
            ).fetchall()
        if not rows:
            return seq, []
        if oldest is not None and oldest > seq + 1:
            return rows[-1][0], None
        latest = {(t, s): q for q, t, s in rows}
        return rows[-1][0], sorted(latest, key=latest.__getitem__)

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

    # -------------------------------------------------------------------- drops

    def add_drops(self, keys: Iterable[str]) -> None:
        """Record freed block keys for the engine (which drops them in every tier)."""
        with self._write() as db:
            record_drops(db, keys)

    def drops_after(self, seq: int) -> tuple[int, list[str]]:
        """Drops newer than ``seq``: (the newest seq, their keys)."""
        rows = self._read("SELECT seq, key FROM drops WHERE seq > ? ORDER BY seq", (seq,))
        return (rows[-1][0] if rows else seq), [r[1] for r in rows]

    def last_drop_seq(self) -> int:
        """The newest drop sequence number (0 when none)."""
        return int(self._read("SELECT coalesce(max(seq), 0) FROM drops")[0][0])

    def resume_drops(self) -> int:
        """A starting engine reads drops recorded from now on (the API process that records
        them runs beside it, and stops with it)."""
        return self.last_drop_seq()

    def drops_read(self, seq: int) -> None:
        """Nothing to save: :meth:`resume_drops` starts at the newest drop."""
