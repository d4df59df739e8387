"""The first fields of :class:`server.config.ServerConfig`: the model, the address, the API keys
and the limits each tenant (API key) keeps to. One ``setting(...)`` per field, with its
docstring, as in :mod:`server.config` (which documents the table); ``ServerConfig`` inherits
them, so they come first in its fields, flags and ``docs/configuration.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.options import (
    parse_bool,
    parse_int,
    parse_keys,
    parse_rate,
    parse_seconds,
    parse_share,
    parse_size,
    setting,
)

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ServingSettings:
    """The model, the address, the keys and the tenant limits (see :class:`ServerConfig`)."""

    model: str | None = setting(
        None, flag="--model", env="LGKV_MODEL", vllm=True, help="model folder or hub id"
    )
    """Model folder or hub id. ``None`` serves the default SmolLM2 folder
    (``server.model.default_model_dir()``, built by ``make setup`` / ``python -m server.model``)."""

    served_model_name: str | None = setting(
        None, flag="--served-model-name", env="LGKV_SERVED_MODEL_NAME", vllm=True,
        help="name clients use",
    )  # fmt: skip
    """The name clients send as ``model``. ``None``: ``SmolLM2-135M-Instruct`` for the default
    model, else the ``model`` string (vLLM's default)."""

    dtype: str = setting("auto", flag="--dtype", env="LGKV_DTYPE", vllm=True, help="dtype")
    """Weights/activations dtype. ``auto`` means float32 on CPU (bfloat16 garbles SmolLM2 there)
    and vLLM's own choice on GPUs."""

    max_model_len: int | None = setting(
        None, flag="--max-model-len", env="LGKV_MAX_MODEL_LEN", parse=parse_int, vllm=True,
        help="context length",
    )  # fmt: skip
    """Context length in tokens; ``None`` takes the model's own. Longer prompts get HTTP 400."""

    host: str = setting(DEFAULT_HOST, flag="--host", env="LGKV_HOST", vllm=True, help="bind")
    """Address to bind. ``0.0.0.0`` to serve other machines."""

    port: int = setting(
        DEFAULT_PORT, flag="--port", env="LGKV_PORT", parse=parse_int, vllm=True, help="port"
    )
    """TCP port (0 is not allowed: clients must know it)."""

    replica_id: str | None = setting(
        None, flag="--replica-id", env="LGKV_REPLICA_ID",
        help="replica name in the X-LGKV-Replica response header (default <hostname>:<port>)",
    )  # fmt: skip
    """Name of this server among several replicas behind a router: every response carries it
    in the ``X-LGKV-Replica`` header, so a client sees which replica answered. ``None``:
    ``<hostname>:<port>``. Visible ASCII, at most 200 characters."""

    api_keys: tuple[str, ...] = setting(
        (), flag="--api-key", env="LGKV_API_KEY", parse=parse_keys, many=True, vllm=True,
        help="bearer keys (comma-separated in the variable)",
    )  # fmt: skip
    """Bearer keys. Empty: no auth and one tenant ``default``. With keys, every route but
    ``/health`` needs one (401 before the body is read); each key is its own tenant (sessions
    and KV blocks are never shared between keys)."""

    metrics_public: bool = setting(
        False, flag="--metrics-public", env="LGKV_METRICS_PUBLIC", parse=parse_bool, switch=True,
        help="serve /metrics without an API key even when --api-key is set",
    )  # fmt: skip
    """Serve ``/metrics`` without a key even when keys are set (for a Prometheus scraper that
    sends none). Off: ``/metrics`` needs a key, since it shows every tenant's aggregate
    traffic."""

    session_calls_per_key: int = setting(
        8, flag="--session-calls-per-key", env="LGKV_SESSION_CALLS_PER_KEY", parse=parse_int,
        help="session API calls one key may have in flight",
    )  # fmt: skip
    """Session API calls one tenant may have in flight; more get HTTP 429 at once (the routes
    share one pool of 40 worker threads among every tenant)."""

    tenant_generation_share: float = setting(
        0.5, flag="--tenant-generation-share", env="LGKV_TENANT_GENERATION_SHARE",
        parse=parse_share, help="share of --max-num-seqs one key's generations may fill",
    )  # fmt: skip
    """With several keys: the share (0..1] of vLLM's batch (``--max-num-seqs``) one key's
    generations may fill at once; its further generations wait in the API process (in order;
    429 past ten times as many), so other keys always find room. 1 turns it off."""

    tenant_session_rate: float = setting(
        50.0, flag="--tenant-session-rate", env="LGKV_TENANT_SESSION_RATE", parse=parse_rate,
        help="session API calls per second one key may make",
    )  # fmt: skip
    """With several keys: session API calls per second one key may make (bursts of twice
    that); past it 429 with ``Retry-After``. Each call costs the API process about 1 ms of CPU
    on the cores its engine uses. 0 turns it off."""

    tenant_body_rate: int = setting(
        4 << 20, flag="--tenant-body-rate", env="LGKV_TENANT_BODY_RATE", parse=parse_size,
        size=True, help="bytes per second of large bodies one key may send",
    )  # fmt: skip
    """With several keys: bytes per second of request bodies over 64 KiB one key may send (a
    bucket that holds ``--max-body-bytes``, so one largest body always passes after a pause);
    past it 429 with ``Retry-After``. Parsing large bodies holds the API process that streams
    every tenant's tokens. 0 turns it off."""

    tenant_max_sessions: int = setting(
        100_000, flag="--tenant-max-sessions", env="LGKV_TENANT_MAX_SESSIONS", parse=parse_int,
        help="sessions one key may hold",
    )  # fmt: skip
    """Sessions one tenant may hold. Creating or copying into a new one past it gets HTTP 429;
    a generation that names a new session past it too (delete sessions, or let TTLs expire)."""

    tenant_pin_share: float = setting(
        0.25, flag="--tenant-pin-share", env="LGKV_TENANT_PIN_SHARE", parse=parse_share,
        help="share of each tier one key's pinned sessions may fill",
    )  # fmt: skip
    """Share (0..1) of each tier, RAM and disk, that one tenant's pinned sessions may fill; a
    pin that would pass it gets HTTP 409 naming the quota. The same bound holds a tenant's
    managed marks (sessions a client prefetches rank after every other block): past it a
    prefetch still runs but marks nothing."""

    tenant_max_unleased_pins: int = setting(
        16, flag="--tenant-max-unleased-pins", env="LGKV_TENANT_MAX_UNLEASED_PINS",
        parse=parse_int, help="pins without a lease one key may hold",
    )  # fmt: skip
    """Pins without a lease (``pin_ttl_seconds``) one tenant may hold at once; one more gets
    HTTP 409 (pin with a lease, or unpin another session)."""

    max_pin_lease: float = setting(
        86_400.0, flag="--max-pin-lease", env="LGKV_MAX_PIN_LEASE", parse=parse_seconds,
        help="longest pin lease in seconds",
    )  # fmt: skip
    """Longest pin lease (``pin_ttl_seconds``) accepted, in seconds; a longer one gets HTTP
    400."""
