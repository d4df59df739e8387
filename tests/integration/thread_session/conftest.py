"""Fixtures for the thread <-> server session tests: saver databases, the model, the index.

The server is the integration suite's shared one (``lgkv_server``, tiny random Llama). The SQL
side runs on a fresh SQLite file and a fresh PostgreSQL database (127.0.0.1:5432, trust auth;
skipped with the reason when unreachable). The agent and probes are in thread_session_agent.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from langgraph_kvcache import ChatKVCache

PG_HOST, PG_PORT = "127.0.0.1", 5432


# ----------------------------------------------------------------------------- databases
def _pg_admin() -> str | None:
    import psycopg

    for user in ("postgres", "root"):
        for dbname in ("postgres", "test"):
            conninfo = f"host={PG_HOST} port={PG_PORT} user={user} dbname={dbname}"
            try:
                with psycopg.connect(conninfo, connect_timeout=3):
                    return conninfo
            except psycopg.Error:
                continue
    return None


@contextmanager
def _fresh_pg_database(admin: str) -> Iterator[str]:
    import psycopg

    name = f"lgkv_ts_{uuid.uuid4().hex[:12]}"
    user = dict(part.split("=", 1) for part in admin.split())["user"]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://{user}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database for the saver: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'checkpoints.db'}"
        return
    admin = _pg_admin()
    if admin is None:
        pytest.skip(f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT}")
    with _fresh_pg_database(admin) as url:
        yield url


@pytest.fixture(scope="session")
def wiki_index() -> Any:
    """The offline Wikipedia index of ``examples/rag.py`` (embeddings cached on disk)."""
    try:
        from examples.rag import WikiIndex
    except ImportError as exc:
        pytest.skip(f"examples/rag.py needs its packages: {exc}")
    try:
        return WikiIndex.build()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def kv_model(lgkv_server: Any) -> ChatKVCache:
    """ChatKVCache on the shared server (greedy, so a thread's turns are reproducible)."""
    return ChatKVCache(base_url=f"{lgkv_server.base_url}/v1", model=lgkv_server.model, timeout=120)


@pytest.fixture
def run_id() -> str:
    """A fresh id for this test's threads and system prompt."""
    return uuid.uuid4().hex[:10]
