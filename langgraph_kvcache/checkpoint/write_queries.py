"""The saver's write statements, built once per dialect (and row count) and reused.

On PostgreSQL one statement per ``put``/``put_writes`` whatever the row count (extra rows as
data-modifying CTEs), atomic without a transaction; on SQLite one-row inserts run with
executemany inside a transaction. The read statements are in :mod:`.queries`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, items, writes

_BLOB_COLUMNS = (
    "thread_id",
    "checkpoint_ns",
    "channel",
    "version",
    "type",
    "blob",
    "base_version",
    "since_snapshot",
)
_ITEM_COLUMNS = ("thread_id", "checkpoint_ns", "item", "type", "blob")
_WRITE_COLUMNS = (
    "thread_id",
    "checkpoint_ns",
    "checkpoint_id",
    "task_id",
    "task_path",
    "idx",
    "channel",
    "type",
    "blob",
)
_CHECKPOINT_COLUMNS = (
    "thread_id",
    "checkpoint_ns",
    "checkpoint_id",
    "parent_checkpoint_id",
    "run_id",
    "type",
    "checkpoint",
    "metadata",
    "blob_versions",
)
_WRITE_KEY = ["thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"]


def _insert(dialect: str, table: Any) -> Any:
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(table)


def _one_row(dialect: str, table: Any, columns: tuple[str, ...], prefix: str, conflict: Any) -> Any:
    """``INSERT INTO table VALUES (:<prefix><col>, ...)`` with ``conflict`` applied to it."""
    stmt = _insert(dialect, table).values({col: bindparam(prefix + col) for col in columns})
    return conflict(stmt)


def _rows(dialect: str, table: Any, columns: tuple[str, ...], n: int, conflict: Any) -> Any:
    """An INSERT of ``n`` rows as one cacheable statement.

    SQLite: the one-row statement, run with executemany (``n`` ignored). PostgreSQL: the first
    row's INSERT with one data-modifying CTE per further row, each a one-row INSERT, so any
    number of rows is one statement and one round trip, with bind parameters ``r<i>_<column>``
    (see :func:`row_params`). One-row statements keep ``bytea`` parameters in psycopg's binary
    format, which ``unnest`` over arrays would not.
    """
    if dialect != "postgresql":
        return _one_row(dialect, table, columns, "", conflict)
    stmt = _one_row(dialect, table, columns, "r0_", conflict)
    for i in range(1, n):
        row = _one_row(dialect, table, columns, f"r{i}_", conflict)
        stmt = stmt.add_cte(row.cte(f"{table.name}_{i}"))
    return stmt


def row_params(dialect: str, rows: list[dict[str, Any]]) -> Any:
    """Parameters of a :func:`_rows` statement: the rows (SQLite) or ``r<i>_<column>``."""
    if dialect != "postgresql":
        return rows
    return {f"r{i}_{col}": value for i, row in enumerate(rows) for col, value in row.items()}


def _keep(stmt: Any) -> Any:
    return stmt.on_conflict_do_nothing()


def _upsert_checkpoint(stmt: Any) -> Any:
    return stmt.on_conflict_do_update(
        index_elements=["thread_id", "checkpoint_ns", "checkpoint_id"],
        set_={
            col: stmt.excluded[col]
            for col in ("type", "checkpoint", "metadata", "blob_versions", "run_id")
        },
    )


def _upsert_write(stmt: Any) -> Any:
    return stmt.on_conflict_do_update(
        index_elements=_WRITE_KEY,
        set_={col: stmt.excluded[col] for col in ("channel", "type", "blob")},
    )


PUT_INLINE_ITEMS = 8
"""Most new list items a PostgreSQL ``put`` carries in its own statement; more go first in an
``executemany`` of :func:`insert_items` (in the same transaction)."""


@cache
def put_checkpoint(dialect: str, n_blobs: int, n_items: int = 0) -> Any:
    """Upsert ``:<column>`` into checkpoints; on PostgreSQL also insert ``n_blobs`` new blobs
    (parameters ``r<i>_<column>``) and ``n_items`` new list items (``i<i>_<column>``).

    On PostgreSQL the blobs and items are data-modifying CTEs, so a ``put`` is one atomic
    statement: one round trip in autocommit mode. On SQLite they are separate statements
    (:func:`insert_blobs`, :func:`insert_items`) and ``n_blobs`` and ``n_items`` must be 0.
    """
    stmt = _one_row(dialect, checkpoints, _CHECKPOINT_COLUMNS, "", _upsert_checkpoint)
    for i in range(n_items):
        item = _one_row(dialect, items, _ITEM_COLUMNS, f"i{i}_", _keep)
        stmt = stmt.add_cte(item.cte(f"new_item_{i}"))
    for i in range(n_blobs):
        blob = _one_row(dialect, blobs, _BLOB_COLUMNS, f"r{i}_", _keep)
        stmt = stmt.add_cte(blob.cte(f"new_blob_{i}"))
    return stmt


def item_params(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Parameters ``i<i>_<column>`` of the items of a PostgreSQL :func:`put_checkpoint`."""
    return {f"i{i}_{col}": value for i, row in enumerate(rows) for col, value in row.items()}


@cache
def insert_items(dialect: str) -> Any:
    """Insert one list item (run with executemany), keeping an item already stored."""
    return _one_row(dialect, items, _ITEM_COLUMNS, "", _keep)


@cache
def insert_blobs(dialect: str, n_blobs: int) -> Any:
    """Insert ``n_blobs`` blob rows, keeping versions already stored."""
    return _rows(dialect, blobs, _BLOB_COLUMNS, n_blobs, _keep)


@cache
def insert_writes(dialect: str, n_writes: int, upsert: bool, n_items: int = 0) -> Any:
    """Insert ``n_writes`` write rows. ``upsert`` (all writes special) replaces an existing write
    at the same key; otherwise the existing one is kept, as in the PostgreSQL saver. On
    PostgreSQL also ``n_items`` list items (``i<i>_<column>``) as data-modifying CTEs."""
    stmt = _rows(dialect, writes, _WRITE_COLUMNS, n_writes, _upsert_write if upsert else _keep)
    for i in range(n_items):
        item = _one_row(dialect, items, _ITEM_COLUMNS, f"i{i}_", _keep)
        stmt = stmt.add_cte(item.cte(f"new_item_{i}"))
    return stmt
