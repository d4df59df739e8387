"""Shifted reuse's parts: runs of a session's tokens found at other positions and the paged
blocks planned from them (scheduler side, no torch), the token layout of vLLM's CPU KV cache
(its own cache-write kernel) and the re-rotation of keys against vLLM's rotary embedding."""

from __future__ import annotations

import pytest

from server.kv.scheduler.continuations import Continuations
from server.kv.scheduler.shifted import (
    Segment,
    ShiftedHit,
    find_runs,
    plan_blocks,
    tail_or_shifted,
)
from server.kv.scheduler.tails import TailHit

BS = 8


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_runs_cover_the_prompt_from_where_the_exact_match_stopped() -> None:
    system, old, kept, new = _ids(1000, 5), _ids(2000, 7), _ids(3000, 20), _ids(4000, 6)
    stored = Continuations.packed(system + old + kept)
    prompt = Continuations.packed(system + kept + new)
    runs = find_runs(stored, prompt, 0, len(system + kept + new), min_run=4)
    # the system prompt in place, then the kept history 7 positions earlier; new tokens stop it
    assert runs == [(0, 0, 5), (5, 12, 20)]
    assert find_runs(stored, prompt, 0, 25, min_run=21) == []  # no run is that long


def test_blocks_split_where_a_run_or_a_stored_block_ends_and_stop_where_no_tier_has_one() -> None:
    runs = [(0, 0, 5), (5, 12, 20)]  # from the test above: 25 tokens, 3 blocks of 8 and one
    blocks = ["b0", "b1", "b2", "b3"]  # the stored path: 32 tokens
    planned = plan_blocks(runs, blocks, BS, lambda key: True)
    assert len(planned) == 4
    assert planned[0] == (
        Segment("b0", 0, 0, 5, 0),  # the system prompt in place
        Segment("b1", 4, 5, 3, -7),  # stored 12..14 -> 5..7
    )
    assert planned[1] == (Segment("b1", 7, 0, 1, -7), Segment("b2", 0, 1, 7, -7))
    assert planned[2] == (Segment("b2", 7, 0, 1, -7), Segment("b3", 0, 1, 7, -7))
    assert planned[3] == (Segment("b3", 7, 0, 1, -7),)  # the last block in part
    # a source in no tier (neither RAM nor disk) ends the hit before the block that needs it
    assert len(plan_blocks(runs, blocks, BS, lambda key: key != "b3")) == 2
    assert plan_blocks(runs[:1], blocks, BS, lambda key: True) == ((Segment("b0", 0, 0, 5, 0),),)


def test_a_seam_inside_a_block_starts_the_runs_after_the_exact_part_of_that_block() -> None:
    # the exact match ends 2 tokens into block 1 (a seam there): runs of 4 tokens or more
    # from the block's start find nothing, runs from the seam find the kept history
    system, old, kept, new = _ids(1000, 10), _ids(2000, 7), _ids(3000, 12), _ids(4000, 6)
    stored = Continuations.packed(system + old + kept)
    prompt = Continuations.packed(system + kept + new)
    assert find_runs(stored, prompt, BS, len(system + kept), min_run=4) == []
    runs = find_runs(stored, prompt, 10, len(system + kept), min_run=4)
    assert runs == [(10, 17, 12)]
    head = Segment("tail", 0, 0, 2, 0)  # block 1's first 2 tokens, read in place
    planned = plan_blocks(runs, ["b0", "b1", "b2", "b3"], BS, lambda key: True, head)
    assert planned == (
        (head, Segment("b2", 1, 2, 6, -7)),  # stored 17..22 -> 10..15
        (Segment("b2", 7, 0, 1, -7), Segment("b3", 0, 1, 5, -7)),  # the last block in part
    )


def test_a_partial_block_on_disk_too_small_to_read_alone_still_leads_a_shifted_hit() -> None:
    saved = TailHit("saved-tail", 1, 1, "disk")
    partial = TailHit("shared-block", 1, 2, "disk")  # 2 of 128 tokens: not worth a read alone
    asked: list[TailHit | None] = []

    def shift(head: TailHit | None) -> ShiftedHit | None:
        asked.append(head)
        return ShiftedHit(1, ((Segment("shared-block", 0, 0, 2, 0),),), 502)

    assert tail_or_shifted(saved, partial, None, 128) == (saved, None)
    tail, shifted = tail_or_shifted(saved, partial, shift, 128)
    assert tail is None and shifted is not None and shifted.tokens == 502
    assert asked == [partial]  # the shifted hit was offered the partial block to lead it
    in_ram = TailHit("shared-block", 1, 2, "ram")
    assert tail_or_shifted(saved, in_ram, lambda head: None, 128) == (in_ram, None)
    assert tail_or_shifted(None, TailHit("b", 1, 16, "disk"), None, 128)[0] is not None


torch = pytest.importorskip("torch")
pytest.importorskip("vllm._custom_ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_layout_names_every_key_and_value_element(dtype: torch.dtype) -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from server.kv.worker.token_layout import TokenLayout

    block, heads, head_size = 128, 2, 32
    cache = torch.zeros((3, heads, block, 2 * head_size), dtype=dtype)
    layout = TokenLayout.probe([cache], block)
    assert layout.known, layout.reason
    keys, values = cache.view(3, heads, 2 * block, head_size).chunk(2, dim=2)
    k = torch.randn(10, heads, head_size).to(dtype)
    v = torch.randn(10, heads, head_size).to(dtype)
    slots = torch.arange(block + 5, block + 15)  # tokens 5..14 of block 1
    isa = _get_attn_isa(dtype, block, head_size)
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa)
    where = layout.maps[0]
    assert where is not None
    got = cache[1].reshape(-1)[where[torch.arange(5, 15)]]
    assert torch.equal(got[:, 0], k)
    assert torch.equal(got[:, 1], v)


@pytest.mark.parametrize("neox", [True, False])
def test_a_stored_key_rotated_by_delta_is_the_key_at_the_new_position(neox: bool) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding

    from server.kv.worker.rotation import Rotation

    rotary_embedding._ROPE_DICT.clear()
    with set_current_vllm_config(VllmConfig()):
        rope = rotary_embedding.get_rope(
            32, 4096, is_neox_style=neox,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )  # fmt: skip
        rotation, why = Rotation.from_model()
        assert rotation is not None, why
        heads, n = 2, 6
        raw = torch.randn(n, heads * 32)
        positions = torch.tensor([5, 100, 700, 50, 3000, 1])
        delta = torch.tensor([-3, 40, -600, 0, 500, 7])
        _, stored = rope.forward_native(positions, torch.zeros_like(raw), raw.clone())
        _, wanted = rope.forward_native(positions + delta, torch.zeros_like(raw), raw.clone())
    moved = rotation.rotate(stored.view(n, heads, 32), delta)
    assert torch.allclose(moved, wanted.view(n, heads, 32), atol=1e-3)
    assert not torch.allclose(stored.view(n, heads, 32)[0], wanted.view(n, heads, 32)[0])
    rotary_embedding._ROPE_DICT.clear()


@pytest.mark.parametrize(
    ("offload", "strided", "read"),
    [("auto", True, False), ("int8", True, False), ("auto", False, False), ("auto", True, True)],
)
def test_a_shifted_load_moves_each_token_from_the_pool_into_its_new_slot(
    offload: str, strided: bool, read: bool
) -> None:
    """The worker's path on vLLM's CPU layout: slots read in the RAM pool (exact) or decoded
    (int8), tokens gathered from two stored blocks, keys rotated, values as stored; as
    strided views of each kind, or one index per element (a layout that is not affine); with
    ``read``, the second source is a block's bytes read from disk without a slot."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from server.kv.formats import BlockFormat
    from server.kv.groups import LayerBlocks
    from server.kv.metadata import LoadJob, ShiftItem, ShiftSegment, ShiftSource
    from server.kv.tiers.codec import BlockCodec
    from server.kv.tiers.ram import RamPool
    from server.kv.worker.rotation import Rotation
    from server.kv.worker.shifted_loads import ShiftedLoads
    from server.kv.worker.token_layout import TokenLayout

    block, heads, head_size, layers = 128, 2, 32, 2
    kv = [torch.zeros((4, heads, block, 2 * head_size)) for _ in range(layers)]
    isa = _get_attn_isa(torch.float32, block, head_size)
    for layer in kv:  # stored blocks 1 and 2, every token
        keys, values = layer.view(4, heads, 2 * block, head_size).chunk(2, dim=2)
        k, v = torch.randn(2 * block, heads, head_size), torch.randn(2 * block, heads, head_size)
        slots = torch.arange(block, 3 * block)
        ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa)
    layer_bytes = tuple(v[0].numel() * 4 for v in kv)
    fmt = BlockFormat(offload, "float32", layer_bytes, kv_heads=heads, block_tokens=block)
    pool = RamPool(2, BlockCodec(fmt, [tuple(v.shape[1:]) for v in kv]))
    pool.save(kv, LayerBlocks([1, 2]), [0, 1])
    stored = [torch.empty((3, *v.shape[1:])) for v in kv]  # what the pool gives back
    pool.load(stored, [0, 1], LayerBlocks([1, 2]))

    theta = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    angles = torch.arange(4096).float()[:, None] * theta[None, :]
    rotation = Rotation(torch.cat([angles.cos(), angles.sin()], dim=-1), 32, neox=True)
    layout = TokenLayout.probe(kv, block)
    assert all(s is not None for s in layout.strides)  # the CPU layout is affine per kind
    if not strided:
        layout.strides = [None] * layers
    item = ShiftItem(3, (ShiftSegment(0, 100, 0, 28, -100), ShiftSegment(1, 0, 28, 90, 28)))
    sources = (ShiftSource("a", 0), ShiftSource("b", 1, "disk"))
    buffers = {1: pool.copy_slot(1)} if read else {}
    job = LoadJob("r", (), True, (item,), sources)
    assert ShiftedLoads(layout, rotation).fill(pool, kv, job, buffers, set()) == []

    for i, layer in enumerate(kv):
        where = layout.maps[i]
        assert where is not None
        got = layer[3].reshape(-1)[where[torch.arange(118)]]  # [tokens, kv, heads, dim]
        src1 = stored[i][1].reshape(-1)[where[torch.arange(100, 128)]]
        src2 = stored[i][2].reshape(-1)[where[torch.arange(0, 90)]]
        want_v = torch.cat([src1[:, 1], src2[:, 1]])
        shift = torch.tensor([-100] * 28 + [28] * 90)
        want_k = rotation.rotate(torch.cat([src1[:, 0], src2[:, 0]]), shift)
        assert torch.equal(got[:, 1], want_v)
        assert torch.allclose(got[:, 0], want_k)
        untouched = layer[3].reshape(-1)[where[torch.arange(118, 128)]]
        assert not untouched.any()  # tokens past the segments are left for vLLM


def test_a_block_whose_source_read_failed_is_left_to_vllm() -> None:
    """A shifted block with a source whose disk read failed is not filled and is reported,
    the others are filled; a fill that cannot run at all reports every block (no exception)."""
    from server.kv.metadata import LoadJob, ShiftItem, ShiftSegment, ShiftSource
    from server.kv.worker.shifted_loads import ShiftedLoads

    items = (
        ShiftItem(3, (ShiftSegment(0, 0, 0, 8, 4),)),
        ShiftItem(4, (ShiftSegment(1, 0, 0, 8, 4),)),
    )
    job = LoadJob("r", (), True, items, (ShiftSource("a", 0), ShiftSource("b", -1, "disk")))
    cannot = ShiftedLoads(None, None, "the model has several KV cache groups")
    assert cannot.fill(None, [], job, {}, {1}) == [4, 3]
    assert job.shifted_slots == (0,) and job.shifted_reads == (1,)
