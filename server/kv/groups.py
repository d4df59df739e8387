"""Block references under vLLM's hybrid KV cache manager: several KV cache groups.

With one KV cache group (every layer full attention, or vLLM's hybrid manager off) a request's
block is one paged block id, the same in every layer (a group of sliding-window layers, as
Mistral's, gives the positions its window skips the null block too). A model whose
sliding-window layers run beside global ones (Gemma 2/3, gpt-oss) gets several groups from the
hybrid manager: each group has its own block table, and a sliding-window group gives the blocks
its window skips vLLM's null block (id 0) instead of memory. The connector then names a
request's block by a :data:`BlockRef` holding its id in every group; both sides pass refs
through unchanged and only the worker turns them into each layer's paged block id
(:class:`LayerBlocks`).

Plain Python (no torch, no vLLM): the scheduler side and the worker share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest

BlockRef = int | tuple[int, ...]
"""A request's paged block: its id (one KV cache group), or its id in each group."""

NULL_BLOCK = 0
"""vLLM's null block id: a group holds nothing at that position (a skipped sliding-window
block). Never copied into or out of."""


def block_refs(per_group: Sequence[Sequence[int]]) -> list[BlockRef]:
    """A request's blocks as refs from vLLM's per-group block id lists (``KVCacheBlocks.
    get_block_ids()``, ``block_ids`` of scheduler output): plain ids for one group, else one
    tuple per position (a group with fewer blocks than the others counts as null there)."""
    if len(per_group) == 1:
        return list(per_group[0])
    return list(zip_longest(*per_group, fillvalue=NULL_BLOCK))


def saveable(ref: BlockRef) -> bool:
    """True when every group holds the block (a save reads every layer). One group of
    sliding-window layers (Mistral: vLLM keeps it a sliding window with the hybrid manager off)
    also hands out the null block for the positions its window skips."""
    return ref != NULL_BLOCK if isinstance(ref, int) else NULL_BLOCK not in ref


class LayerBlocks:
    """Each layer's paged block ids for a batch of refs. ``layer_group``: per layer its KV
    cache group (:attr:`~server.kv.tiers.manifest.Manifest.groups`; empty: one group, refs are
    ids)."""

    def __init__(self, refs: Sequence[BlockRef], layer_group: Sequence[int] = ()) -> None:
        self.refs = list(refs)
        self.layer_group = tuple(layer_group)

    def __len__(self) -> int:
        return len(self.refs)

    def of(self, layer: int) -> list[int]:
        """Layer ``layer``'s paged block id of every ref, in order (:data:`NULL_BLOCK` where
        its group holds nothing)."""
        if not self.layer_group:
            return self.refs  # type: ignore[return-value]  # one group: refs are ids
        group = self.layer_group[layer]
        return [ref[group] for ref in self.refs]  # type: ignore[index]
