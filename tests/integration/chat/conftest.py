"""The chat model's integration tests run on ``smollm2_server`` (tests/integration/conftest.py):
the default model, which follows a forced tool choice and a JSON schema."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def kv_server_url(smollm2_server: Any) -> str:
    """Root URL of the SmolLM2 server shared with the agent tests."""
    return str(smollm2_server.base_url).rstrip("/")
