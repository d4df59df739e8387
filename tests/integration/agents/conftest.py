"""Agent-loop tests run on ``smollm2_server`` (tests/integration/conftest.py): the default model,
32-token KV blocks, a resident cache smaller than four agent threads. Tools: agent_tools.py."""

from __future__ import annotations

from typing import Any

import pytest
from agent_tools import articles

from langgraph_kvcache import ChatKVCache


@pytest.fixture(scope="session")
def wiki() -> dict[str, str]:
    """The Wikipedia articles the tools read (skips when the data is not installed)."""
    return articles()


@pytest.fixture
def agent_model(wiki: dict[str, str], smollm2_server: Any) -> ChatKVCache:
    """Greedy ChatKVCache on the SmolLM2 server, short answers."""
    return ChatKVCache(
        base_url=f"{smollm2_server.base_url}/v1",
        model=smollm2_server.model,
        max_tokens=64,
        timeout=120,
    )


@pytest.fixture
def run_id() -> str:
    """A fresh id for this test's sessions and threads."""
    import uuid

    return uuid.uuid4().hex[:10]
