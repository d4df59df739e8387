"""A request's load: its lookup (:class:`~server.kv.scheduler.requests.Lookup`) turned into a
:class:`~server.kv.metadata.LoadJob` on the blocks vLLM allocated for it.

Scheduler side (no torch, never blocks): RAM blocks read are locked until the worker reports
the load; blocks from disk or Redis get a RAM slot when one is free (promoted, so the next
turn finds them in RAM); positions a sliding window skips (vLLM's null block) copy nothing.
A shifted hit's sources are treated alike: in RAM locked, on disk read into a slot when one
is free (else into a temporary buffer), each once per job.
Hits and misses are counted as the lookup is taken.
"""

from __future__ import annotations

from server.kv.groups import NULL_BLOCK, BlockRef
from server.kv.metadata import NO_SLOT, LoadItem, LoadJob, ShiftItem, ShiftSegment, ShiftSource
from server.kv.scheduler.block_state import BlockState
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.publisher import Publisher
from server.kv.scheduler.requests import Lookup
from server.kv.scheduler.shifted import Segment

_NO_STATE = BlockState("")


def plan_load(
    request_id: str,
    index: BlockIndex,
    publisher: Publisher,
    lookup: Lookup,
    block_ids: list[BlockRef],
    num_external_tokens: int,
    *,
    block_size: int,
    async_loads: bool,
) -> LoadJob | None:
    """Request ``request_id``'s load of ``lookup`` into ``block_ids`` for the
    ``num_external_tokens`` vLLM took (the lookup whole, or cut to whole blocks); None when
    nothing is loaded. ``async_loads``: every load asynchronous (several KV cache groups)."""
    count = num_external_tokens // block_size
    publisher.count("lgkv_miss_blocks_total", lookup.misses + max(0, len(lookup.keys) - count))
    keys, tiers = lookup.keys[:count], lookup.tiers[:count]
    # vLLM takes a lookup whole or cut to whole blocks: a remainder is the tail's part
    tail = lookup.tail if num_external_tokens % block_size else None
    if tail is not None:
        keys, tiers = [*keys, tail.key], [*tiers, tail.tier]
        publisher.count("lgkv_hit_tail_tokens_total", num_external_tokens % block_size)
    shifted = ()
    if lookup.shifted is not None:  # a remainder is its last block's part
        whole = count - len(keys) + (1 if num_external_tokens % block_size else 0)
        shifted = lookup.shifted.blocks[: max(0, whole)]
    if not keys and not shifted:
        return None
    unslotted = [
        k
        for offset, (k, t) in enumerate(zip(keys, tiers, strict=True))
        if t != "ram"
        and block_ids[lookup.start + offset] != NULL_BLOCK  # skipped: never read
        and index.blocks.get(k, _NO_STATE).slot == NO_SLOT
    ]
    sources = list(dict.fromkeys(s.key for block in shifted for s in block))
    protect = {*keys, *sources}  # an eviction for a promotion never takes a source
    promote = index.alloc_slots(len(unslotted), protect=protect)
    items: list[LoadItem] = []
    for offset, (key, tier) in enumerate(zip(keys, tiers, strict=True)):
        block_id = block_ids[lookup.start + offset]
        kind = "tail" if tail is not None and key == tail.key else "block"
        publisher.count(f'lgkv_hit_{kind}s_total{{tier="{tier}"}}', 1)
        index.touch(key)
        if block_id == NULL_BLOCK:
            continue  # a sliding window skips this position: nothing to copy
        if tier == "ram":
            ram = index.blocks[key]
            ram.locks += 1
            items.append(LoadItem(block_id, key, ram.slot, "ram", kind == "tail"))
            continue
        slot = NO_SLOT
        state = index.blocks.get(key)
        if promote and (state is None or state.slot == NO_SLOT):
            slot = _promote(index, key, promote.pop())
        items.append(LoadItem(block_id, key, slot, tier, kind == "tail"))
    for slot in promote:  # not needed after all
        index.free_slots.append(slot)
    # as the lookup said: vLLM waits for an async load even when it cut the part that read disk
    is_async = async_loads or any(t != "ram" for t in tiers)
    is_async = is_async or (lookup.shifted is not None and lookup.shifted.disk)
    first = lookup.start + len(keys)
    moved, used = _plan_shifted(
        index, publisher, shifted, sources, block_ids[first : first + len(shifted)], protect
    )
    return LoadJob(request_id, tuple(items), is_async, moved, used)


def _promote(index: BlockIndex, key: str, slot: int) -> int:
    """Give block ``key`` RAM slot ``slot`` for a read from disk or Redis, locked until the
    worker reports it (the next turn then finds the block in RAM); returns ``slot``."""
    state = index.ensure(key)
    state.slot, state.ram_ready = slot, False
    state.locks += 1
    return slot


def _plan_shifted(
    index: BlockIndex,
    publisher: Publisher,
    blocks: tuple[tuple[Segment, ...], ...],
    keys: list[str],
    block_ids: list[BlockRef],
    protect: set[str],
) -> tuple[tuple[ShiftItem, ...], tuple[ShiftSource, ...]]:
    """The shifted blocks' items on ``block_ids``, and their sources (``keys``: each stored
    block they read, once, in first use order): a RAM one locked once,
    one on disk read into a promoted slot (locked) or, with no slot free, a temporary buffer
    (as looked up this step: RAM-ready or on disk)."""
    if not blocks:
        return (), ()
    number: dict[str, int] = {}
    sources: list[ShiftSource] = []
    for key in keys:
        state = index.blocks[key]
        index.touch(key)
        number[key] = len(sources)
        if state.ram_ready:
            state.locks += 1
            sources.append(ShiftSource(key, state.slot))
            continue
        slot = NO_SLOT  # a read into its slot in flight: read again, into a buffer
        if state.slot == NO_SLOT:
            promote = index.alloc_slots(1, protect=protect)
            if promote:
                slot = _promote(index, key, promote[0])
        sources.append(ShiftSource(key, slot, "disk"))
    items = tuple(
        ShiftItem(
            block_id,
            tuple(ShiftSegment(number[s.key], s.src, s.dst, s.count, s.delta) for s in block),
        )
        for block_id, block in zip(block_ids, blocks, strict=True)
    )
    moved = sum(s.count for block in blocks for s in block if s.delta)
    publisher.count("lgkv_hit_shifted_tokens_total", moved)
    publisher.count("lgkv_hit_shifted_blocks_total", len(blocks))
    ram = sum(s.source == "ram" for s in sources)
    publisher.count('lgkv_hit_shifted_sources_total{tier="ram"}', ram)
    publisher.count('lgkv_hit_shifted_sources_total{tier="disk"}', len(sources) - ram)
    return items, tuple(sources)
