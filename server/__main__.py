"""``langgraph-kvcache serve`` / ``python -m server``: run the OpenAI-compatible server.

Usage::

    python -m server [serve] [MODEL] [--port 8000] [--kv-ram-bytes 2GiB] [any vllm serve flag]

Flags named in :mod:`server.config` are ours (each also read from an ``LGKV_*`` variable);
every other flag goes to vLLM unchanged (``--tensor-parallel-size 2``,
``--max-num-seqs 64``...). ``--help`` lists both.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from server.config import (
    KV_OFFLOAD_DTYPES,
    ConfigError,
    ServerConfig,
    env_settings,
    parse_seconds,
    parse_size,
)

log = logging.getLogger("server")

_OURS = "The session KV cache (RAM + disk tiers). Each flag also reads an LGKV_* variable."


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _seconds(text: str) -> float | None:
    try:
        return parse_seconds(text, name="--kv-session-ttl")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """Our own flags (those vLLM does not have)."""
    g = parser.add_argument_group("LangGraphKVCache", _OURS)
    g.add_argument("--kv-ram-bytes", type=_size, help="RAM tier budget (e.g. 2GiB)")
    g.add_argument("--kv-disk-dir", type=Path, help="block files folder (<cache-dir>/blocks)")
    g.add_argument("--kv-disk-bytes", type=_size, help="disk tier budget; 0 turns it off")
    g.add_argument(
        "--no-kv-offload", action="store_true", default=None,
        help="plain vLLM prefix caching, no session connector (session API answers 503)",
    )  # fmt: skip
    g.add_argument("--kv-session-ttl", type=_seconds, help="default session TTL in seconds")
    g.add_argument("--kv-redis-url", help="shared Redis tier, redis://host:6379/0")
    g.add_argument(
        "--kv-offload-dtype", choices=KV_OFFLOAD_DTYPES,
        help="format of KV blocks in the tiers (auto: the engine's dtype, exact)",
    )  # fmt: skip
    g.add_argument(
        "--metrics-public", action="store_true", default=None,
        help="serve /metrics without an API key even when --api-key is set",
    )  # fmt: skip
    g.add_argument("--cache-dir", type=Path, help="session registry + blocks folder")
    g.add_argument("--max-body-bytes", type=_size, help="largest request body")


def _own_parser() -> argparse.ArgumentParser:
    """Parses our flags and vLLM's flags that map onto ServerConfig; the rest pass through."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model")
    p.add_argument("--served-model-name")
    p.add_argument("--dtype")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", nargs="+", dest="api_keys")
    p.add_argument("--kv-cache-memory-bytes", type=_size)
    p.add_argument("--enforce-eager", action="store_true", default=None)
    p.add_argument("--tool-call-parser")
    add_kv_arguments(p)
    return p


def help_parser() -> argparse.ArgumentParser:
    """vLLM's serve parser with our group added and our defaults shown, for ``--help``."""
    from server.engine import vllm_parser
    from server.model import DEFAULT_MODEL_NAME, default_model_dir

    parser = vllm_parser()
    parser.prog = "langgraph-kvcache serve"
    add_kv_arguments(parser)
    try:
        cfg = ServerConfig.from_env()
    except ConfigError:
        cfg = ServerConfig()
    parser.set_defaults(
        model=cfg.model or str(default_model_dir()),
        served_model_name=cfg.served_model_name or f"{DEFAULT_MODEL_NAME} (default model)",
        dtype=f"{cfg.dtype} (float32 on CPU)" if cfg.dtype == "auto" else cfg.dtype,
        host=cfg.host,
        port=cfg.port,
        tool_call_parser=cfg.tool_call_parser,
        kv_ram_bytes=_human(cfg.kv_ram_bytes),
        kv_disk_bytes=_human(cfg.kv_disk_bytes),
        kv_disk_dir=str(cfg.disk_dir),
        kv_session_ttl=cfg.kv_session_ttl,
        kv_redis_url=cfg.kv_redis_url,
        kv_offload_dtype=cfg.kv_offload_dtype,
        cache_dir=str(cfg.cache_dir),
        max_body_bytes=_human(cfg.max_body_bytes),
        no_kv_offload=not cfg.kv_offload,
        metrics_public=cfg.metrics_public,
    )
    return parser


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def config_from_argv(argv: Sequence[str], env: dict[str, str] | None = None) -> ServerConfig:
    """Build the config: flags over ``LGKV_*`` variables over defaults.

    Raises:
        ConfigError: a flag or variable is malformed.
    """
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    try:
        ns, rest = _own_parser().parse_known_args(argv)
    except SystemExit as exc:
        raise ConfigError(f"invalid arguments: {' '.join(argv)}") from exc
    values = env_settings(os.environ if env is None else env)
    direct = {
        "model": ns.model,
        "served_model_name": ns.served_model_name,
        "dtype": ns.dtype,
        "max_model_len": ns.max_model_len,
        "host": ns.host,
        "port": ns.port,
        "api_keys": tuple(ns.api_keys) if ns.api_keys else None,
        "kv_cache_memory_bytes": ns.kv_cache_memory_bytes,
        "enforce_eager": ns.enforce_eager,
        "tool_call_parser": ns.tool_call_parser,
        "kv_ram_bytes": ns.kv_ram_bytes,
        "kv_disk_dir": ns.kv_disk_dir,
        "kv_disk_bytes": ns.kv_disk_bytes,
        "kv_session_ttl": ns.kv_session_ttl,
        "kv_redis_url": ns.kv_redis_url,
        "kv_offload_dtype": ns.kv_offload_dtype,
        "cache_dir": ns.cache_dir,
        "max_body_bytes": ns.max_body_bytes,
        "metrics_public": ns.metrics_public,
    }
    values.update({k: v for k, v in direct.items() if v is not None})
    if ns.no_kv_offload:
        values["kv_offload"] = False
    values["vllm_args"] = tuple(rest)
    return ServerConfig(**values)  # type: ignore[arg-type]


def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT/SIGTERM, then stop the engine cleanly."""
    import uvicorn

    from server.app import create_app

    app = create_app(config)
    log.info("serving on http://%s:%d (KV offload %s)", config.host, config.port,
             "on" if config.kv_offload else "off")  # fmt: skip
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                       access_log=False, timeout_keep_alive=5, lifespan="on")
    )  # fmt: skip
    app.state.server = server  # vLLM's engine-error handler stops it when the engine dies
    server.run()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``langgraph-kvcache`` and ``python -m server``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        help_parser().parse_args(argv)
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_argv(argv)
        serve(config)
    except ConfigError as exc:
        print(f"langgraph-kvcache: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
