"""Running the savers' operations on a sync SQLAlchemy connection, and the fast path for
``plain`` statements: their compiled SQL run on the DBAPI connection directly."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import Dialect
from sqlalchemy.pool import PoolProxiedConnection, QueuePool
from sqlalchemy.sql import sqltypes

from langgraph_kvcache.checkpoint.base import Op, Stmt

T = TypeVar("T")


PLAIN_DRIVERS = ("pysqlite", "psycopg")
"""Drivers whose DBAPI connections run ``plain`` statements directly (see :func:`run_op`)."""


def _dialect_shape(dialect: Dialect) -> tuple[Any, ...]:
    """What the compiled SQL of a statement depends on: the dialect's class, parameter style and
    the server facts it learnt on connecting. Engines of the same shape (a saver per request,
    a new process's second engine) share compiled statements."""
    return (
        type(dialect),
        dialect.paramstyle,
        dialect.positional,
        getattr(dialect, "server_version_info", None),
        dialect.label_length,
        dialect.max_identifier_length,
    )


Compiled = tuple[str, tuple[str, ...] | None, dict[str, Any], frozenset[str]]
"""SQL text, positional parameter names (None for named parameter styles), literal parameter
values (e.g. ``LIMIT 1``) and JSON-typed parameter names of a statement."""

_COMPILED: dict[tuple[Any, ...], Compiled] = {}
"""Compiled prebuilt statements by (dialect shape, statement); the statements are built once
per dialect name (and row count), so this stays small."""

_COMPILED_MAX = 1024


def _compiled(dialect: Dialect, statement: Any) -> Compiled:
    """A prebuilt statement compiled once per dialect shape (:func:`_dialect_shape`)."""
    key = (_dialect_shape(dialect), statement)
    found = _COMPILED.get(key)
    if found is None:
        compiled = statement.compile(dialect=dialect)
        fixed = {n: bind.value for n, bind in compiled.binds.items() if bind.value is not None}
        json_names = frozenset(
            n for n, bind in compiled.binds.items() if isinstance(bind.type, sqltypes.JSON)
        )
        names = tuple(compiled.positiontup) if compiled.positional else None
        found = (str(compiled), names, fixed, json_names)
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.clear()
        _COMPILED[key] = found
    return found


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


class HeldConnection:
    """One pooled DBAPI connection kept checked out between a saver's hot-path calls.

    Checking a connection out of SQLAlchemy's pool and back in runs its events and reset logic
    on every call, a measurable share of a small ``get_tuple``; a saver keeps one connection
    instead. :meth:`take` gives the held connection (or a freshly checked-out one while another
    thread has it); :meth:`give` takes it back after a call that ended its transaction: it is
    held again when none is and the pool (a ``QueuePool``) still has an idle slot of its
    ``pool_size`` counting this one (so a ``pool_size=1`` engine, or any other pool class, gets
    every connection back as before); otherwise, and after a call that failed (``ok=False``),
    it goes back to the pool. After a fork the child drops the parent's connection without
    touching it. :meth:`close` returns the held one to the pool.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._held: PoolProxiedConnection | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def take(self) -> PoolProxiedConnection:
        with self._lock:
            raw, self._held = self._held, None
            if raw is not None and self._pid != os.getpid():
                raw = None  # the parent process's connection: never use or close it here
        return raw if raw is not None else self._engine.raw_connection()

    def give(self, raw: PoolProxiedConnection, ok: bool) -> None:
        pool = self._engine.pool
        if ok and isinstance(pool, QueuePool) and pool.checkedout() < pool.size():
            with self._lock:
                if self._held is None:
                    self._held, self._pid = raw, os.getpid()
                    return
        raw.close()

    def close(self) -> None:
        with self._lock:
            raw, self._held = self._held, None
        if raw is not None and self._pid == os.getpid():
            raw.close()
