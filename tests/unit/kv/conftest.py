"""Fixtures of the connector's unit tests: the registry backends (see ``registries.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from registries import Backend, make_backend


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """The SQLite registry, then sessions in the real Redis (db 11, a fresh namespace)."""
    b = make_backend(request.param, tmp_path)
    yield b
    b.clear()
