"""Session-aware KV cache connector for vLLM: RAM and disk tiers keyed by block hash.

``server.kv.connector.SessionKVConnector`` is loaded by vLLM through
``kv_connector_module_path="server.kv.connector"``; the API process uses
:mod:`server.kv.registry.control`. Importing this package does not import torch or vLLM.
"""

from server.kv.registry.control import (
    InvalidSessionId,
    Session,
    SessionControl,
    SessionExists,
    SessionNotFound,
    TierUsage,
)

__all__ = [
    "InvalidSessionId",
    "Session",
    "SessionControl",
    "SessionExists",
    "SessionNotFound",
    "TierUsage",
]
