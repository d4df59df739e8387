"""Fixtures for the thread <-> server session tests: saver databases, the model, the index.

The server is the integration suite's shared one (``lgkv_server``, tiny random Llama). The SQL
side runs on ``db_url`` from tests/conftest.py: a fresh SQLite file, then a fresh PostgreSQL
database. The agent and probes are in thread_session_agent.py.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from langgraph_kvcache import ChatKVCache


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
