"""Engines for the checkpointer: URL normalisation and the SQLite connection settings.

Users may pass plain ``sqlite:///x.db`` or ``postgresql://...`` URLs; :func:`normalize_url`
picks the driver the sync or async saver needs (``pysqlite``/``aiosqlite``, ``psycopg``).
:func:`prepare_engine` installs, once per engine, the SQLite listeners the saver relies on:
WAL journal and a busy timeout on file databases, and SQLAlchemy's documented recipe that lets
the saver emit ``BEGIN IMMEDIATE`` itself for write transactions (so two processes writing one
file queue on the lock instead of failing).
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.pool import StaticPool

from langgraph_kvcache.errors import UnsupportedDatabaseError

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite connection waits for another writer's lock before failing."""

BEGIN_OPTION = "lgkv_begin"
"""Execution option read by the SQLite ``begin`` listener: ``"immediate"`` (a write
transaction: take the write lock now), ``"none"`` (no transaction: each statement commits on its
own, for single-statement operations), anything else a plain deferred ``BEGIN``."""

_MARK = "_lgkv_prepared"


def normalize_url(url: str | URL, *, asynchronous: bool) -> URL:
    """Map a plain database URL to the driver the saver uses.

    ``sqlite://`` becomes ``sqlite+pysqlite`` (sync) or ``sqlite+aiosqlite`` (async);
    ``postgresql://`` and ``postgres://`` become ``postgresql+psycopg`` (psycopg 3, sync and
    async). URLs that already name a driver are kept. Anything else raises
    :class:`UnsupportedDatabaseError`.
    """
    if isinstance(url, str) and url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    parsed = make_url(url)
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite":
        default = "aiosqlite" if asynchronous else "pysqlite"
        return parsed.set(drivername="sqlite+" + (driver or default))
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+" + (driver or "psycopg"))
    raise UnsupportedDatabaseError(
        f"Unsupported database URL {parsed.render_as_string(hide_password=True)!r}: use "
        "sqlite:///path.db, sqlite:///:memory: or postgresql://user@host/db"
    )


def is_memory_sqlite(url: URL) -> bool:
    """Whether ``url`` names an in-memory SQLite database (one per connection by default)."""
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def engine_kwargs(url: URL) -> dict[str, Any]:
    """Extra ``create_engine`` arguments for ``url``: one shared connection for ``:memory:``."""
    if is_memory_sqlite(url):
        return {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
    if url.get_backend_name() == "sqlite":
        return {"connect_args": {"check_same_thread": False}}
    return {}


def _set_wal(cursor: Any) -> None:
    """Switch a file database to WAL. Two processes opening a new file at once can see
    ``database is locked`` here without the busy handler being consulted, so retry a while."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def prepare_engine(engine: Engine) -> None:
    """Install the SQLite listeners on ``engine`` (a sync engine or ``AsyncEngine.sync_engine``).

    Idempotent. PostgreSQL engines are left as they are. Connections already in the pool keep
    their old settings, so call this (the savers do) before the engine is first used.
    """
    if engine.dialect.name != "sqlite" or getattr(engine, _MARK, False):
        return
    file_db = not is_memory_sqlite(engine.url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event below emit BEGIN, not the driver.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if file_db:
                _set_wal(cursor)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(BEGIN_OPTION)
        if mode == "immediate":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        elif mode != "none":
            conn.exec_driver_sql("BEGIN")

    setattr(engine, _MARK, True)
