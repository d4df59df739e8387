"""Typed connector settings parsed from vLLM's ``kv_connector_extra_config``.

The app passes the keys :func:`server.connector_config.connector_extra_config` builds from the
config table; :meth:`ConnectorSettings.from_extra_config` validates them and raises
:class:`SettingsError` with a message naming the bad key. A key that is missing (plain
``vllm serve --kv-transfer-config ...`` with this connector) takes the server's own default
(:func:`server.connector_config.connector_defaults`): the connector has no defaults of its
own for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.kv.formats import OFFLOAD_DTYPES

REGISTRY_FILE = "sessions.sqlite3"
"""File name of the session registry inside ``cache_dir``."""


class SettingsError(ValueError):
    """A ``kv_connector_extra_config`` value is missing or has the wrong type or range."""


@dataclass(frozen=True)
class ConnectorSettings:
    """Configuration of :class:`server.kv.connector.SessionKVConnector`."""

    cache_dir: Path
    """Folder holding the session registry (``sessions.sqlite3``) and, by default, ``blocks/``."""

    disk_dir: Path
    """Folder of the disk tier's block files (default ``<cache_dir>/blocks``)."""

    ram_bytes: int
    """Byte budget of the RAM tier (a preallocated pool); 0 disables RAM and disk saving."""

    disk_bytes: int
    """Byte budget of the disk tier; 0 disables the disk tier."""

    redis_ttl_s: float
    """Seconds a block stays in Redis after its last write or read."""

    stats_flush_s: float
    """Minimum seconds between two flushes of the engine's counters to the registry."""

    default_gap_s: float
    """Assumed turn gap (seconds) of a session with fewer than two turns, for eviction."""

    min_gap_s: float
    """Turn gaps shorter than this count as this long for eviction (tool calls and reading
    time make shorter gaps noise)."""

    redis_url: str | None = None
    """Optional Redis URL of a shared tier (every saved block also goes there, with a TTL)."""

    redis_namespace: str | None = None
    """Namespace of the sessions in Redis (with ``redis_url``); None: :attr:`registry_namespace`
    falls back to ``model_id``. Replicas that share sessions must share it."""

    default_ttl_s: float | None = None
    """TTL given to sessions created implicitly by a request (None: no expiry)."""

    model_id: str = ""
    """Served model name or path, recorded in the disk manifest."""

    offload_dtype: str = "auto"
    """Stored format of blocks in every tier (:data:`server.kv.formats.OFFLOAD_DTYPES`);
    ``auto`` keeps the engine's dtype. Recorded in the manifest; budgets count stored bytes."""

    pin_share: float = 0.5
    """Share (0..1) of each tier's blocks that may rank as pinned at once; further pinned
    blocks may be evicted like unpinned ones (:mod:`server.kv.scheduler.eviction_order`)."""

    branch_blocks: int = 64
    """Blocks a session keeps listed beyond its last call's path: its other continuations
    (other call streams, forks, rewinds), most recent first (:mod:`server.kv.scheduler.
    continuations`). 0: a session is its last call's blocks only."""

    shift_min_run: int = 16
    """Shifted reuse (requests with ``lgkv_reuse: "shifted"``): the fewest tokens a run of the
    session's stored tokens at another position must repeat to be loaded (:mod:`server.kv.
    scheduler.shifted`)."""

    @property
    def registry_path(self) -> Path:
        """Path of the SQLite session registry (with Redis: this replica's local part)."""
        return self.cache_dir / REGISTRY_FILE

    @property
    def registry_namespace(self) -> str:
        """The Redis session namespace: ``redis_namespace``, else ``model_id``, else
        ``default``."""
        return self.redis_namespace or self.model_id or "default"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse and validate ``kv_connector_extra_config``; missing keys take the server's
        defaults."""
        from server.connector_config import connector_defaults

        extra = {**connector_defaults(), **(extra or {})}
        cache_dir = extra.get("cache_dir")
        if not isinstance(cache_dir, str) or not cache_dir:
            raise SettingsError(
                "kv_connector_extra_config['cache_dir'] must be a non-empty folder path"
            )
        root = Path(cache_dir).expanduser()
        disk_dir_raw = extra.get("disk_dir")
        if disk_dir_raw is not None and not isinstance(disk_dir_raw, str):
            raise SettingsError("kv_connector_extra_config['disk_dir'] must be a path or null")
        disk_dir = Path(disk_dir_raw).expanduser() if disk_dir_raw else root / "blocks"
        ttl = extra.get("default_ttl_s")
        if ttl is not None and (not isinstance(ttl, (int, float)) or ttl <= 0):
            raise SettingsError("kv_connector_extra_config['default_ttl_s'] must be > 0 or null")
        redis_url = extra.get("redis_url")
        if redis_url is not None and not isinstance(redis_url, str):
            raise SettingsError("kv_connector_extra_config['redis_url'] must be a string or null")
        namespace = extra.get("redis_namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise SettingsError(
                "kv_connector_extra_config['redis_namespace'] must be a string or null"
            )
        model_id = extra.get("model_id", "")
        if not isinstance(model_id, str):
            raise SettingsError("kv_connector_extra_config['model_id'] must be a string")
        offload_dtype = extra.get("offload_dtype") or "auto"
        if offload_dtype not in OFFLOAD_DTYPES:
            raise SettingsError(
                f"kv_connector_extra_config['offload_dtype'] must be one of "
                f"{', '.join(OFFLOAD_DTYPES)}, got {offload_dtype!r}"
            )
        return cls(
            cache_dir=root,
            disk_dir=disk_dir,
            ram_bytes=_non_negative_int(extra, "ram_bytes"),
            disk_bytes=_non_negative_int(extra, "disk_bytes"),
            redis_url=redis_url or None,
            redis_namespace=namespace or None,
            default_ttl_s=float(ttl) if ttl is not None else None,
            model_id=model_id,
            offload_dtype=offload_dtype,
            redis_ttl_s=_positive_float(extra, "redis_ttl_s"),
            stats_flush_s=_positive_float(extra, "stats_flush_s"),
            default_gap_s=_positive_float(extra, "default_gap_s"),
            min_gap_s=_positive_float(extra, "min_gap_s"),
            pin_share=_share(extra, "pin_share"),
            branch_blocks=_count(extra, "branch_blocks"),
            shift_min_run=_count(extra, "shift_min_run"),
        )


def _non_negative_int(extra: dict[str, Any], key: str) -> int:
    value = extra.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be an integer >= 0 bytes")
    return value


def _count(extra: dict[str, Any], key: str) -> int:
    value = extra.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be an integer >= 0")
    return value


def _share(extra: dict[str, Any], key: str) -> float:
    value = extra.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be a number in 0..1")
    return float(value)


def _positive_float(extra: dict[str, Any], key: str) -> float:
    value = extra.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise SettingsError(f"kv_connector_extra_config[{key!r}] must be a number > 0")
    return float(value)
