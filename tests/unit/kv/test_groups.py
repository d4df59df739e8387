"""Blocks under several KV cache groups (:mod:`server.kv.groups`): refs, and the worker moving
each layer's bytes to and from its own group's paged block (no engine)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from server.kv.groups import NULL_BLOCK, LayerBlocks, block_refs, saveable

torch = pytest.importorskip("torch")

from server.kv.metadata import LoadItem, LoadJob, SaveItem, StepPlan  # noqa: E402
from server.kv.tiers.disk import DiskStore  # noqa: E402
from server.kv.tiers.manifest import Manifest  # noqa: E402
from server.kv.worker.worker import SessionKVWorker  # noqa: E402

NUM_BLOCKS, SHAPE = 16, (2, 8, 4)
LAYERS = ["global", "sliding"]
LAYER_BYTES = 2 * 8 * 4 * 4
KEY = "ab" * 32


def test_refs_pair_each_position_across_groups() -> None:
    assert block_refs([[5, 6, 7]]) == [5, 6, 7]  # one group: plain ids, as before groups
    assert saveable(5) and not saveable(NULL_BLOCK)  # one sliding group skips blocks too
    refs = block_refs([[5, 6, 7], [NULL_BLOCK, 9, 10]])
    assert refs == [(5, NULL_BLOCK), (6, 9), (7, 10)]
    assert [saveable(r) for r in refs] == [False, True, True]
    assert block_refs([[5, 6], [9]]) == [(5, 9), (6, NULL_BLOCK)]
    blocks = LayerBlocks(refs, layer_group=(0, 1, 1))
    assert blocks.of(0) == [5, 6, 7]
    assert blocks.of(2) == [NULL_BLOCK, 9, 10]


def make(tmp_path: Path, kv: dict[str, torch.Tensor]) -> SessionKVWorker:
    manifest = Manifest(
        "m", "torch.float32", 8, tuple(LAYERS), (LAYER_BYTES,) * 2, "x", groups=(0, 1)
    )
    worker = SessionKVWorker(
        num_slots=4,
        layers=LAYERS,
        layer_block_bytes=[LAYER_BYTES] * 2,
        store=DiskStore(tmp_path, manifest),
        layer_groups=manifest.groups,
    )
    worker.register_kv_caches(kv, NUM_BLOCKS)
    return worker


def test_each_layer_moves_through_its_groups_block(tmp_path: Path) -> None:
    kv = {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}
    worker = make(tmp_path, kv)
    # position 0 is global block 3 and sliding block 5
    worker.save(StepPlan(saves=[SaveItem((3, 5), KEY, 1, to_disk=True)]))
    saved = {"global": kv["global"][3].clone(), "sliding": kv["sliding"][5].clone()}
    null_before = kv["sliding"][NULL_BLOCK].clone()
    # a later request: global block 9; its sliding window skipped the position (null block)
    item = LoadItem((9, NULL_BLOCK), KEY, 1, "ram")
    worker.start_load(StepPlan(loads=[LoadJob("r", (item,), True)]))
    finished, errors = worker.collect()
    assert finished == {"r"} and not errors
    assert torch.equal(kv["global"][9], saved["global"])
    assert torch.equal(kv["sliding"][NULL_BLOCK], null_before)  # never written
    # from disk into both groups' blocks
    item = LoadItem((10, 11), KEY, -1, "disk")
    worker.start_load(StepPlan(loads=[LoadJob("d", (item,), True)]))
    deadline = time.monotonic() + 10
    while "d" not in finished and time.monotonic() < deadline:
        finished |= worker.collect()[0]
        time.sleep(0.01)
    assert torch.equal(kv["global"][10], saved["global"])
    assert torch.equal(kv["sliding"][11], saved["sliding"])
    worker.shutdown()


def test_a_failed_load_names_its_request(tmp_path: Path) -> None:
    """vLLM takes load failures per request when there are several groups."""
    kv = {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}
    worker = make(tmp_path, kv)
    item = LoadItem((4, 6), "cd" * 32, -1, "disk")  # no such file
    worker.start_load(StepPlan(loads=[LoadJob("q", (item,), True)]))
    finished: set[str] = set()
    errors: set = set()
    deadline = time.monotonic() + 10
    while "q" not in finished and time.monotonic() < deadline:
        f, e = worker.collect()
        finished, errors = finished | f, errors | e
        time.sleep(0.01)
    assert finished == {"q"} and errors == {(4, 6)}
    assert worker.failed_requests(errors, finished) == {"q"}
    assert worker.failed_requests({(4, 6)}, set()) == set()  # forgotten once finished
    worker.shutdown()


def _engine(*kinds: str, block_sizes: tuple[int, ...] = ()) -> tuple[object, object]:
    from types import SimpleNamespace as NS

    sizes = block_sizes or (128,) * len(kinds)
    specs = [type(k, (), {"block_size": b})() for k, b in zip(kinds, sizes, strict=True)]
    groups = [NS(kv_cache_spec=spec) for spec in specs]
    vllm_config = NS(cache_config=NS(enable_prefix_caching=True), model_config=None)
    return vllm_config, NS(kv_cache_groups=groups)


def test_which_group_layouts_are_served() -> None:
    from server.kv.layout import _mixed_attention, why_no_reuse

    assert why_no_reuse(*_engine("FullAttentionSpec")) is None
    assert why_no_reuse(*_engine("SlidingWindowSpec", "FullAttentionSpec")) is None
    both_sliding = why_no_reuse(*_engine("SlidingWindowSpec", "SlidingWindowSpec"))
    assert "holds every block" in str(both_sliding)
    assert "MambaSpec" in str(why_no_reuse(*_engine("MambaSpec", "FullAttentionSpec")))
    sizes = why_no_reuse(*_engine("SlidingWindowSpec", "FullAttentionSpec", block_sizes=(16, 128)))
    assert "block sizes" in str(sizes)
    assert _mixed_attention({"layer_types": ["sliding_attention", "full_attention"]})
    assert not _mixed_attention({"layer_types": ["full_attention"], "model_type": "llama"})
    assert _mixed_attention({"model_type": "gemma3", "text_config": {}})
    assert _mixed_attention({"text_config": {"model_type": "gemma2"}})
