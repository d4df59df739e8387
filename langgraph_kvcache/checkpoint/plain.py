"""Running the savers' operations on a sync SQLAlchemy connection, and the fast path for
``plain`` statements: their compiled SQL run on the DBAPI connection directly."""

from __future__ import annotations

import functools
import json
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import sqltypes

from langgraph_kvcache.checkpoint.base import Op, Stmt

T = TypeVar("T")


PLAIN_DRIVERS = ("pysqlite", "psycopg")
"""Drivers whose DBAPI connections run ``plain`` statements directly (see :func:`run_op`)."""


@functools.cache
def _compiled(
    dialect: Dialect, statement: Any
) -> tuple[str, tuple[str, ...] | None, dict[str, Any], frozenset[str]]:
    """SQL text, positional parameter names (None for named parameter styles), literal
    parameter values (e.g. ``LIMIT 1``) and JSON-typed parameter names of a prebuilt statement,
    compiled once."""
    compiled = statement.compile(dialect=dialect)
    fixed = {name: bind.value for name, bind in compiled.binds.items() if bind.value is not None}
    json_names = frozenset(
        name for name, bind in compiled.binds.items() if isinstance(bind.type, sqltypes.JSON)
    )
    names = tuple(compiled.positiontup) if compiled.positional else None
    return str(compiled), names, fixed, json_names


def run_plain(dialect: Dialect, driver: Any, stmt: Stmt) -> list[Any]:
    """Run a ``plain`` statement on the DBAPI connection: skips SQLAlchemy's per-call execution
    overhead (tens of microseconds), much of a small query's cost. The SQL is SQLAlchemy's own
    compilation of the statement, cached; JSON parameters are dumped as SQLAlchemy would."""
    sql, names, fixed, json_names = _compiled(dialect, stmt.statement)

    def bind(params: dict[str, Any]) -> Any:
        merged = {**fixed, **params}
        for name in json_names:
            merged[name] = json.dumps(merged[name])
        return merged if names is None else [merged[n] for n in names]

    cursor = driver.cursor()
    try:
        if isinstance(stmt.params, list):
            cursor.executemany(sql, [bind(row) for row in stmt.params])
            return []
        cursor.execute(sql, bind(stmt.params or {}))
        if not stmt.fetch:
            return []
        columns = [d[0] for d in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    finally:
        cursor.close()


def run_op(conn: Connection, op: Op[T]) -> T:
    """Run an operation's statements on ``conn``; returns the operation's result.

    ``plain`` statements run straight on the DBAPI connection (SQLite's ``sqlite3``,
    PostgreSQL's psycopg), inside the same transaction state as the SQLAlchemy connection.
    """
    plain_ok = conn.dialect.driver in PLAIN_DRIVERS
    try:
        stmt = next(op)
        while True:
            if stmt.plain and plain_ok:
                rows = run_plain(conn.dialect, conn.connection.driver_connection, stmt)
            else:
                result = conn.execute(stmt.statement, stmt.params)
                rows = list(result.mappings()) if stmt.fetch else []
            stmt = op.send(rows)
    except StopIteration as stop:
        return stop.value
