"""Architectures beyond Llama, each on its own engine process (tiny random-weight models whose
text depends on the context, :mod:`server.tiny_models`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kv_engine import engine_kwargs, run_engine_script

from server.kv.registry import Registry
from tests.sizes import LONG

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def mla_model_dir(smollm2_dir: Path) -> Path:
    from server.tiny_models import build_tiny_arch

    return build_tiny_arch("deepseek_v2", tokenizer_from=smollm2_dir)


def test_mla_on_cpu_gets_no_cached_tokens_and_the_cache_off_answers(
    mla_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM disables prefix caching for MLA on CPU (it cannot resume MLA from cached tokens
    there): the connector offers nothing, so turns 2 and 3 of a conversation whose history
    it would otherwise hold are computed in full and equal the cache-off run token for token
    (before the fix they read cached tokens and their logprobs were off by up to 0.77)."""
    engine = engine_kwargs(mla_model_dir, tmp_path / "cache")
    del engine["block_size"]  # MLA's own block size on CPU (16)
    # the reference CPU MLA backend, for which vLLM disables prefix caching (the AMX one
    # takes only 16-bit weights)
    engine["attention_backend"] = "CPU_MLA"
    prompt = [400 + (i * 37) % 3000 for i in range(300)]
    turns = [
        {"prompt": prompt, "session": "m", "max_tokens": 16},
        {"continue": list(range(900, 940)), "session": "m", "reset": True, "max_tokens": 16},
        {"continue": list(range(1900, 1920)), "session": "m", "reset": True, "max_tokens": 16},
    ]
    ref_turns = [{"repeat": n, "cache": False, "max_tokens": 16, "reset": True} for n in (1, 2)]
    *hit, ref_a, ref_b = run_engine_script({"engine": engine, "turns": turns + ref_turns}, tmp_path)
    ref = [ref_a, ref_b]
    assert len(set(hit[0]["tokens"])) > 1, "the tiny model's text must depend on the context"
    for got, want in zip(hit[1:], ref, strict=True):
        assert got["num_cached_tokens"] == 0
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    reg = Registry(tmp_path / "cache" / "sessions.sqlite3")
    try:
        assert not any(v for k, v in reg.stats().items() if k.startswith("lgkv_hit_")), (
            "no tier may serve a block"
        )
    finally:
        reg.close()


@pytest.mark.parametrize(
    ("arch", "dtype", "prompt_len", "text_varies"),
    [
        # vLLM 0.32's CPU Mamba-2 kernel fails past one 128-token block with prefix caching on
        # (IndexError in varlen_states, plain vLLM too): the conversation stays inside one.
        ("granitemoehybrid", "float32", 60, True),
        # CPU's gated-delta-net kernel needs bfloat16 and 128-wide heads; on it vLLM 0.32
        # answers this tiny model with token 0 throughout (transformers, float32 or bfloat16,
        # gives varied text from the same weights), so only "starts, reads nothing, equals
        # cache-off" is checked.
        ("qwen3_next", "bfloat16", 300, False),
    ],
)
def test_a_recurrent_hybrid_starts_and_answers_like_cache_off(
    arch: str,
    dtype: str,
    prompt_len: int,
    text_varies: bool,
    smollm2_dir: Path,
    tmp_path: Path,
) -> None:
    """A Mamba-2 hybrid (Granite 4) and a linear-attention hybrid (Qwen3-Next) did not start
    with the connector: vLLM turned its hybrid KV cache manager off for a connector without
    ``SupportsHMA`` and then failed ("Failed to promote local KV cache specs to one unified
    type"). They get the connector class that declares it, so vLLM keeps several KV cache
    groups; the tiers do not keep recurrent state yet, so the connector offers nothing, and a
    conversation whose history left vLLM's own cache is computed in full, equal to cache-off."""
    from server.kv.layout import HYBRID_CONNECTOR, connector_class_for
    from server.tiny_models import build_tiny_arch

    model_dir = build_tiny_arch(arch, tokenizer_from=smollm2_dir)
    assert connector_class_for(str(model_dir)) == HYBRID_CONNECTOR
    engine = engine_kwargs(model_dir, tmp_path / "cache")
    del engine["block_size"]  # vLLM sizes attention blocks to match the recurrent state's
    engine["dtype"] = dtype
    prompt = [400 + (i * 37) % 3000 for i in range(prompt_len)]
    turns = [
        {"prompt": prompt, "session": "h", "max_tokens": 12},
        {"continue": list(range(900, 920)), "session": "h", "reset": True, "max_tokens": 12},
    ]
    ref_turn = {"repeat": 1, "cache": False, "max_tokens": 12, "reset": True}
    *hit, ref_a = run_engine_script({"engine": engine, "turns": [*turns, ref_turn]}, tmp_path)
    ref = [ref_a]
    if text_varies:
        assert len(set(hit[0]["tokens"])) > 1, "the tiny model's text must depend on the context"
    assert hit[1]["num_cached_tokens"] == 0
    assert hit[1]["tokens"] == ref[0]["tokens"]
    assert hit[1]["logprobs"] == pytest.approx(ref[0]["logprobs"], abs=1e-4)


def test_sliding_window_groups_reuse_from_ram_and_disk_like_cache_off(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """Gemma 3's sliding-window and global layers run under vLLM's hybrid KV cache manager
    (the connector declares ``SupportsHMA``): two KV cache groups, the sliding one (a
    256-token window) holding only the blocks inside its window. The tiers keep every layer
    of each block; a later turn loads the global layers' blocks and the sliding layers' blocks
    inside the window, from RAM and, after a restart, from disk, and answers as cache-off."""
    import json

    from server.kv.layout import HYBRID_CONNECTOR, connector_class_for
    from server.tiny_models import build_tiny_arch

    gemma3_dir = build_tiny_arch("gemma3", tokenizer_from=smollm2_dir)
    assert connector_class_for(str(gemma3_dir)) == HYBRID_CONNECTOR
    cache = tmp_path / "cache"
    engine = engine_kwargs(gemma3_dir, cache)
    prompt = [400 + (i * 37) % 3000 for i in range(600)]
    turns = [
        {"prompt": prompt, "session": "g", "max_tokens": 16},
        {"continue": list(range(900, 940)), "session": "g", "reset": True, "max_tokens": 16},
    ]
    hit = run_engine_script({"engine": engine, "turns": turns}, tmp_path)
    # a new engine: RAM is empty, the blocks come from disk
    third = [*hit[1]["prompt"], *hit[1]["tokens"], *range(1900, 1930)]
    hit += run_engine_script(
        {"engine": engine, "turns": [{"prompt": third, "session": "g", "max_tokens": 16}]},
        tmp_path,
    )
    (manifest,) = cache.glob("blocks/*/manifest.json")
    assert sorted(set(json.loads(manifest.read_text())["groups"])) == [0, 1]
    # Damaged files: with several groups vLLM takes a failed load per request
    # (failed_recving), recomputes the request whole, and the usage says nothing was cached.
    for path in cache.glob("blocks/*/**/*"):
        if path.is_file() and path.name != "manifest.json":
            data = bytearray(path.read_bytes())
            data[-100:] = bytes(100)  # damage the payload, keep the size
            path.write_bytes(bytes(data))
    # on the same engine, the cache-off answers of turns 2 and 3
    bad, *ref = run_engine_script(
        {
            "engine": engine,
            "turns": [
                {"prompt": third, "session": "g", "max_tokens": 16},
                *(
                    {"prompt": t["prompt"], "cache": False, "max_tokens": 16, "reset": True}
                    for t in hit[1:]
                ),
            ],
        },
        tmp_path,
    )
    assert len(set(hit[0]["tokens"])) > 1, "the tiny model's text must depend on the context"
    assert [r["num_cached_tokens"] for r in ref] == [0, 0]
    # From RAM, every token before the new message: turn 1's 600 + 16 (the last one has no
    # KV); from disk after the restart, turn 2's five whole blocks (its tail was still to be
    # saved when that engine stopped).
    for got, want, least in zip(hit[1:], ref, (615, 640), strict=True):
        print(f"cached {got['num_cached_tokens']} of {len(got['prompt'])} prompt tokens")
        assert got["num_cached_tokens"] >= least
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    assert bad["num_cached_tokens"] == 0
    assert bad["tokens"] == ref[1]["tokens"]
    assert bad["logprobs"] == pytest.approx(ref[1]["logprobs"], abs=1e-4)


@pytest.mark.parametrize(
    "arch",
    [
        "mistral",  # one group of sliding-window layers: its window's skipped blocks are null
        pytest.param("qwen3", marks=pytest.mark.skipif(not LONG, reason="make test-long")),
        pytest.param("mixtral", marks=pytest.mark.skipif(not LONG, reason="make test-long")),
    ],
)
def test_architecture_reuses_history_from_ram_and_disk_like_cache_off(
    arch: str, smollm2_dir: Path, tmp_path: Path
) -> None:
    """Turn 2 from RAM, turn 3 from disk on a new engine; then, on that engine, both prompts
    cache-off: the same tokens and logprobs."""
    from server.tiny_models import build_tiny_arch

    engine = engine_kwargs(build_tiny_arch(arch, tokenizer_from=smollm2_dir), tmp_path / "c")
    turns = [
        {"prompt": [400 + (i * 37) % 3000 for i in range(600)], "session": "a", "max_tokens": 16},
        {"continue": list(range(900, 940)), "session": "a", "reset": True, "max_tokens": 16},
    ]
    hit = run_engine_script({"engine": engine, "turns": turns}, tmp_path)
    third = [*hit[1]["prompt"], *hit[1]["tokens"], *range(1900, 1930)]
    disk, *ref = run_engine_script(
        {
            "engine": engine,
            "turns": [
                {"prompt": third, "session": "a", "max_tokens": 16},
                *(
                    {"prompt": p, "cache": False, "max_tokens": 16, "reset": True}
                    for p in (hit[1]["prompt"], third)
                ),
            ],
        },
        tmp_path,
    )
    assert len(set(hit[0]["tokens"])) > 1, "the tiny model's text must depend on the context"
    assert [r["num_cached_tokens"] for r in ref] == [0, 0]
    for got, want, least in zip([hit[1], disk], ref, (615, 640), strict=True):
        assert got["num_cached_tokens"] >= least
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


@pytest.mark.skipif(not LONG, reason="75 s of two TP ranks: make test-long")
def test_sliding_window_groups_under_tensor_parallelism(smollm2_dir: Path, tmp_path: Path) -> None:
    """Two tensor-parallel ranks (one KV head each) and two KV cache groups: turn 2 loads turn
    1's blocks from RAM on both ranks and answers as cache-off on the same ranks."""
    from server.tiny_models import build_tiny_arch

    model = build_tiny_arch("gemma3", tokenizer_from=smollm2_dir)
    tp2 = {
        **engine_kwargs(model, tmp_path / "cache"),
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    turns = [
        {"prompt": [400 + (i * 37) % 3000 for i in range(600)], "session": "g", "max_tokens": 16},
        {"continue": list(range(900, 940)), "session": "g", "reset": True, "max_tokens": 16},
    ]
    ref_turn = {"repeat": 1, "cache": False, "max_tokens": 16, "reset": True}
    *hit, ref = run_engine_script({"engine": tp2, "turns": [*turns, ref_turn]}, tmp_path, env=env)
    assert hit[1]["num_cached_tokens"] == 615
    assert hit[1]["tokens"] == ref["tokens"]
    assert hit[1]["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-4)
