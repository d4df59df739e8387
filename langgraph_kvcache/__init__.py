"""langgraph-kvcache: a LangGraph checkpointer on SQLAlchemy whose threads own KV-cache sessions.

Public API (imported lazily, so ``import langgraph_kvcache`` stays light and never imports
torch or vLLM):

- :class:`SQLAlchemySaver` / :class:`AsyncSQLAlchemySaver`: the checkpointers.
- :class:`ChatKVCache`: the LangChain chat model for the bundled server.
- :class:`KVCacheClient` / :class:`AsyncKVCacheClient`: the session API client.
- :func:`trim_messages_stepped` / :class:`SteppedTrimMiddleware`: trimming that keeps the
  prompt's prefix, so the server still reuses the KV (the middleware needs ``langchain``).
- :class:`CachedSummarizationMiddleware`: LangChain's summarization with a summary call that
  continues the conversation, so the server reads the history from the cache.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "SQLAlchemySaver": "langgraph_kvcache.checkpoint.sync",
    "AsyncSQLAlchemySaver": "langgraph_kvcache.checkpoint.aio",
    "ChatKVCache": "langgraph_kvcache.chat_model",
    "KVCacheClient": "langgraph_kvcache.client",
    "AsyncKVCacheClient": "langgraph_kvcache.client",
    "session_id_for": "langgraph_kvcache.sessions",
    "trim_messages_stepped": "langgraph_kvcache.trim",
    "SteppedTrimMiddleware": "langgraph_kvcache.middleware",
    "CachedSummarizationMiddleware": "langgraph_kvcache.middleware",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from langgraph_kvcache.chat_model import ChatKVCache as ChatKVCache
    from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver as AsyncSQLAlchemySaver
    from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver as SQLAlchemySaver
    from langgraph_kvcache.client import AsyncKVCacheClient as AsyncKVCacheClient
    from langgraph_kvcache.client import KVCacheClient as KVCacheClient
    from langgraph_kvcache.middleware import (
        CachedSummarizationMiddleware as CachedSummarizationMiddleware,
    )
    from langgraph_kvcache.middleware import SteppedTrimMiddleware as SteppedTrimMiddleware
    from langgraph_kvcache.sessions import session_id_for as session_id_for
    from langgraph_kvcache.trim import trim_messages_stepped as trim_messages_stepped


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'langgraph_kvcache' has no attribute {name!r}")
    return getattr(import_module(module), name)
