"""Fixtures for the checkpointer tests.

The databases (``pg_admin``, ``new_pg_database``, ``pg_url``, ``sqlite_url``, ``db_url``) come
from tests/conftest.py, shared with the integration tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager

import pytest


@pytest.fixture
def pg_database_factory(
    new_pg_database: Callable[[], AbstractContextManager[str]],
) -> Callable[[], AbstractAsyncContextManager[str]]:
    """Makes fresh PostgreSQL databases on demand: ``async with factory() as url``."""

    @asynccontextmanager
    async def factory() -> AsyncIterator[str]:
        with new_pg_database() as url:
            yield url

    return factory


collect_ignore = ["conformance_main"]
"""The vendored main-branch conformance suite: its ``spec/test_*.py`` run through ``validate``."""
