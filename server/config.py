"""Typed settings of the bundled server, from flags, environment variables or code.

Every field of :class:`ServerConfig` is declared once, with its :class:`server.options.Setting`
(flag, ``LGKV_*`` variable, parser, help, connector key). From that one table come the
environment (:func:`env_settings`), our command-line flags and ``--help`` (:mod:`server.flags`),
``docs/configuration.md`` and the dict that crosses to the KV connector
(:mod:`server.connector_config`, which also gives the connector its defaults from here, so
``vllm serve --kv-transfer-config ...`` with our connector behaves like ``python -m server``).
A flag beats the variable, the variable beats the default. Flags of vLLM that the table does
not name (``--tensor-parallel-size``, ``--enable-chunked-prefill``, ...) travel unchanged in
:attr:`ServerConfig.vllm_args`.

Sizes accept plain bytes or units: ``512MiB``, ``2GiB``, ``1.5GB``, ``64M`` (binary for the
``i`` forms and single letters, decimal for ``kB/MB/GB/TB``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from langgraph_kvcache.contract import REUSE_EXACT, REUSE_MODES
from server.config_checks import TOOL_STRICT_LEVELS, check_config
from server.config_serving import ServingSettings
from server.kv.formats import OFFLOAD_DTYPES
from server.options import (
    ConfigError,
    Setting,
    parse_bool,
    parse_int,
    parse_lower,
    parse_path,
    parse_seconds,
    parse_share,
    parse_size,
    setting,
)

__all__ = [
    "KV_OFFLOAD_DTYPES",
    "ConfigError",
    "ServerConfig",
    "env_settings",
    "parse_bool",
    "parse_seconds",
    "parse_size",
    "settings_table",
]

DEFAULT_KV_RAM_BYTES = 1 << 30
DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 512 << 20
"""Resident KV budget on CPU when ``--kv-cache-memory-bytes`` is not given (raised to one
``--max-model-len`` context where that needs more); vLLM's own CPU default is 92% of the
memory node, which fails beside any other process of some size."""
DEFAULT_KV_DISK_BYTES = 16 << 30
DEFAULT_MAX_BODY_BYTES = 2 << 20
DEFAULT_TOOL_CALL_PARSER = "lgkv_hermes"
"""vLLM's hermes parser with the arguments kept as generated (server/tool_parser.py)."""
DEFAULT_TOOL_STRICT_LEVEL = "parameter"
KV_OFFLOAD_DTYPES = OFFLOAD_DTYPES
"""Accepted ``--kv-offload-dtype`` values (defined in :mod:`server.kv.formats`)."""
OMP_WAIT_POLICIES = ("passive", "active", "vllm")
"""Accepted ``--omp-wait-policy`` values."""


def _default_cache_dir() -> Path:
    from server.model import default_cache_dir

    return default_cache_dir() / "kv"


@dataclass(frozen=True)
class ServerConfig(ServingSettings):
    """Everything the bundled server needs; build with :meth:`from_env` or directly in code.
    Its first fields (model, address, keys and tenant limits) are :class:`ServingSettings`'."""

    kv_cache_memory_bytes: int | None = setting(
        None, flag="--kv-cache-memory-bytes", env="LGKV_KV_CACHE_MEMORY_BYTES", parse=parse_size,
        vllm=True, size=True,
        help=f"resident KV cache budget (CPU default {DEFAULT_CPU_KV_CACHE_MEMORY_BYTES >> 20}MiB)",
    )  # fmt: skip
    """Resident (paged, on-device) KV cache budget, printed at start. ``None``: on CPU 512 MiB,
    or one ``--max-model-len`` context of the model if that needs more (the RAM and disk tiers
    hold the rest; vLLM's CPU default would take 92% of the memory node), split over
    ``--tensor-parallel-size`` workers (vLLM reads the value per worker); on GPUs vLLM sizes it
    itself (``--gpu-memory-utilization``)."""

    kv_offload: bool = setting(
        True, flag="--no-kv-offload", env="LGKV_NO_KV_OFFLOAD", parse=parse_bool, switch=True,
        negated=True,
        help="plain vLLM prefix caching, no session connector (session API answers 503)",
    )  # fmt: skip
    """Keep sessions' KV in RAM/disk tiers via ``SessionKVConnector``. ``False`` runs plain vLLM
    prefix caching; the session API then answers 503."""

    kv_ram_bytes: int = setting(
        DEFAULT_KV_RAM_BYTES, flag="--kv-ram-bytes", env="LGKV_KV_RAM_BYTES", parse=parse_size,
        connector="ram_bytes", size=True, help="RAM tier budget (e.g. 2GiB)",
    )  # fmt: skip
    """RAM tier budget in bytes."""

    kv_disk_dir: Path | None = setting(  # noqa: RUF009 (a field declaration)
        None, flag="--kv-disk-dir", env="LGKV_KV_DISK_DIR", parse=parse_path,
        help="block files folder (<cache-dir>/blocks)",
    )  # fmt: skip
    """Folder of block files; ``None``: ``<cache_dir>/blocks``."""

    kv_disk_bytes: int = setting(
        DEFAULT_KV_DISK_BYTES, flag="--kv-disk-bytes", env="LGKV_KV_DISK_BYTES", parse=parse_size,
        connector="disk_bytes", size=True, help="disk tier budget; 0 turns it off",
    )  # fmt: skip
    """Disk tier budget in bytes; 0 turns the disk tier off."""

    kv_session_ttl: float | None = setting(
        None, flag="--kv-session-ttl", env="LGKV_KV_SESSION_TTL", parse=parse_seconds,
        connector="default_ttl_s", help="default session TTL in seconds",
    )  # fmt: skip
    """Default TTL in seconds of sessions that set none; ``None`` keeps them until deleted."""

    kv_redis_url: str | None = setting(
        None, flag="--kv-redis-url", env="LGKV_KV_REDIS_URL", connector="redis_url",
        help="shared Redis tier, redis://host:6379/0",
    )  # fmt: skip
    """``redis://host:port/db`` of a shared Redis tier (replicas share KV); ``None``: off."""

    kv_redis_namespace: str | None = setting(
        None, flag="--kv-redis-namespace", env="LGKV_KV_REDIS_NAMESPACE",
        connector="redis_namespace",
        help="namespace of the sessions in Redis (default: the served model name)",
    )  # fmt: skip
    """With ``--kv-redis-url``, sessions (rows, block lists, pins, TTLs, the drops and changes
    feeds) live in Redis under ``lgkv:reg:{<namespace>}:``, so every replica answers the
    session API for every session. Replicas behind one router must share it; ``None``: the
    served model name (what clients send as ``model``), so replicas of one model share their
    sessions and another model's never mix in. Characters outside ``A-Za-z0-9._:/@+=-``
    become ``_``."""

    kv_offload_dtype: str = setting(
        "auto", flag="--kv-offload-dtype", env="LGKV_KV_OFFLOAD_DTYPE", parse=parse_lower,
        connector="offload_dtype", choices=KV_OFFLOAD_DTYPES,
        help="format of KV blocks in the tiers (auto: the engine's dtype, exact)",
    )  # fmt: skip
    """Format of KV blocks in the RAM, disk and Redis tiers. ``auto``: the engine's dtype,
    exact. ``float16``/``bfloat16``: half the bytes of float32. ``int8``: a quarter, with
    per-block per-head scales. ``fp8``: float8 e4m3 with the same scales (where torch has it).
    Budgets count the stored bytes, so a smaller format keeps more sessions; measured cost and
    quality in docs/operations.md."""

    kv_redis_ttl: float = setting(
        3600.0, flag="--kv-redis-ttl", env="LGKV_KV_REDIS_TTL", parse=parse_seconds,
        connector="redis_ttl_s", help="seconds a block stays in Redis after its last use",
    )  # fmt: skip
    """Seconds a block stays in the Redis tier after its last write or read."""

    kv_stats_flush: float = setting(
        1.0, flag="--kv-stats-flush", env="LGKV_KV_STATS_FLUSH", parse=parse_seconds,
        connector="stats_flush_s", help="seconds between publishes of KV counters and tiers",
    )  # fmt: skip
    """Seconds between two publishes of the engine's KV counters and block locations to the
    registry (``/metrics``, the sessions' tier counts)."""

    kv_default_gap: float = setting(
        60.0, flag="--kv-default-gap", env="LGKV_KV_DEFAULT_GAP", parse=parse_seconds,
        connector="default_gap_s", help="assumed turn gap of a new session, for eviction",
    )  # fmt: skip
    """Turn gap in seconds assumed for a session with fewer than two turns, for eviction."""

    kv_min_gap: float = setting(
        30.0, flag="--kv-min-gap", env="LGKV_KV_MIN_GAP", parse=parse_seconds,
        connector="min_gap_s", help="shortest turn gap eviction counts",
    )  # fmt: skip
    """Turn gaps shorter than this many seconds count as this long for eviction (tool calls
    and reading time make shorter gaps noise)."""

    kv_pin_share: float = setting(
        0.5, flag="--kv-pin-share", env="LGKV_KV_PIN_SHARE", parse=parse_share,
        connector="pin_share", help="share of each tier all pinned blocks may hold",
    )  # fmt: skip
    """Share (0..1) of each tier's blocks, RAM and disk, that pinned sessions of every tenant
    together may hold; pinned blocks past it may be evicted like unpinned ones, so unpinned
    sessions always keep the rest. ``--tenant-pin-share`` bounds each key within it."""

    kv_branch_blocks: int = setting(
        64, flag="--kv-branch-blocks", env="LGKV_KV_BRANCH_BLOCKS", parse=parse_int,
        connector="branch_blocks", help="blocks a session keeps for its other call streams",
    )  # fmt: skip
    """Blocks a session keeps listed beyond its last call's: the paths of its other call
    streams (a tool's own model calls, a summarizer), forks and rewinds, most recent first, so
    each stream's next call still finds its tail. 0: a session is its last call's blocks."""

    kv_reuse: str = setting(
        REUSE_EXACT, flag="--kv-reuse", env="LGKV_KV_REUSE", parse=parse_lower,
        choices=REUSE_MODES, help="how requests that do not say reuse their session's KV",
    )  # fmt: skip
    """``exact``: a prompt's exact prefix only (outputs identical to no cache). ``shifted``:
    also the session's tokens the prompt repeats at other positions (after a trim or summary),
    keys re-rotated: approximate KV (quality figures: docs/agents.md). A request's
    ``vllm_xargs.lgkv_reuse`` overrides it."""

    kv_shift_min_run: int = setting(
        16, flag="--kv-shift-min-run", env="LGKV_KV_SHIFT_MIN_RUN", parse=parse_int,
        connector="shift_min_run", help="fewest repeated tokens a shifted load takes",
    )  # fmt: skip
    """Shifted reuse: the fewest tokens a run of the session's stored tokens at another
    position must repeat to be loaded; shorter runs are computed."""

    cache_dir: Path = setting(  # noqa: RUF009 (a field declaration)
        default_factory=_default_cache_dir, flag="--cache-dir", env="LGKV_CACHE_DIR",
        parse=parse_path, help="session registry + blocks folder",
    )  # fmt: skip
    """Folder of the session registry (``sessions.sqlite3``) and, by default, block files.
    Restarting on the same folder keeps every session."""

    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, flag="--max-body-bytes", env="LGKV_MAX_BODY_BYTES",
        parse=parse_size, size=True, help="largest request body",
    )  # fmt: skip
    """Largest request body accepted; larger ones get HTTP 413."""

    enforce_eager: bool | None = setting(
        None, flag="--enforce-eager", switch=True, vllm=True, help="no CUDA graphs / compile"
    )
    """Skip CUDA graphs / torch.compile. ``None``: on for CPU (fast start), vLLM's default else."""

    tool_call_parser: str | None = setting(
        DEFAULT_TOOL_CALL_PARSER, flag="--tool-call-parser", vllm=True, help="tool parser"
    )
    """vLLM tool parser for ``tool_choice="auto"`` (hermes-style ``<tool_call>{json}</tool_call>``);
    ``lgkv_hermes`` returns each call's arguments as generated, so the tool turn renders back to
    the cached tokens; ``None`` turns automatic tool calls off."""

    tool_strict_level: str = setting(
        DEFAULT_TOOL_STRICT_LEVEL, flag="--tool-strict-level", vllm=True,
        choices=TOOL_STRICT_LEVELS, help="how far forced tool calls are constrained",
    )  # fmt: skip
    """vLLM's floor for tool-call grammars. ``parameter`` (ours): a named or ``required``
    ``tool_choice`` constrains the whole call, arguments included, to the tool's JSON schema, so
    even a small model returns a call that parses and validates; ``function``: the call's envelope
    and name only (arguments free JSON); ``auto`` (vLLM's default): arguments follow the schema
    only for tools sent with ``strict: true``."""

    whole_forced_tokens: bool = setting(
        True, flag="--no-whole-forced-tokens", env="LGKV_NO_WHOLE_FORCED_TOKENS",
        parse=parse_bool, switch=True, negated=True,
        help="let the model spell forced tool names in any tokens",
    )  # fmt: skip
    """A forced tool call's name is written as the tokenizer spells it (and its closing braces
    as ``}}``), so the next call's re-rendered tool call reuses the
    cached KV (``server/forced_text.py``, a vLLM logits processor for forced tool calls only;
    ``response_format`` schemas are left alone). ``False``: vLLM's behaviour, the model's argmax
    among the tokens the grammar allows.
    Ignored when ``--logits-processors`` is passed through."""

    omp_wait_policy: str = setting(
        "passive", flag="--omp-wait-policy", env="LGKV_OMP_WAIT_POLICY", parse=parse_lower,
        choices=OMP_WAIT_POLICIES, help="how the CPU forward pass's threads wait when idle",
    )  # fmt: skip
    """On CPU, ``OMP_WAIT_POLICY`` of the server's processes (a value already in the environment
    wins): ``passive``, the model's OpenMP threads sleep between parallel regions, so the API
    server, vLLM's scheduler and other clients' requests get the cores
    (``benchmarks/wait_policy.py``); ``active``, they spin; ``vllm``, left unset (libgomp spins
    a while, then sleeps), as plain vLLM runs."""

    vllm_args: tuple[str, ...] = setting((), help="any other vLLM flag, passed through")
    """Further vLLM engine/frontend flags, passed through unchanged
    (e.g. ``("--tensor-parallel-size", "2")``)."""

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def replica_name(self) -> str:
        """What the ``X-LGKV-Replica`` response header says: ``replica_id`` or
        ``<hostname>:<port>``."""
        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    @property
    def disk_dir(self) -> Path:
        """The effective block files folder."""
        return self.kv_disk_dir if self.kv_disk_dir is not None else self.cache_dir / "blocks"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """Settings from ``LGKV_*`` variables (docs/configuration.md), then ``overrides``."""
        values = env_settings(os.environ if env is None else env)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def settings_table() -> Iterator[tuple[str, Setting]]:
    """``(field name, Setting)`` of every :class:`ServerConfig` field, in declaration order."""
    for f in dataclasses.fields(ServerConfig):
        yield f.name, f.metadata["setting"]


def env_settings(env: Mapping[str, str]) -> dict[str, object]:
    """The :class:`ServerConfig` fields set by ``LGKV_*`` variables in ``env``, parsed.

    An empty variable counts as unset.
    """
    out: dict[str, object] = {}
    for name, s in settings_table():
        raw = env.get(s.env) if s.env else None
        if raw in (None, ""):
            continue
        value = s.parse(raw, name=s.env)
        out[name] = not value if s.negated else value
    return out
