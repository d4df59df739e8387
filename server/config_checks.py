"""The rules a :class:`~server.config.ServerConfig` must keep beyond each field's parser (ranges,
choices, combinations): :func:`check_config` raises :class:`~server.options.ConfigError` naming
the flag and the variable to fix. ``ServerConfig`` runs it on every construction (flags,
environment or code).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from langgraph_kvcache.contract import InvalidTTL, check_ttl
from server.kv.formats import OFFLOAD_DTYPES
from server.options import ConfigError

if TYPE_CHECKING:
    from server.config import ServerConfig

TOOL_STRICT_LEVELS = ("auto", "function", "parameter")
"""Accepted ``--tool-strict-level`` values (vLLM's ``ToolStrictLevel`` names)."""

_REPLICA_ID = re.compile(r"[\x21-\x7e]{1,200}")


def check_config(config: ServerConfig) -> None:
    """Raise :class:`~server.options.ConfigError` for the first rule ``config`` breaks."""
    if not 0 < config.port < 65536:
        raise ConfigError(f"--port/LGKV_PORT must be 1..65535, got {config.port}")
    if config.max_model_len is not None and config.max_model_len <= 0:
        raise ConfigError(f"--max-model-len must be > 0, got {config.max_model_len}")
    if config.max_body_bytes < 1024:
        raise ConfigError(f"--max-body-bytes must be >= 1024, got {config.max_body_bytes}")
    for name in ("kv_ram_bytes", "kv_disk_bytes"):
        if getattr(config, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if config.kv_offload and config.kv_ram_bytes == 0:
        raise ConfigError("--kv-ram-bytes must be > 0 (use --no-kv-offload to turn it off)")
    if config.kv_offload_dtype not in OFFLOAD_DTYPES:
        raise ConfigError(
            f"--kv-offload-dtype/LGKV_KV_OFFLOAD_DTYPE must be one of "
            f"{', '.join(OFFLOAD_DTYPES)}; got {config.kv_offload_dtype!r}"
        )
    if config.tool_strict_level not in TOOL_STRICT_LEVELS:
        raise ConfigError(
            f"--tool-strict-level must be one of {', '.join(TOOL_STRICT_LEVELS)}; "
            f"got {config.tool_strict_level!r}"
        )
    for name in ("kv_redis_ttl", "kv_stats_flush", "kv_default_gap", "kv_min_gap"):
        value = getattr(config, name)  # parse_seconds reads 0 as None
        if value is None or value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds > 0")
    if config.kv_session_ttl is not None:
        try:
            check_ttl(config.kv_session_ttl, field="--kv-session-ttl/LGKV_KV_SESSION_TTL")
        except InvalidTTL as exc:
            raise ConfigError(str(exc)) from None
    if config.replica_id is not None and not _REPLICA_ID.fullmatch(config.replica_id):
        raise ConfigError(
            f"--replica-id/LGKV_REPLICA_ID must be 1-200 visible ASCII characters, "
            f"got {config.replica_id!r}"
        )
    for name in ("session_calls_per_key", "tenant_max_sessions", "tenant_max_unleased_pins"):
        if getattr(config, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if config.kv_branch_blocks < 0:
        raise ConfigError("--kv-branch-blocks must be >= 0")
    if config.max_pin_lease is None or config.max_pin_lease <= 0:
        raise ConfigError("--max-pin-lease must be a number of seconds > 0")
    if any(not k for k in config.api_keys):
        raise ConfigError("--api-key/LGKV_API_KEY must not contain empty keys")
