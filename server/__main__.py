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
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from server.config import ConfigError, ServerConfig, env_settings, settings_table
from server.flags import add_flags, flag_values

log = logging.getLogger("server")


def _own_parser() -> argparse.ArgumentParser:
    """Parses every flag of the config table (ours and vLLM's that map onto ServerConfig);
    the rest pass through to vLLM."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_flags(p, include_vllm=True)
    return p


def help_parser() -> argparse.ArgumentParser:
    """vLLM's serve parser with our group added and our defaults shown, for ``--help``."""
    from server.engine import vllm_parser
    from server.model import DEFAULT_MODEL_NAME, default_model_dir

    parser = vllm_parser()
    parser.prog = "langgraph-kvcache serve"
    add_flags(parser, include_vllm=False)
    try:
        cfg = ServerConfig.from_env()
    except ConfigError:
        cfg = ServerConfig()
    defaults: dict[str, object] = {}
    for name, s in settings_table():
        if s.flag is None:
            continue
        value = getattr(cfg, name)
        dest = s.flag.lstrip("-").replace("-", "_") if s.vllm else name
        if s.negated:
            value = not value
        elif s.size and isinstance(value, int):
            value = _human(value)
        elif isinstance(value, Path):
            value = str(value)
        defaults[dest] = value
    defaults.update(
        model=cfg.model or str(default_model_dir()),
        served_model_name=cfg.served_model_name or f"{DEFAULT_MODEL_NAME} (default model)",
        dtype=f"{cfg.dtype} (float32 on CPU)" if cfg.dtype == "auto" else cfg.dtype,
        kv_disk_dir=str(cfg.disk_dir),
        api_key=None,  # never print keys
    )
    parser.set_defaults(**defaults)
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
    values.update(flag_values(ns))
    values["vllm_args"] = tuple(rest)
    return ServerConfig(**values)  # type: ignore[arg-type]


def apply_wait_policy(config: ServerConfig, environ: MutableMapping[str, str]) -> None:
    """``OMP_WAIT_POLICY`` from ``--omp-wait-policy`` (``vllm``: left alone), unless
    ``environ`` already has one: libgomp reads it when torch loads it, so call this first."""
    if config.omp_wait_policy != "vllm" and not environ.get("OMP_WAIT_POLICY"):
        environ["OMP_WAIT_POLICY"] = config.omp_wait_policy.upper()


def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT/SIGTERM, then stop the engine cleanly."""
    apply_wait_policy(config, os.environ)  # before torch loads libgomp here or in a child
    import uvicorn

    from server.app import create_app
    from server.engine import resolve_model, served_names

    app = create_app(config)
    log.info("serving on http://%s:%d (KV offload %s)", config.host, config.port,
             "on" if config.kv_offload else "off")  # fmt: skip
    model, served = resolve_model(config)
    names = served_names(config, model, served)
    log.info("clients send model=%s (ChatKVCache(model=%r)); also accepted: %s", names[0],
             names[-1], ", ".join(names[1:]) or "nothing else")  # fmt: skip
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
    try:
        config = config_from_argv(argv)
        serve(config)
    except ConfigError as exc:
        print(f"langgraph-kvcache: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
