"""LangGraph checkpointers on SQLAlchemy 2.0 (SQLite and PostgreSQL, sync and async).

- :class:`SQLAlchemySaver` (:mod:`.sync`) on an ``Engine``;
- :class:`AsyncSQLAlchemySaver` (:mod:`.aio`) on an ``AsyncEngine`` (needs ``greenlet``,
  i.e. ``sqlalchemy[asyncio]``).

Both share :mod:`.base` (the operations), :mod:`.codec` (rows <-> tuples), :mod:`.schema`
(typed tables), :mod:`.migrations` (append-only, run by ``setup()``) and :mod:`.engine`
(URL and SQLite connection settings). Imported lazily, so the sync saver never needs asyncio
extras.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SQLAlchemySaver": "langgraph_kvcache.checkpoint.sync",
    "AsyncSQLAlchemySaver": "langgraph_kvcache.checkpoint.aio",
}

__all__ = ["AsyncSQLAlchemySaver", "SQLAlchemySaver"]

if TYPE_CHECKING:
    from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
    from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'langgraph_kvcache.checkpoint' has no attribute {name!r}")
    return getattr(import_module(module), name)
