"""The resident KV budget ``python -m server`` gives vLLM when ``--kv-cache-memory-bytes`` is
not set: modest on CPU (vLLM's CPU default takes 92% of the memory node), vLLM's own on GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.config import DEFAULT_CPU_KV_CACHE_MEMORY_BYTES, ServerConfig
from server.engine import resident_kv_bytes, vllm_argv

SMOLLM2 = {  # SmolLM2-135M's KV geometry: 46,080 bytes a token in float32
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "hidden_size": 576, "max_position_embeddings": 8192,
}  # fmt: skip


@pytest.fixture
def model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    return str(tmp_path)


def test_cpu_default_is_modest_and_holds_one_full_context(model: str) -> None:
    budget, why = resident_kv_bytes(ServerConfig(), model, "float32", on_cpu=True)
    assert budget == DEFAULT_CPU_KV_CACHE_MEMORY_BYTES == 512 << 20
    assert why == "CPU default"
    assert budget >= 8192 * 46_080  # the model's whole 8192-token context fits


def test_cpu_default_grows_to_one_context_when_the_context_needs_more(model: str) -> None:
    cfg = ServerConfig(max_model_len=20_000)
    budget, why = resident_kv_bytes(cfg, model, "float32", on_cpu=True)
    assert budget == 157 * 128 * 46_080  # 20,000 tokens -> 157 blocks of 128
    assert why == "one 20000-token context of the model (CPU default)"
    half, _ = resident_kv_bytes(cfg, model, "bfloat16", on_cpu=True)  # 441 MiB: below 512
    assert half == DEFAULT_CPU_KV_CACHE_MEMORY_BYTES
    longer = ServerConfig(max_model_len=40_000)
    half, _ = resident_kv_bytes(longer, model, "bfloat16", on_cpu=True)
    assert half == 313 * 128 * 46_080 // 2


@pytest.mark.parametrize("flag", [("--tensor-parallel-size", "2"), ("-tp=2",)])
def test_tensor_parallel_workers_split_the_cpu_budget(model: str, flag: tuple[str, ...]) -> None:
    # On CPU --kv-cache-memory-bytes is per worker: two workers with half the heads each.
    budget, why = resident_kv_bytes(ServerConfig(vllm_args=flag), model, "float32", True)
    assert budget == DEFAULT_CPU_KV_CACHE_MEMORY_BYTES // 2
    assert why == "CPU default, 2 tensor-parallel workers"
    long = ServerConfig(max_model_len=20_000, vllm_args=flag)
    assert resident_kv_bytes(long, model, "float32", True)[0] == 157 * 128 * 46_080 // 2


def test_the_flag_wins_and_gpus_keep_vllm_sizing(model: str) -> None:
    given = ServerConfig(kv_cache_memory_bytes=96 << 20)
    assert resident_kv_bytes(given, model, "float32", on_cpu=True) == (
        96 << 20,
        "--kv-cache-memory-bytes",
    )
    assert resident_kv_bytes(ServerConfig(), model, "auto", on_cpu=False)[0] is None
    util = ServerConfig(vllm_args=("--gpu-memory-utilization", "0.5"))
    assert resident_kv_bytes(util, model, "float32", on_cpu=True)[0] is None


def test_unknown_geometry_falls_back_to_the_cpu_default(tmp_path: Path) -> None:
    budget, _ = resident_kv_bytes(ServerConfig(), "org/hub-model", "float32", on_cpu=True)
    assert budget == DEFAULT_CPU_KV_CACHE_MEMORY_BYTES


def test_no_flags_pass_the_cpu_default_to_vllm(model: str) -> None:
    from server.engine import _on_cpu

    if not _on_cpu():
        pytest.skip("the CPU default applies on CPU only")
    argv = vllm_argv(ServerConfig(model=model))
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(512 << 20)
    assert argv.count("--kv-cache-memory-bytes") == 1
