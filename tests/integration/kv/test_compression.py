"""``--kv-offload-dtype`` on the default model: hits from compressed blocks answer like the
cache-off run, blocks are stored smaller, and files of another format are a miss.

The short version of ``benchmarks/compression.py quality`` (which runs >= 100 prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kv_engine import BLOCK, block_bytes_of, engine_kwargs, run_engine_script

from server.kv.formats import SCALE_GROUP
from server.kv.registry import Registry
from server.kv.tiers.block_frame import PAGE

pytestmark = pytest.mark.vllm

PASSAGES = [
    "The lighthouse keeper of Varn Island kept a log of every ship that passed. In spring the "
    "fishing boats came north; in autumn the grain ships went south. ",
    "The old railway ran from the harbour to the mines in the hills. Each morning a train of "
    "empty wagons climbed the valley, and each evening it came back loaded with copper ore. ",
    "The village choir met on Thursdays in the school hall. They sang hymns in winter and folk "
    "songs in summer, and every year they travelled to the festival in the capital. ",
]
QUESTIONS = ["What happened in autumn?", "What did the train carry?", "When did they meet?"]


def turns_for(i: int) -> list[dict[str, Any]]:
    """Cache-off reference (its blocks are saved), then the same prompt as a tier hit."""
    chat = [
        {"role": "user", "content": PASSAGES[i] * 16 + "Summarise this in one sentence."},
        {"role": "assistant", "content": "It is a short story about a place and its people."},
        {"role": "user", "content": QUESTIONS[i]},
    ]
    common = {"messages": chat, "session": f"s{i}", "max_tokens": 24, "keep_text": False}
    return [{**common, "cache": False}, {**common, "reset": True}]


def run(model: Path, cache: Path, tmp_path: Path, fmt: str, prompts: range) -> list[dict]:
    turns = [t for i in prompts for t in turns_for(i)]
    return run_engine_script({"engine": _engine(model, cache, fmt), "turns": turns}, tmp_path)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_int8_hits_answer_like_cache_off_and_other_formats_miss(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    results = run(smollm2_dir, cache, tmp_path, "int8", range(len(PASSAGES)))
    pairs = list(zip(results[::2], results[1::2], strict=True))
    for ref, hit in pairs:
        assert ref["num_cached_tokens"] == 0 and ref["prompt_len"] > 3 * BLOCK
        assert hit["num_cached_tokens"] >= 3 * BLOCK  # the history came from the RAM tier
    firsts = [first_divergence(ref["tokens"], hit["tokens"]) for ref, hit in pairs]
    assert min(firsts) >= 4  # garbage KV would change the answer at once
    diffs = [
        abs(a - b)
        for (ref, hit), f in zip(pairs, firsts, strict=True)
        for a, b in zip(ref["logprobs"][:f], hit["logprobs"][:f], strict=True)
    ]
    assert sum(diffs) / len(diffs) < 0.05
    (manifest,) = cache.glob("blocks/*/manifest.json")
    assert json.loads(manifest.read_text())["offload_dtype"] == "int8"
    head = json.loads((smollm2_dir / "config.json").read_text())["head_dim"]
    group = SCALE_GROUP if head % SCALE_GROUP == 0 else head
    ratio = 4 * group / (group + 4)  # int8 plus a float16 scale and center per group
    files = list(manifest.parent.rglob("*.kvb"))
    assert files and all(
        f.stat().st_size < block_bytes_of(smollm2_dir) / ratio + 2 * PAGE for f in files
    )
    reg = Registry(cache / "sessions.sqlite3")
    stats = reg.stats()
    reg.close()
    assert stats['lgkv_hit_blocks_total{tier="ram"}'] >= 3 * len(pairs)
    assert stats['lgkv_kv_compression_ratio{format="int8"}'] == pytest.approx(ratio)
    # A restart with another format finds no usable block: recomputed, the cache-off answer.
    (hit,) = run_engine_script(
        {"engine": _engine(smollm2_dir, cache, "auto"), "turns": [turns_for(0)[1]]}, tmp_path
    )
    assert hit["num_cached_tokens"] == 0
    assert hit["tokens"] == pairs[0][0]["tokens"]


def _engine(model: Path, cache: Path, fmt: str) -> dict[str, Any]:
    engine = engine_kwargs(model, cache)
    engine["kv_cache_memory_bytes"] = 48 * block_bytes_of(model)
    engine["kv_connector_extra_config"]["offload_dtype"] = fmt
    return engine
