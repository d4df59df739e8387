"""TTL expiry and pin-lease lapses in the SQLite registry, in bounded batches.

The engine's registry thread purges every 10 s (:meth:`server.kv.registry.Registry.
purge_expired`). With a million sessions neither a scan nor one long transaction will do:

- :func:`due` says, with three index probes and no lock, whether anything is to be done (an
  expired session, a lapsed lease, a feed longer than it is kept), so the common purge (nothing
  due) never takes the write lock;
- :func:`purge_batch` runs inside one writer's transaction and does at most ``limit`` sessions
  of each kind, stopping early once it held the lock for ``budget_s`` (at least one session,
  so it always makes progress), and trims at most :data:`TRIM_BATCH` feed rows of each feed.
  The caller loops, committing between batches, so other writers (the API process, the
  engine's turns) get the lock between them.
"""

from __future__ import annotations

import sqlite3
import time

from server.kv.registry.migrations import EXPIRES
from server.kv.registry.sql import DROPS_KEPT, delete_rows, record_change, record_drops

PURGE_BATCH = 200
"""Most sessions a purge deletes (and leases it lifts) in one transaction."""
PURGE_BUDGET_S = 0.004
"""How long one purge transaction goes on deleting before it commits and lets others in."""
TRIM_BATCH = 5_000
"""Most ``drops`` / ``changes`` rows one purge transaction trims from each feed."""

_EXPIRED = f"FROM sessions WHERE ttl_seconds IS NOT NULL AND {EXPIRES} < ?"
_LAPSED = "FROM sessions WHERE pin_until IS NOT NULL AND pin_until < ?"
_FEEDS = ("drops", "changes")


def _span(table: str) -> str:
    """SQL for a feed's newest minus oldest seq (two rowid probes: SQLite reads ``min`` and
    ``max`` from the index only when each is alone in its query)."""
    return f"(SELECT max(seq) FROM {table}) - (SELECT min(seq) FROM {table})"


def due(db: sqlite3.Connection, now: float) -> bool:
    """Whether a purge at ``now`` has anything to do (index probes; no write lock)."""
    row = db.execute(
        f"SELECT EXISTS (SELECT 1 {_EXPIRED}), EXISTS (SELECT 1 {_LAPSED}), "
        f"{_span('drops')}, {_span('changes')}",
        (now, now),
    ).fetchone()
    return bool(row[0] or row[1] or any(n is not None and n >= DROPS_KEPT for n in row[2:]))


def purge_batch(
    db: sqlite3.Connection,
    now: float,
    *,
    limit: int = PURGE_BATCH,
    budget_s: float = PURGE_BUDGET_S,
) -> tuple[list[str], bool]:
    """One bounded purge step in the caller's write transaction: delete up to ``limit`` of
    the sessions expired before ``now`` (earliest expiry first), record the keys no session
    references any more as drops, lift up to ``limit`` lapsed leases, trim the feeds a little.
    Returns (the freed keys, whether more is due)."""
    start = time.monotonic()
    limit = max(1, int(limit))
    expired = db.execute(
        f"SELECT tenant, id {_EXPIRED} ORDER BY {EXPIRES} LIMIT ?", (now, limit + 1)
    ).fetchall()
    more = len(expired) > limit
    freed: list[str] = []
    for n, (tenant, sid) in enumerate(expired[:limit]):
        if n and time.monotonic() - start > budget_s:
            more = True
            break
        freed.extend(delete_rows(db, tenant, sid) or [])
    freed = sorted(set(freed))
    record_drops(db, freed)
    lapsed = db.execute(f"SELECT tenant, id {_LAPSED} LIMIT ?", (now, limit + 1)).fetchall()
    more = more or len(lapsed) > limit
    for tenant, sid in lapsed[:limit]:  # leases that ran out: ordinary sessions again
        db.execute(
            "UPDATE sessions SET pinned = 0, pin_until = NULL WHERE tenant = ? AND id = ?",
            (tenant, sid),
        )
        record_change(db, tenant, sid)
    for table in _FEEDS:  # a bounded history: engines read the feeds within seconds
        more = _trim(db, table) or more
    return freed, more


def _trim(db: sqlite3.Connection, table: str) -> bool:
    """Drop up to :data:`TRIM_BATCH` of the oldest rows beyond the newest ``DROPS_KEPT``;
    True if more are beyond it still."""
    low, high = db.execute(
        f"SELECT (SELECT min(seq) FROM {table}), (SELECT max(seq) FROM {table})"
    ).fetchone()
    if low is None or high - DROPS_KEPT < low:
        return False
    cut = min(high - DROPS_KEPT, low + TRIM_BATCH - 1)
    db.execute(f"DELETE FROM {table} WHERE seq <= ?", (cut,))
    return cut < high - DROPS_KEPT
