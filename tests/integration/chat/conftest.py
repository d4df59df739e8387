"""The chat model's integration tests run against the integration suite's shared server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kv_server_url(server_url: str) -> str:
    """Root URL of the shared server (``server_url`` of tests/integration/conftest.py)."""
    return server_url.rstrip("/")
