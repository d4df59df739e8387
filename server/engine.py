"""Turn a :class:`~server.config.ServerConfig` into vLLM's own arguments and engine client.

vLLM's OpenAI frontend (routes, chat templates, streaming, tool parsers) reads an
``argparse.Namespace`` built by its parser; :func:`build_vllm_args` produces exactly that
namespace from our typed config plus the pass-through flags, with our defaults (prompt token
details on, prefix caching on, auto tool choice with the hermes parser and forced tool calls
constrained to the tool's schema (``--tool-strict-level parameter``), the session connector).
:func:`start_engine` is vLLM's own ``AsyncLLM`` factory; with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
(vLLM's default) the engine core runs in a child process.

vLLM is imported inside the functions only.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from server.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY_BYTES,
    ConfigError,
    ServerConfig,
)
from server.connector_config import connector_extra_config, redis_namespace
from server.kv.layout import transfer_config

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

TOOL_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
"""ChatML with hermes-style tool calls, for ChatML models whose template has no tools."""
FORCED_TEXT_PROCESSOR = "server.forced_text:WholeForcedTokens"
"""The vLLM logits processor of ``--whole-forced-tokens`` (``module:class``; vLLM imports it in
the engine's worker)."""
SHUTDOWN_TIMEOUT_S = 30
"""Default ``--shutdown-timeout``: on SIGTERM the engine drains in-flight requests and the
connector's queued disk writes for at most this long (vLLM's own default, 0, aborts at once
and loses the writes still queued)."""
CPU_BLOCK_TOKENS = 128
"""vLLM's KV block size on CPU."""
log = logging.getLogger("server")


class ModelNotFoundError(ConfigError):
    """The model folder to serve does not exist; the message says how to build it."""


def resolve_model(config: ServerConfig) -> tuple[str, str]:
    """The model to load and the name clients use for it.

    Raises:
        ModelNotFoundError: no ``--model`` was given and the default folder is not built.
    """
    from server.model import DEFAULT_MODEL_NAME, default_model_dir

    if config.model is None:
        folder = default_model_dir()
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"The default model folder {folder} is missing. Build it with `make setup` or "
                "`python -m server.model`, or pass --model / LGKV_MODEL."
            )
        return str(folder), config.served_model_name or DEFAULT_MODEL_NAME
    path = Path(config.model).expanduser()
    looks_local = config.model.startswith((".", "/", "~")) or path.exists()
    if looks_local and not (path / "config.json").is_file() and not path.is_file():
        raise ModelNotFoundError(
            f"--model {config.model!r}: no model there (expected a folder with config.json)."
        )
    model = str(path) if looks_local else config.model
    return model, config.served_model_name or model


def served_names(config: ServerConfig, model: str, served_name: str) -> list[str]:
    """The names clients may send as ``model``: the served name (the first; responses carry
    it), and, for a local folder served without ``--served-model-name``, the folder's name too
    (``--model /models/Qwen3-0.6B`` answers to ``Qwen3-0.6B`` as well as to the path)."""
    names = [served_name]
    if config.served_model_name is None and config.model is not None:
        folder = Path(model).name
        if Path(model).is_dir() and folder and folder not in names:
            names.append(folder)
    return names


def tool_template_for(model: str) -> Path | None:
    """:data:`TOOL_TEMPLATE` when ``model`` is a local ChatML model whose own chat template
    knows nothing of tools (SmolLM2), so tool definitions reach the prompt and tool turns
    render; else ``None`` (the model's own template)."""
    folder = Path(model)
    own = ""
    if (folder / "chat_template.jinja").is_file():
        own = (folder / "chat_template.jinja").read_text()
    elif (folder / "tokenizer_config.json").is_file():
        own = str(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    if "<|im_start|>" in own and "tools" not in own:
        return TOOL_TEMPLATE
    return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def vllm_argv(config: ServerConfig) -> list[str]:
    """The vLLM command line equivalent to ``config`` (our defaults first, pass-through last)."""
    model, served_name = resolve_model(config)
    on_cpu = _on_cpu()
    dtype = "float32" if config.dtype == "auto" and on_cpu else config.dtype
    argv = [
        "--model", model,
        "--served-model-name", *served_names(config, model, served_name),
        "--dtype", dtype,
        "--host", config.host,
        "--port", str(config.port),
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching",
    ]  # fmt: skip
    if config.max_model_len is not None:
        argv += ["--max-model-len", str(config.max_model_len)]
    resident, _why = resident_kv_bytes(config, model, dtype, on_cpu)
    if resident is not None:
        argv += ["--kv-cache-memory-bytes", str(resident)]
    enforce_eager = on_cpu if config.enforce_eager is None else config.enforce_eager
    if enforce_eager:
        argv.append("--enforce-eager")
    if config.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
        if not _has_flag(config.vllm_args, "--tool-strict-level"):
            argv += ["--tool-strict-level", config.tool_strict_level]
        template = tool_template_for(model)
        if template is not None and not _has_flag(config.vllm_args, "--chat-template"):
            argv += ["--chat-template", str(template)]
    if config.whole_forced_tokens and not _has_flag(config.vllm_args, "--logits-processors"):
        argv += ["--logits-processors", FORCED_TEXT_PROCESSOR]
    if config.api_keys:
        argv += ["--api-key", *config.api_keys]
    if not _has_flag(config.vllm_args, "--shutdown-timeout"):
        argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if config.kv_offload:
        if _has_flag(config.vllm_args, "--kv-transfer-config"):
            raise ConfigError(
                "--kv-transfer-config conflicts with the session KV connector; "
                "add --no-kv-offload to run your own connector."
            )
        extra = {
            **connector_extra_config(config, model),
            "redis_namespace": redis_namespace(config, served_name),
        }
        argv += ["--kv-transfer-config", json.dumps(transfer_config(extra, model))]
    return argv + list(config.vllm_args)


def resident_kv_bytes(
    config: ServerConfig, model: str, dtype: str, on_cpu: bool
) -> tuple[int | None, str]:
    """The resident KV budget (``--kv-cache-memory-bytes``, per worker as vLLM reads it) to
    give vLLM, and where it comes from: the flag, as given; on CPU
    :data:`~server.config.DEFAULT_CPU_KV_CACHE_MEMORY_BYTES` in all, raised to one
    ``--max-model-len`` context of the model where that needs more, and split over the
    tensor-parallel workers (each holds its share of the heads); on GPUs ``None`` (vLLM's
    own ``--gpu-memory-utilization`` sizing)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    if not on_cpu or _has_flag(config.vllm_args, "--gpu-memory-utilization"):
        return None, "vLLM's own sizing (--gpu-memory-utilization)"
    tp = _tensor_parallel_size(config.vllm_args)
    per = f", {tp} tensor-parallel workers" if tp > 1 else ""
    context = _context_bytes(model, dtype, config.max_model_len)
    if context is not None and context[0] > DEFAULT_CPU_KV_CACHE_MEMORY_BYTES:
        why = f"one {context[1]}-token context of the model (CPU default{per})"
        return -(-context[0] // tp), why
    return DEFAULT_CPU_KV_CACHE_MEMORY_BYTES // tp, f"CPU default{per}"


def _tensor_parallel_size(args: tuple[str, ...]) -> int:
    """``--tensor-parallel-size``/``-tp`` among vLLM's pass-through flags (1 without)."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "--tensor_parallel_size", "-tp"):
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                return max(1, int(raw))
            except ValueError:
                return 1  # vLLM's own parser reports the bad value
    return 1


def _context_bytes(model: str, dtype: str, max_model_len: int | None) -> tuple[int, int] | None:
    """(KV bytes, tokens) of one full context, from a local model folder's config.json;
    ``None`` when the folder or its geometry is not there."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        tokens = int(max_model_len or cfg["max_position_embeddings"])
        per_token = 2 * int(cfg["num_hidden_layers"]) * int(kv_heads) * int(head)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    blocks = -(-tokens // CPU_BLOCK_TOKENS)
    elem = 4 if dtype in ("float32", "float") else 2
    return blocks * CPU_BLOCK_TOKENS * per_token * elem, tokens


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    names = {flag, flag.replace("-", "_").replace("__", "--", 1)}
    return any(a.split("=", 1)[0] in names for a in args)


def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's own ``vllm serve`` parser (every engine and frontend flag)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="langgraph-kvcache serve"))


def build_vllm_args(config: ServerConfig) -> argparse.Namespace:
    """vLLM's serve namespace for ``config``, validated like ``vllm serve`` does.

    Raises:
        ConfigError: a pass-through flag is unknown or invalid, the model is missing, or the
            parallel layout is one the session KV connector refuses (pipeline parallel).
    """
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.logger import configure_logging_from_args

    import server.tool_parser  # noqa: F401  (registers --tool-call-parser lgkv_hermes)
    from server.logs import use_vllm_logging

    argv = vllm_argv(config)
    parser = vllm_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed what is wrong
        raise ConfigError(f"invalid vLLM arguments: {' '.join(config.vllm_args)}") from exc
    configure_logging_from_args(args)  # vLLM's logging now (it would at engine start)...
    use_vllm_logging()  # ...so that ours, from the first line on, has its format too
    validate_parsed_serve_args(args)
    if config.kv_offload:
        from server.kv.scheduler.ranks import ParallelismNotSupported, check_parallel

        try:
            check_parallel(args)
        except ParallelismNotSupported as exc:
            raise ConfigError(str(exc)) from exc
    resident, why = resident_kv_bytes(config, args.model, args.dtype, _on_cpu())
    if resident is not None:
        rest = "the KV tiers hold the rest" if config.kv_offload else "no KV tiers"
        log.info("resident KV cache: %d MiB (%s); %s", resident >> 20, why, rest)
    try:
        validate_api_server_args(args)
    except KeyError as exc:
        raise ConfigError(str(exc)) from exc
    return args


@asynccontextmanager
async def start_engine(
    args: argparse.Namespace, *, cache_dir: Path | None = None
) -> AsyncIterator[EngineClient]:
    """vLLM's ``AsyncLLM`` for ``args``; shut down when the block exits.

    With ``cache_dir``, shared memory that a killed predecessor's engine left is reclaimed
    before the engine starts, this engine's segments are recorded once it is up, and what its
    stop left behind is reclaimed after it exits (:mod:`server.shm`).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.entry import (
        build_async_engine_client_from_engine_args,
    )

    from server import shm

    if cache_dir is not None:
        shm.reclaim_segments(cache_dir)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    try:
        async with build_async_engine_client_from_engine_args(engine_args) as engine:
            if cache_dir is not None:
                shm.record_segments(cache_dir)
            yield engine
    finally:
        if cache_dir is not None:
            shm.reclaim_segments(cache_dir, own=True)
