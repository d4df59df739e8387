"""The append-only list of schema migrations that ``setup()`` runs.

A migration's position in :data:`MIGRATIONS` is its version number, recorded in the
``checkpoint_migrations`` table once applied. Never edit or reorder a released migration:
append a new one. Each migration is written out for each supported dialect (SQLite and
PostgreSQL) so that it stays frozen even when :mod:`.schema` changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    """One schema change, as SQL per dialect."""

    description: str
    """What the migration does, for logs and reviews."""
    sql: tuple[str, ...]
    """Statements, with ``{json}`` and ``{bytes}`` standing for the dialect's column types."""


_TYPES = {
    "sqlite": {"json": "JSON", "bytes": "BLOB"},
    "postgresql": {"json": "JSONB", "bytes": "BYTEA"},
}

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "the migrations table itself",
        ("CREATE TABLE IF NOT EXISTS checkpoint_migrations (v INTEGER PRIMARY KEY)",),
    ),
    Migration(
        "checkpoints, blobs and writes",
        (
            """CREATE TABLE IF NOT EXISTS checkpoints (
                thread_id TEXT NOT NULL,
                checkpoint_ns TEXT NOT NULL DEFAULT '',
                checkpoint_id TEXT NOT NULL,
                parent_checkpoint_id TEXT,
                run_id TEXT,
                type TEXT NOT NULL,
                checkpoint {bytes} NOT NULL,
                metadata {json} NOT NULL,
                blob_versions {json} NOT NULL,
                PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
            )""",
            """CREATE TABLE IF NOT EXISTS checkpoint_blobs (
                thread_id TEXT NOT NULL,
                checkpoint_ns TEXT NOT NULL DEFAULT '',
                channel TEXT NOT NULL,
                version TEXT NOT NULL,
                type TEXT NOT NULL,
                blob {bytes},
                PRIMARY KEY (thread_id, checkpoint_ns, channel, version)
            )""",
            """CREATE TABLE IF NOT EXISTS checkpoint_writes (
                thread_id TEXT NOT NULL,
                checkpoint_ns TEXT NOT NULL DEFAULT '',
                checkpoint_id TEXT NOT NULL,
                task_id TEXT NOT NULL,
                idx INTEGER NOT NULL,
                task_path TEXT NOT NULL DEFAULT '',
                channel TEXT NOT NULL,
                type TEXT,
                blob {bytes} NOT NULL,
                PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
            )""",
        ),
    ),
    Migration(
        "index for delete_for_runs",
        (
            "CREATE INDEX IF NOT EXISTS checkpoints_run_id_idx ON checkpoints (run_id) "
            "WHERE run_id IS NOT NULL",
        ),
    ),
    Migration(
        "KV-cache server sessions of threads, and the outbox of pending session calls",
        (
            """CREATE TABLE IF NOT EXISTS checkpoint_kv_sessions (
                thread_id TEXT NOT NULL,
                checkpoint_ns TEXT NOT NULL DEFAULT '',
                session_id TEXT NOT NULL,
                last_used_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (thread_id, checkpoint_ns)
            )""",
            "CREATE INDEX IF NOT EXISTS checkpoint_kv_sessions_last_used_idx "
            "ON checkpoint_kv_sessions (last_used_at)",
            """CREATE TABLE IF NOT EXISTS checkpoint_kv_outbox (
                id TEXT PRIMARY KEY,
                op TEXT NOT NULL,
                session_id TEXT NOT NULL,
                target_id TEXT,
                attempts INTEGER NOT NULL DEFAULT 0,
                last_error TEXT
            )""",
        ),
    ),
    Migration(
        "append-aware list storage: items stored once, list versions as digests (delta chains)",
        (
            """CREATE TABLE IF NOT EXISTS checkpoint_items (
                thread_id TEXT NOT NULL,
                checkpoint_ns TEXT NOT NULL DEFAULT '',
                item {bytes} NOT NULL,
                type TEXT NOT NULL,
                blob {bytes} NOT NULL,
                PRIMARY KEY (thread_id, checkpoint_ns, item)
            )""",
            # Nullable: rows written before this migration keep NULL and read as they did.
            "ALTER TABLE checkpoint_blobs ADD COLUMN base_version TEXT",
            "ALTER TABLE checkpoint_blobs ADD COLUMN since_snapshot INTEGER",
        ),
    ),
    Migration(
        "stored format 2, no schema change: checkpoint bodies and list items may be stored "
        "compressed (type prefix 'z1:'), list-valued pending writes as item digests (type "
        "'lgkv.items'), bodies with the id left to the checkpoint_id column, 29-character "
        "channel versions. Rows written before read as they did; this version number keeps "
        "older langgraph-kvcache releases, which cannot read the new rows, off the database",
        (),
    ),
)


def statements_for(migration: Migration, dialect: str) -> list[str]:
    """The migration's SQL for ``dialect`` (``"sqlite"`` or ``"postgresql"``)."""
    types = _TYPES[dialect]
    return [sql.format(**types) for sql in migration.sql]
