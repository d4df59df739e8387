"""The SQLite registry's two feeds, ``changes`` and ``drops``: what the engines read as
increments (tables of :mod:`server.kv.registry.sql`; writers append to them in their own
transactions, :mod:`server.kv.registry.expiry` trims them).

:class:`FeedTables` is a mixin of :class:`server.kv.registry.Registry`, which owns the
connection (``_read``, ``_write``, ``_lock``, ``_db``).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager

from server.kv.registry.sql import record_drops


class FeedTables:
    """The ``changes`` and ``drops`` feeds over the host's SQLite connection."""

    _lock: threading.RLock
    _db: sqlite3.Connection

    def _read(self, sql: str, args: Iterable[object] = ()) -> list[tuple]:
        raise NotImplementedError  # the host class's

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # the host class's

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
