"""Shared helpers of the connector's integration tests: test model and engine arguments.

Kept out of conftest.py so that ``engine_script.py`` (a subprocess) can import them too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BLOCK = 128
RAM_BLOCKS = 8
DISK_BLOCKS = 24


def block_bytes_of(model_dir: Path) -> int:
    """Bytes of one block of all layers (K and V, float32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head * 4


def engine_kwargs(model_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """LLM(...) arguments of the test engine (also used by engine_script.py)."""
    bb = block_bytes_of(model_dir)
    return {
        "model": str(model_dir),
        "dtype": "float32",
        "block_size": BLOCK,  # CPU's default; explicit so the tests' arithmetic holds on GPUs
        "enforce_eager": True,
        "distributed_executor_backend": "uni",
        "kv_cache_memory_bytes": 128 * bb,
        "max_model_len": 4096,
        "seed": 0,
        "kv_connector_extra_config": {
            "cache_dir": str(cache_dir),
            "ram_bytes": RAM_BLOCKS * bb,
            "disk_bytes": DISK_BLOCKS * (bb + 256),
            "model_id": "tiny",
            "stats_flush_s": 0.01,
        },
    }


def transfer_config(extra: dict[str, Any], model: str | None = None) -> Any:
    """vLLM's KVTransferConfig selecting the connector, as the app builds it (vLLM's default
    kv_load_failure_policy="fail"; the connector switches it to "recompute")."""
    from server.kv.offline import transfer_config as build

    return build(extra, model)


def settle(llm: Any) -> None:
    """Wait for the engine's registry thread through the engine itself: a ``SYNC_OP`` request
    (what ``SessionControl.settle`` sends) finishes once the turns and stats queued before it
    are in the registry and the API process's changes (pins, drops) are applied."""
    from vllm import SamplingParams

    from langgraph_kvcache.contract import SYNC_OP, XARG_OP

    params = SamplingParams(max_tokens=1, extra_args={XARG_OP: SYNC_OP})
    llm.generate([{"prompt_token_ids": [0]}], params, use_tqdm=False)


def make_llm(kwargs: dict[str, Any]) -> Any:
    """An offline ``vllm.LLM`` with the connector."""
    from vllm import LLM

    kwargs = dict(kwargs)
    extra = kwargs.pop("kv_connector_extra_config")
    return LLM(**kwargs, kv_transfer_config=transfer_config(extra, kwargs["model"]))


def make_async_llm(kwargs: dict[str, Any]) -> Any:
    """An ``AsyncLLM`` (the server's engine client) with the connector."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = dict(kwargs)
    extra = kwargs.pop("kv_connector_extra_config")
    args = AsyncEngineArgs(**kwargs, kv_transfer_config=transfer_config(extra, kwargs["model"]))
    return AsyncLLM.from_engine_args(args)


def run_engine_script(
    spec: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run ``engine_script.py`` on ``spec`` in a fresh process; return its turn results."""
    spec_file = tmp_path / f"spec-{os.getpid()}-{len(list(tmp_path.iterdir()))}.json"
    spec_file.write_text(json.dumps(spec))
    script = Path(__file__).with_name("engine_script.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(spec_file)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])["turns"]
