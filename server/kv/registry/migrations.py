"""The SQLite registry's schema versions: append-only steps after the base schema.

A registry file records how many of :data:`STEPS` it has run in ``PRAGMA user_version``;
:func:`migrate` creates the base tables (:data:`server.kv.registry.sql.SCHEMA`, with the column
additions older files lack) and then runs the steps the file has not run yet, in the opening
writer's transaction. Never edit or reorder a step: add a new one at the end.

Step 1 (scale, issue 26): indexes for expiry (``last_used_at + ttl_seconds``), lapsed pin
leases (``pin_until``) and listings (``tenant, last_used_at DESC, id DESC``), so a purge with
nothing due and any page of a listing are index probes, not scans; and kept session counts
(``counters``: ``sessions`` and ``tenant_sessions<US><tenant>``, maintained by triggers on
``sessions``, so every writer keeps them, older code included).

Step 2 (tenant quotas, issue 27): partial indexes of each tenant's pinned and managed sessions
(``WHERE pinned = 1`` / ``managed = 1``), which the quota checks read.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

TOTAL = "sessions"
"""The ``counters`` row with the number of sessions of every tenant."""
TENANT = "tenant_sessions\x1f"
"""Prefix of the ``counters`` row with one tenant's number of sessions."""
_TENANT_SQL = "'tenant_sessions' || char(31)"

EXPIRES = "last_used_at + ttl_seconds"
"""The expiry expression, written exactly as the expiry index has it (SQLite uses an index on
an expression only for that same expression), with ``ttl_seconds IS NOT NULL`` beside it."""


def _scale_indexes_and_counts(db: sqlite3.Connection) -> None:
    db.execute(
        f"CREATE INDEX IF NOT EXISTS sessions_expiry ON sessions ({EXPIRES}) "
        "WHERE ttl_seconds IS NOT NULL"
    )
    db.execute(
        "CREATE INDEX IF NOT EXISTS sessions_pin_lease ON sessions (pin_until) "
        "WHERE pin_until IS NOT NULL"
    )
    db.execute(
        "CREATE INDEX IF NOT EXISTS sessions_recent "
        "ON sessions (tenant, last_used_at DESC, id DESC)"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL) "
        "WITHOUT ROWID"
    )
    db.execute("DELETE FROM counters WHERE name = ? OR name LIKE ?", (TOTAL, TENANT + "%"))
    db.execute("INSERT INTO counters SELECT ?, count(*) FROM sessions", (TOTAL,))
    db.execute(
        "INSERT INTO counters SELECT ? || tenant, count(*) FROM sessions GROUP BY tenant",
        (TENANT,),
    )
    for event, sign, row in (("INSERT", "+", "NEW"), ("DELETE", "-", "OLD")):
        tenant = f"{_TENANT_SQL} || {row}.tenant"
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS sessions_count_{event.lower()} AFTER {event} ON "
            f"sessions BEGIN "
            f"INSERT OR IGNORE INTO counters VALUES ('{TOTAL}', 0); "
            f"UPDATE counters SET value = value {sign} 1 WHERE name = '{TOTAL}'; "
            f"INSERT OR IGNORE INTO counters VALUES ({tenant}, 0); "
            f"UPDATE counters SET value = value {sign} 1 WHERE name = {tenant}; "
            "END"
        )


def _tenant_flag_indexes(db: sqlite3.Connection) -> None:
    db.execute("CREATE INDEX IF NOT EXISTS sessions_pinned ON sessions (tenant) WHERE pinned = 1")
    db.execute("CREATE INDEX IF NOT EXISTS sessions_managed ON sessions (tenant) WHERE managed = 1")


STEPS: list[Callable[[sqlite3.Connection], None]] = [
    _scale_indexes_and_counts,  # 1: issue 26
    _tenant_flag_indexes,  # 2: issue 27, quotas read a tenant's pinned and managed sessions
]
"""Schema steps after the base schema, in order; ``user_version`` = how many ran."""


def run_steps(db: sqlite3.Connection) -> None:
    """Run the steps this file has not run yet (inside the caller's write transaction)."""
    done = int(db.execute("PRAGMA user_version").fetchone()[0])
    # A file a newer server migrated further is used as it is: steps only add indexes, tables
    # and triggers, which older code neither needs nor breaks.
    for step in STEPS[done:]:
        step(db)
    if done < len(STEPS):
        db.execute(f"PRAGMA user_version = {len(STEPS)}")
