"""The connection a sync saver keeps between hot-path calls (``plain.HeldConnection``): held
on a roomy pool, given back on a ``pool_size=1`` engine, after a failure and on release."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from langgraph.checkpoint.base import empty_checkpoint
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from langgraph_kvcache.checkpoint.engine import engine_kwargs, normalize_url
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


@contextmanager
def _saver(url: str, **engine_args: Any) -> Iterator[tuple[Any, SQLAlchemySaver, Any]]:
    """(engine, saver, config of a stored checkpoint with a list and a pending write)."""
    parsed = normalize_url(url, asynchronous=False)
    engine = create_engine(parsed, **{**engine_kwargs(parsed), **engine_args})
    try:
        saver = SQLAlchemySaver(engine)
        saver.setup()
        config: Any = {"configurable": {"thread_id": "t1", "checkpoint_ns": ""}}
        version = saver.get_next_version(None, None)
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"messages": ["hello", "world"]}
        checkpoint["channel_versions"] = {"messages": version}
        config = saver.put(config, checkpoint, {"step": 0}, {"messages": version})
        saver.put_writes(config, [("messages", ["again"])], "task-0")
        yield engine, saver, config
        saver.release_connection()
    finally:
        engine.dispose()


def test_saver_holds_one_connection_and_releases_it(db_url: str) -> None:
    with _saver(db_url) as (engine, saver, config):
        assert engine.pool.checkedout() == 1  # kept for the next call
        got = saver.get_tuple(config)
        assert got is not None
        assert got.checkpoint["channel_values"]["messages"] == ["hello", "world"]
        assert engine.pool.checkedout() == 1  # the same one, not a second
        saver.release_connection()
        assert engine.pool.checkedout() == 0
        assert saver.get_tuple(config) is not None  # checks one out again
        saver.release_connection()


def test_pool_size_one_engine_gets_its_connection_back(db_url: str) -> None:
    """With one pooled connection and no overflow, nothing is held: ``list`` and
    ``delete_thread`` (which check a connection out of the pool) do not wait for one."""
    with _saver(db_url, pool_size=1, max_overflow=0, pool_timeout=5) as (engine, saver, config):
        assert engine.pool.checkedout() == 0
        assert saver.get_tuple(config) is not None
        assert [t.config for t in saver.list(None)] == [config]
        saver.delete_thread("t1")
        assert saver.get_tuple(config) is None
        assert engine.pool.checkedout() == 0


def test_a_failed_call_returns_its_connection_to_the_pool(db_url: str) -> None:
    with _saver(db_url) as (engine, saver, config):
        saver.release_connection()
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE checkpoint_writes RENAME TO checkpoint_writes_gone"))
        # The hot path runs on the DBAPI connection, so the driver's own error comes out.
        with pytest.raises((sqlite3.OperationalError, psycopg.ProgrammingError, DBAPIError)):
            saver.get_tuple(config)
        assert engine.pool.checkedout() == 0
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE checkpoint_writes_gone RENAME TO checkpoint_writes"))
        assert saver.get_tuple(config) is not None


def test_engines_of_one_dialect_share_compiled_statements(db_url: str, tmp_path: Any) -> None:
    """A second saver (a new engine, as a saver per request makes) reuses the first one's
    compiled hot statements; SQLite and PostgreSQL never share one."""
    from langgraph_kvcache.checkpoint import plain, queries

    plain._COMPILED.clear()
    latest = {"configurable": {"thread_id": "t1", "checkpoint_ns": ""}}
    with _saver(db_url) as (_, first, _config):
        assert first.get_tuple(latest) is not None
        shape = plain._dialect_shape(first.engine.dialect)
        dialect = first.engine.dialect.name
        compiled = plain._COMPILED[(shape, queries.get_latest(dialect))]
        before = len(plain._COMPILED)
        with _saver(db_url) as (_, second, _config2):
            assert second.engine.dialect is not first.engine.dialect
            assert second.get_tuple(latest) is not None
            assert plain._dialect_shape(second.engine.dialect) == shape
            assert plain._COMPILED[(shape, queries.get_latest(dialect))] is compiled
            assert len(plain._COMPILED) == before
    other = f"sqlite:///{tmp_path / 'other.db'}" if dialect == "postgresql" else None
    if other is not None:
        with _saver(other) as (_, third, _config3):
            assert third.get_tuple(latest) is not None
            assert plain._dialect_shape(third.engine.dialect) != shape
