"""Fixtures for the checkpointer tests: fresh SQLite files and fresh PostgreSQL databases.

PostgreSQL tests use the server on 127.0.0.1:5432 (trust auth). Each database is created as
``lgkv_<random>`` with psycopg in autocommit mode from the ``postgres`` (or ``test``) database
and dropped at teardown. If the server is unreachable the PostgreSQL tests are skipped with the
reason; everything else runs.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path

import pytest

PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_USERS = ("postgres", "root")
PG_ADMIN_DBS = ("postgres", "test")


def _admin_conninfo() -> str | None:
    """A working conninfo to an admin database, or None when the server is unreachable."""
    import psycopg

    for user in PG_USERS:
        for dbname in PG_ADMIN_DBS:
            conninfo = f"host={PG_HOST} port={PG_PORT} user={user} dbname={dbname}"
            try:
                with psycopg.connect(conninfo, connect_timeout=3):
                    return conninfo
            except psycopg.Error:
                continue
    return None


@pytest.fixture(scope="session")
def pg_admin() -> str:
    """Admin conninfo for the local PostgreSQL server; skips the test when it is unreachable."""
    conninfo = _admin_conninfo()
    if conninfo is None:
        pytest.skip(f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT} (users {PG_USERS})")
    return conninfo


def _user_of(conninfo: str) -> str:
    return dict(part.split("=", 1) for part in conninfo.split())["user"]


@contextmanager
def fresh_pg_database(admin: str) -> Iterator[str]:
    """Create ``lgkv_<random>``, yield its ``postgresql://`` URL, drop it afterwards."""
    import psycopg

    name = f"lgkv_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://{_user_of(admin)}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_database_factory(pg_admin: str) -> Callable[[], AbstractAsyncContextManager[str]]:
    """Makes fresh PostgreSQL databases on demand: ``async with factory() as url``."""

    @asynccontextmanager
    async def factory() -> AsyncIterator[str]:
        with fresh_pg_database(pg_admin) as url:
            yield url

    return factory


@pytest.fixture
def pg_url(pg_admin: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    with fresh_pg_database(pg_admin) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file for one test."""
    return f"sqlite:///{tmp_path / 'checkpoints.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database of each kind: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'checkpoints.db'}"
        return
    admin = request.getfixturevalue("pg_admin")
    with fresh_pg_database(admin) as url:
        yield url
