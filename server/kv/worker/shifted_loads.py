"""Shifted loads: paged blocks filled token by token from stored blocks at other positions.

The scheduler side (:mod:`server.kv.scheduler.shifted`) found the prompt's next tokens at
other positions of the session's stored blocks (history cut in front or in the middle) and
plans, per paged block, segments ``(source, src, dst, count, delta)``. Here, for one job's
segments: the sources are read in the RAM pool in place (decoded into scratch blocks first
when the tiers store another format than the engine's, or when a source was read from disk
into a buffer of its own), every token's key and value elements are
gathered (:class:`~server.kv.worker.token_layout.TokenLayout`), the
keys rotated by their ``delta`` (:class:`~server.kv.worker.rotation.Rotation`), and the
elements written into the paged blocks, all layers, before the forward pass. vLLM's paged
blocks are written only where the plan says (these blocks were allocated to the request).
"""

from __future__ import annotations

import logging

import torch

from server.kv.groups import BlockRef, LayerBlocks
from server.kv.metadata import LoadJob, ShiftItem, ShiftSource
from server.kv.tiers.ram import RamPool, load_block_bytes
from server.kv.worker.rotation import Rotation
from server.kv.worker.token_layout import TokenLayout

log = logging.getLogger(__name__)


class ShiftedLoads:
    """Executes shifted loads; ``reason`` is why it cannot (empty when it can)."""

    def __init__(
        self, layout: TokenLayout | None, rotation: Rotation | None, reason: str = ""
    ) -> None:
        self.layout = layout
        self.rotation = rotation
        self.reason = reason or (layout.reason if layout is not None else "")
        self._warned = False

    @classmethod
    def build(
        cls, views: list[torch.Tensor], block_size: int, layer_groups: tuple[int, ...]
    ) -> ShiftedLoads:
        """For the layers' paged caches (block dimension first) of the model in this
        process; ``reason`` says why shifted loads are not possible, if they are not."""
        if layer_groups:
            return cls(None, None, "the model has several KV cache groups")
        if not all(v.device.type == "cpu" for v in views):
            return cls(None, None, "the KV cache is not in CPU memory (not built for GPUs yet)")
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

    def fill(
        self,
        pool: RamPool | None,
        kv: list[torch.Tensor],
        job: LoadJob,
        buffers: dict[int, torch.Tensor],
        failed: frozenset[int] | set[int],
    ) -> list[BlockRef]:
        """Fill ``job``'s shifted blocks (its sources read; ``failed``: the numbers of those
        whose read failed); the paged blocks not filled, a miss and never an exception: vLLM
        computes them. Why shifted loads cannot run here is logged once."""
        items: list[ShiftItem] = []
        missed: list[BlockRef] = []
        for item in job.shifted:
            if any(s.source in failed for s in item.segments):
                missed.append(item.block_id)
            else:
                items.append(item)
        try:
            if not self.ready or pool is None:
                raise RuntimeError(self.reason or "no RAM tier")
            if items:
                self.load(pool, kv, items, job.shifted_sources, buffers)
        except Exception as e:
            if self.ready or not self._warned:
                log.warning(
                    "shifted KV load of %d blocks failed, they are recomputed: %s%s", len(items),
                    e, "" if self.ready else " (such requests reuse exact prefixes only)",
                )  # fmt: skip
            self._warned = True
            missed += [i.block_id for i in items]
        return missed

    def load(
        self,
        pool: RamPool,
        kv: list[torch.Tensor],
        items: list[ShiftItem],
        sources: tuple[ShiftSource, ...],
        buffers: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Fill the paged blocks of ``items`` (``kv``: per-layer views, block dim first) from
        ``sources``: in their pool slots, or (``buffers``, by source number) in a stored
        block's bytes read from disk without a slot."""
        assert self.layout is not None and self.rotation is not None
        buffers = buffers or {}
        used = sorted({seg.source for item in items for seg in item.segments})
        # An exact pool whose layout moves tokens as strided views is read in place (row =
        # slot); else the sources are decoded into scratch blocks 1.. (block 0 stays unused:
        # the pool skips block id 0, vLLM's null block).
        in_place = pool.codec.format.exact and all(s is not None for s in self.layout.strides)
        in_place = in_place and not any(n in buffers for n in used)
        row_of = {n: sources[n].slot if in_place else i for i, n in enumerate(used, 1)}
        scratch: list[torch.Tensor] = []
        if not in_place:
            scratch = [torch.empty((len(used) + 1, *v.shape[1:]), dtype=v.dtype) for v in kv]
            pooled = [n for n in used if n not in buffers]
            if pooled:
                rows = LayerBlocks([row_of[n] for n in pooled])
                pool.load(scratch, [sources[n].slot for n in pooled], rows)
            for n in used:
                if n in buffers:
                    load_block_bytes(pool.codec, scratch, buffers[n], LayerBlocks([row_of[n]]))
        lists = _token_lists(items, row_of)
        d_block, d_tok, s_row, s_tok, shift = (torch.tensor(x, dtype=torch.long) for x in lists)
        layers = zip(kv, self.layout.maps, self.layout.strides, strict=True)
        for layer, (view, where, strides) in enumerate(layers):
            assert where is not None
            stored = pool.data[layer].view(view.dtype) if in_place else scratch[layer].flatten(1)
            if strides is None:  # one index per element
                src = s_row.view(-1, 1, 1, 1) * stored.shape[1] + where[s_tok]
                dst = d_block.view(-1, 1, 1, 1) * where.numel() + where[d_tok]
                values = stored.reshape(-1)[src.view(-1)].view(-1, *where.shape[1:])
                values[:, 0] = self.rotation.rotate(values[:, 0], shift)
                view.view(-1)[dst.view(-1)] = values.view(-1)
                continue
            heads, size = where.shape[2:]
            for kind, (offset, st, sh, sd) in enumerate(strides):  # tokens as strided views
                shape = (where.shape[0], heads, size)
                rows = stored.as_strided((stored.shape[0], *shape), (stored.stride(0), st, sh, sd),
                                         stored.storage_offset() + offset)  # fmt: skip
                values = rows[s_row, s_tok]
                if kind == 0:
                    values = self.rotation.rotate(values, shift)
                paged = view.as_strided((view.shape[0], *shape), (where.numel(), st, sh, sd),
                                        view.storage_offset() + offset)  # fmt: skip
                paged[d_block, d_tok] = values


def _token_lists(
    items: list[ShiftItem], row_of: dict[int, int]
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Per token moved: its paged block, its slot there, its source row and slot, its shift."""
    d_block: list[int] = []
    d_tok: list[int] = []
    s_row: list[int] = []
    s_tok: list[int] = []
    delta: list[int] = []
    for item in items:
        assert isinstance(item.block_id, int)  # one KV cache group (checked in build)
        for seg in item.segments:
            d_block += [item.block_id] * seg.count
            d_tok += range(seg.dst, seg.dst + seg.count)
            s_row += [row_of[seg.source]] * seg.count
            s_tok += range(seg.src, seg.src + seg.count)
            delta += [seg.delta] * seg.count
    return d_block, d_tok, s_row, s_tok, delta
