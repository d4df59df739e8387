"""Typed settings of the bundled server, from flags, environment variables or code.

Every field of :class:`ServerConfig` has a flag (``--kv-ram-bytes``) and an environment variable
(``LGKV_KV_RAM_BYTES``); a flag beats the variable, the variable beats the default. Flags of vLLM
that this module does not name (``--tensor-parallel-size``, ``--enable-chunked-prefill``, ...)
travel unchanged in :attr:`ServerConfig.vllm_args`.

Environment variables (all optional):

========================== ===================================================
``LGKV_MODEL``             model folder or hub id (``--model``)
``LGKV_SERVED_MODEL_NAME`` name clients use (``--served-model-name``)
``LGKV_DTYPE``             ``auto``, ``float32``, ``bfloat16``... (``--dtype``)
``LGKV_MAX_MODEL_LEN``     context length (``--max-model-len``)
``LGKV_HOST``              bind address (``--host``)
``LGKV_PORT``              port (``--port``)
``LGKV_API_KEY``           bearer key; comma-separated for several (``--api-key``)
``LGKV_METRICS_PUBLIC``    ``1``: ``/metrics`` needs no key (``--metrics-public``)
``LGKV_KV_CACHE_MEMORY_BYTES`` resident (paged) KV budget (``--kv-cache-memory-bytes``)
``LGKV_KV_RAM_BYTES``      RAM tier budget (``--kv-ram-bytes``)
``LGKV_KV_DISK_DIR``       block files folder (``--kv-disk-dir``)
``LGKV_KV_DISK_BYTES``     disk tier budget, 0 turns it off (``--kv-disk-bytes``)
``LGKV_NO_KV_OFFLOAD``     ``1`` runs plain vLLM prefix caching (``--no-kv-offload``)
``LGKV_KV_SESSION_TTL``    default session TTL in seconds (``--kv-session-ttl``)
``LGKV_KV_REDIS_URL``      shared Redis tier (``--kv-redis-url``)
``LGKV_KV_OFFLOAD_DTYPE``  block format in the tiers, e.g. ``int8`` (``--kv-offload-dtype``)
``LGKV_CACHE_DIR``         project cache root; sessions default to ``<root>/kv`` (``--cache-dir``)
``LGKV_MAX_BODY_BYTES``    largest accepted request body (``--max-body-bytes``)
========================== ===================================================

Sizes accept plain bytes or units: ``512MiB``, ``2GiB``, ``1.5GB``, ``64M`` (binary for the
``i`` forms and single letters, decimal for ``kB/MB/GB/TB``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
DEFAULT_KV_RAM_BYTES = 1 << 30
DEFAULT_KV_DISK_BYTES = 16 << 30
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_TOOL_CALL_PARSER = "hermes"
KV_OFFLOAD_DTYPES = ("auto", "float16", "bfloat16", "int8", "fp8")
"""Accepted ``--kv-offload-dtype`` values (``server.kv.codec`` implements them)."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag/variable and the accepted form."""


def parse_size(value: str | int, *, name: str = "size") -> int:
    """Parse a byte count such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or ``4096``.

    Raises:
        ConfigError: the text is not a non-negative number with a known unit.
    """
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0 bytes, got {value}")
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"{name}: cannot read {value!r} as a size; use bytes or a unit, e.g. 512MiB, 2GiB, 1GB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def parse_bool(value: str, *, name: str) -> bool:
    """Parse ``1/0, true/false, yes/no, on/off`` (case-insensitive)."""
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}: expected 1/0, true/false, yes/no or on/off, got {value!r}")


def parse_seconds(value: str | float | None, *, name: str) -> float | None:
    """Parse a positive number of seconds; ``None``, ``""``, ``0`` and ``none`` mean no TTL."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null", "0"):
            return None
        try:
            value = float(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: expected seconds as a number, got {value!r}") from exc
    if value < 0:
        raise ConfigError(f"{name}: seconds must be >= 0, got {value}")
    return float(value) or None


def _default_cache_dir() -> Path:
    from server.model import default_cache_dir

    return default_cache_dir() / "kv"


@dataclass(frozen=True)
class ServerConfig:
    """Everything the bundled server needs; build with :meth:`from_env` or directly in code."""

    model: str | None = None
    """Model folder or hub id. ``None`` serves the default SmolLM2 folder
    (``server.model.default_model_dir()``, built by ``make setup`` / ``python -m server.model``)."""

    served_model_name: str | None = None
    """The name clients send as ``model``. ``None``: ``SmolLM2-135M-Instruct`` for the default
    model, else the ``model`` string (vLLM's default)."""

    dtype: str = "auto"
    """Weights/activations dtype. ``auto`` means float32 on CPU (bfloat16 garbles SmolLM2 there)
    and vLLM's own choice on GPUs."""

    max_model_len: int | None = None
    """Context length in tokens; ``None`` takes the model's own. Longer prompts get HTTP 400."""

    host: str = DEFAULT_HOST
    """Address to bind. ``0.0.0.0`` to serve other machines."""

    port: int = DEFAULT_PORT
    """TCP port (0 is not allowed: clients must know it)."""

    api_keys: tuple[str, ...] = ()
    """Bearer keys. Empty: no auth and one tenant ``default``. With keys, every route but
    ``/health`` needs one (401 before the body is read); each key is its own tenant (sessions
    and KV blocks are never shared between keys)."""

    metrics_public: bool = False
    """Serve ``/metrics`` without a key even when keys are set (for a Prometheus scraper that
    sends none). Off: ``/metrics`` needs a key, since it shows every tenant's aggregate
    traffic."""

    kv_cache_memory_bytes: int | None = None
    """Resident (paged, on-device) KV cache budget. ``None``: vLLM sizes it itself."""

    kv_offload: bool = True
    """Keep sessions' KV in RAM/disk tiers via ``SessionKVConnector``. ``False`` runs plain vLLM
    prefix caching; the session API then answers 503."""

    kv_ram_bytes: int = DEFAULT_KV_RAM_BYTES
    """RAM tier budget in bytes."""

    kv_disk_dir: Path | None = None
    """Folder of block files; ``None``: ``<cache_dir>/blocks``."""

    kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES
    """Disk tier budget in bytes; 0 turns the disk tier off."""

    kv_session_ttl: float | None = None
    """Default TTL in seconds of sessions that set none; ``None`` keeps them until deleted."""

    kv_redis_url: str | None = None
    """``redis://host:port/db`` of a shared Redis tier (replicas share KV); ``None``: off."""

    kv_offload_dtype: str = "auto"
    """Format of KV blocks in the RAM, disk and Redis tiers. ``auto``: the engine's dtype,
    exact. ``float16``/``bfloat16``: half the bytes of float32. ``int8``: a quarter, with
    per-block per-head scales. ``fp8``: float8 e4m3 with the same scales (where torch has it).
    Budgets count the stored bytes, so a smaller format keeps more sessions; measured cost and
    quality in docs/operations.md."""

    cache_dir: Path = field(default_factory=_default_cache_dir)
    """Folder of the session registry (``sessions.sqlite3``) and, by default, block files.
    Restarting on the same folder keeps every session."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest request body accepted; larger ones get HTTP 413."""

    enforce_eager: bool | None = None
    """Skip CUDA graphs / torch.compile. ``None``: on for CPU (fast start), vLLM's default else."""

    tool_call_parser: str | None = DEFAULT_TOOL_CALL_PARSER
    """vLLM tool parser for ``tool_choice="auto"`` (hermes-style ``<tool_call>{json}</tool_call>``);
    ``None`` turns automatic tool calls off."""

    vllm_args: tuple[str, ...] = ()
    """Further vLLM engine/frontend flags, passed through unchanged
    (e.g. ``("--tensor-parallel-size", "2")``)."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port/LGKV_PORT must be 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"--max-model-len must be > 0, got {self.max_model_len}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        for name in ("kv_ram_bytes", "kv_disk_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if self.kv_offload and self.kv_ram_bytes == 0:
            raise ConfigError("--kv-ram-bytes must be > 0 (use --no-kv-offload to turn it off)")
        if self.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
            raise ConfigError(
                f"--kv-offload-dtype/LGKV_KV_OFFLOAD_DTYPE must be one of "
                f"{', '.join(KV_OFFLOAD_DTYPES)}; got {self.kv_offload_dtype!r}"
            )
        if any(not k for k in self.api_keys):
            raise ConfigError("--api-key/LGKV_API_KEY must not contain empty keys")

    @property
    def disk_dir(self) -> Path:
        """The effective block files folder."""
        return self.kv_disk_dir if self.kv_disk_dir is not None else self.cache_dir / "blocks"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """Settings from ``LGKV_*`` variables (see the module doc), then ``overrides``."""
        values = env_settings(os.environ if env is None else env)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def env_settings(env: Mapping[str, str]) -> dict[str, object]:
    """The :class:`ServerConfig` fields set by ``LGKV_*`` variables in ``env``, parsed."""
    out: dict[str, object] = {}

    def get(name: str) -> str | None:
        value = env.get(name)
        return value if value not in (None, "") else None

    if (v := get("LGKV_MODEL")) is not None:
        out["model"] = v
    if (v := get("LGKV_SERVED_MODEL_NAME")) is not None:
        out["served_model_name"] = v
    if (v := get("LGKV_DTYPE")) is not None:
        out["dtype"] = v
    if (v := get("LGKV_MAX_MODEL_LEN")) is not None:
        out["max_model_len"] = _int(v, "LGKV_MAX_MODEL_LEN")
    if (v := get("LGKV_HOST")) is not None:
        out["host"] = v
    if (v := get("LGKV_PORT")) is not None:
        out["port"] = _int(v, "LGKV_PORT")
    if (v := get("LGKV_API_KEY")) is not None:
        out["api_keys"] = tuple(k.strip() for k in v.split(",") if k.strip())
    if (v := get("LGKV_METRICS_PUBLIC")) is not None:
        out["metrics_public"] = parse_bool(v, name="LGKV_METRICS_PUBLIC")
    if (v := get("LGKV_KV_CACHE_MEMORY_BYTES")) is not None:
        out["kv_cache_memory_bytes"] = parse_size(v, name="LGKV_KV_CACHE_MEMORY_BYTES")
    if (v := get("LGKV_KV_RAM_BYTES")) is not None:
        out["kv_ram_bytes"] = parse_size(v, name="LGKV_KV_RAM_BYTES")
    if (v := get("LGKV_KV_DISK_DIR")) is not None:
        out["kv_disk_dir"] = Path(v)
    if (v := get("LGKV_KV_DISK_BYTES")) is not None:
        out["kv_disk_bytes"] = parse_size(v, name="LGKV_KV_DISK_BYTES")
    if (v := get("LGKV_NO_KV_OFFLOAD")) is not None:
        out["kv_offload"] = not parse_bool(v, name="LGKV_NO_KV_OFFLOAD")
    if (v := get("LGKV_KV_SESSION_TTL")) is not None:
        out["kv_session_ttl"] = parse_seconds(v, name="LGKV_KV_SESSION_TTL")
    if (v := get("LGKV_KV_REDIS_URL")) is not None:
        out["kv_redis_url"] = v
    if (v := get("LGKV_KV_OFFLOAD_DTYPE")) is not None:
        out["kv_offload_dtype"] = v.strip().lower()
    if (v := get("LGKV_MAX_BODY_BYTES")) is not None:
        out["max_body_bytes"] = parse_size(v, name="LGKV_MAX_BODY_BYTES")
    return out


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from exc
