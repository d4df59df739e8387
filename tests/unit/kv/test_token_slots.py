"""Tail blocks are saved with the slots past their tokens zeroed, on vLLM's real CPU KV layout
(its cache-write kernel places the tokens; no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("vllm._custom_ops")

from server.kv.groups import LayerBlocks  # noqa: E402
from server.kv.keys import tail_key  # noqa: E402
from server.kv.metadata import SaveItem, StepPlan  # noqa: E402
from server.kv.worker.token_slots import TokenSlots  # noqa: E402
from server.kv.worker.worker import SessionKVWorker  # noqa: E402

BLOCK, HEADS, HEAD_SIZE, NUM_BLOCKS = 128, 2, 32, 4
LAYERS = ["l0", "l1"]


def _write(cache: torch.Tensor, block: int, tokens: range, seed: int) -> None:
    """Write random K/V of ``tokens`` (positions in ``block``) with vLLM's CPU kernel."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(cache.dtype, BLOCK, HEAD_SIZE)
    keys, values = cache.view(NUM_BLOCKS, HEADS, 2 * BLOCK, HEAD_SIZE).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(seed)
    n = len(tokens)
    k = torch.randn((n, HEADS, HEAD_SIZE), generator=gen).to(cache.dtype)
    v = torch.randn((n, HEADS, HEAD_SIZE), generator=gen).to(cache.dtype)
    slots = torch.tensor([block * BLOCK + t for t in tokens], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tail_copy_keeps_its_tokens_and_zeroes_the_rest(dtype: torch.dtype) -> None:
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)  # vLLM's CPU cache of one layer
    paged = torch.zeros(shape, dtype=dtype)
    _write(paged, 1, range(BLOCK), seed=1)  # an earlier request filled block 1
    _write(paged, 1, range(17), seed=2)  # this request's 17 tokens
    clean = torch.zeros(shape, dtype=dtype)
    _write(clean, 1, range(17), seed=2)  # the same 17 tokens in a fresh block
    before = paged.clone()

    slots = TokenSlots.probe([paged], BLOCK)
    assert slots.known
    (copy,) = slots.tail_copies([paged], LayerBlocks([1]), [17])
    assert torch.equal(copy[0], clean[1])
    assert torch.equal(paged, before)  # vLLM's paged cache is never written
    assert not torch.equal(before[1], clean[1])  # the leftovers were there


def test_the_worker_saves_tails_zeroed_and_full_blocks_whole(tmp_path: Path) -> None:
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)
    kv = {name: torch.zeros(shape) for name in LAYERS}
    for i, cache in enumerate(kv.values()):
        _write(cache, 2, range(BLOCK), seed=10 + i)  # leftovers of an earlier request
        _write(cache, 2, range(5), seed=20 + i)
        _write(cache, 3, range(BLOCK), seed=30 + i)
    layer_bytes = HEADS * BLOCK * 2 * HEAD_SIZE * 4
    worker = SessionKVWorker(
        num_slots=4,
        layers=LAYERS,
        layer_block_bytes=[layer_bytes] * 2,
        store=None,
        block_size=BLOCK,
    )
    worker.register_kv_caches(kv, NUM_BLOCKS)
    tail = tail_key("ab" * 32, [7, 8, 9, 10, 11])
    full = "cd" * 32
    worker.save(StepPlan(saves=[SaveItem(2, tail, 0, False), SaveItem(3, full, 1, False)]))
    assert worker.pool is not None
    for i, cache in enumerate(kv.values()):
        clean = torch.zeros(shape)
        _write(clean, 2, range(5), seed=20 + i)
        start = i * layer_bytes
        stored = worker.pool.slot(0)[start : start + layer_bytes].view(torch.float32)
        assert torch.equal(stored.view(shape[1:]), clean[2])
        stored = worker.pool.slot(1)[start : start + layer_bytes].view(torch.float32)
        assert torch.equal(stored.view(shape[1:]), cache[3])
    worker.shutdown()
