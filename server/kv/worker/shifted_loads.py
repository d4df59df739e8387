"""Shifted loads: paged blocks filled token by token from stored blocks at other positions.

The scheduler side (:mod:`server.kv.scheduler.shifted`) found the prompt's next tokens at
other positions of the session's stored blocks (history cut in front or in the middle) and
plans, per paged block, segments ``(slot, src, dst, count, delta)``. Here, for one step's
segments: the source slots are decoded from the RAM pool into scratch blocks, every token's
key and value elements are gathered (:class:`~server.kv.worker.token_layout.TokenLayout`), the
keys rotated by their ``delta`` (:class:`~server.kv.worker.rotation.Rotation`), and the
elements written into the paged blocks, all layers, before the forward pass. vLLM's paged
blocks are written only where the plan says (these blocks were allocated to the request).
"""

from __future__ import annotations

import torch

from server.kv.groups import LayerBlocks
from server.kv.metadata import ShiftItem
from server.kv.tiers.ram import RamPool
from server.kv.worker.rotation import Rotation
from server.kv.worker.token_layout import TokenLayout


class ShiftedLoads:
    """Executes shifted loads; ``reason`` is why it cannot (empty when it can)."""

    def __init__(
        self, layout: TokenLayout | None, rotation: Rotation | None, reason: str = ""
    ) -> None:
        self.layout = layout
        self.rotation = rotation
        self.reason = reason or (layout.reason if layout is not None else "")

    @classmethod
    def build(
        cls, views: list[torch.Tensor], block_size: int, layer_groups: tuple[int, ...]
    ) -> ShiftedLoads:
        """For the layers' paged caches (block dimension first) of the model in this
        process; ``reason`` says why shifted loads are not possible, if they are not."""
        if layer_groups:
            return cls(None, None, "the model has several KV cache groups")
        if not all(v.is_contiguous() for v in views):
            return cls(None, None, "a paged block is not contiguous in memory")
        rotation, why = Rotation.from_model()
        if rotation is None:
            return cls(None, None, why)
        layout = TokenLayout.probe(views, block_size)
        return cls(layout, rotation, layout.reason)

    @property
    def ready(self) -> bool:
        """True when shifted loads can run."""
        return self.layout is not None and self.layout.known and self.rotation is not None

    def load(self, pool: RamPool, kv: list[torch.Tensor], items: list[ShiftItem]) -> None:
        """Fill the paged blocks of ``items`` (``kv``: per-layer views, block dim first)."""
        assert self.layout is not None and self.rotation is not None
        slots = sorted({seg.slot for item in items for seg in item.segments})
        # scratch block 0 stays unused: the pool skips block id 0, vLLM's null block
        scratch_of = {slot: i for i, slot in enumerate(slots, 1)}
        scratch = [torch.empty((len(slots) + 1, *v.shape[1:]), dtype=v.dtype) for v in kv]
        pool.load(scratch, slots, LayerBlocks(range(1, len(slots) + 1)))
        dst_block, dst_tok, src_block, src_tok, delta = [], [], [], [], []
        for item in items:
            for seg in item.segments:
                dst_block += [item.block_id] * seg.count
                dst_tok += range(seg.dst, seg.dst + seg.count)
                src_block += [scratch_of[seg.slot]] * seg.count
                src_tok += range(seg.src, seg.src + seg.count)
                delta += [seg.delta] * seg.count
        d_block = torch.tensor(dst_block, dtype=torch.long).view(-1, 1, 1, 1)
        s_block = torch.tensor(src_block, dtype=torch.long).view(-1, 1, 1, 1)
        d_tok = torch.tensor(dst_tok, dtype=torch.long)
        s_tok = torch.tensor(src_tok, dtype=torch.long)
        shift = torch.tensor(delta, dtype=torch.long)
        for layer, (view, where) in enumerate(zip(kv, self.layout.maps, strict=True)):
            assert where is not None
            values = scratch[layer].reshape(len(slots) + 1, -1)[s_block, where[s_tok]]
            values[:, 0] = self.rotation.rotate(values[:, 0], shift)
            view.reshape(view.shape[0], -1)[d_block, where[d_tok]] = values
