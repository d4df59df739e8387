"""What the server hands the KV connector: the ``kv_connector_extra_config`` dict built from the
settings table (:mod:`server.config`), the connector's defaults (the same as ``python -m
server``'s, for a connector vLLM loads by itself) and the Redis session namespace.

Plain JSON crosses to the engine process; no vLLM, no torch here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from server.config import ServerConfig, settings_table


def connector_extra_config(config: ServerConfig, model_id: str) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` dict: the table's connector fields, plus the
    effective folders and the model id. Plain JSON (it travels to the engine process)."""
    out: dict[str, Any] = {
        "cache_dir": str(config.cache_dir),
        "disk_dir": str(config.disk_dir),
        "model_id": model_id,
    }
    for name, s in settings_table():
        if s.connector is not None:
            out[s.connector] = _wire(getattr(config, name))
    return out


def redis_namespace(config: ServerConfig, served_name: str) -> str:
    """The Redis session namespace of a server: ``--kv-redis-namespace``, else its served
    model name; characters outside ``A-Za-z0-9._:/@+=-`` become ``_`` (a Redis key glob or
    a Cluster hash tag never sees them)."""
    raw = config.kv_redis_namespace or served_name or "default"
    return re.sub(r"[^A-Za-z0-9._:/@+=\-]", "_", raw)


def connector_defaults() -> dict[str, Any]:
    """What the connector assumes for a key its ``kv_connector_extra_config`` lacks: the same
    defaults as ``python -m server`` (used when vLLM loads the connector by itself)."""
    defaults = ServerConfig()
    out = connector_extra_config(defaults, model_id="")
    out["disk_dir"] = None  # follows cache_dir when only that is given
    return out


def _wire(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value
