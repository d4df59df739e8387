"""The RAM tier: one preallocated byte pool of ``num_slots`` blocks (pinned with CUDA).

Slot ``s`` holds one block of every layer back to back in the stored format of the
:class:`~server.kv.tiers.codec.BlockCodec` (the same bytes a disk file holds): per layer its stored
elements, then its scales (``int8``/``fp8``). The pool is viewed per layer as ``uint8
[num_slots, data_bytes]`` and ``float16 [num_slots, rows]``, so a save or load of a batch of
blocks is one encode or decode per layer. On CPU the bytes move block by block (``copy_``; for
the exact format straight between the paged block and its slot); on CUDA as one indexed copy
per layer (one host-device transfer).
"""

from __future__ import annotations

import torch

from server.kv.groups import NULL_BLOCK, LayerBlocks
from server.kv.tiers.block_frame import PAGE
from server.kv.tiers.codec import BlockCodec


class RamPool:
    """The worker's RAM blocks; the scheduler side decides which slot holds what."""

    def __init__(self, num_slots: int, codec: BlockCodec, *, batched: bool | None = None) -> None:
        self.codec = codec
        self.batched = batched
        """Move blocks as one indexed copy per layer (True), block by block (False), or as
        the paged cache's device suits (None: batched off the CPU). A check of the CUDA path's
        indexing and codec on CPU sets True (``scripts/gpu_copy_check.py``)."""
        self.block_bytes = codec.format.block_bytes
        self.num_slots = num_slots
        pin = torch.cuda.is_available()
        self.buffer = torch.zeros(
            (max(num_slots, 1), self.block_bytes), dtype=torch.uint8, pin_memory=pin
        )
        self.offsets: list[tuple[int, int, int]] = []
        """Per layer: (offset in the slot, data bytes, scale bytes)."""
        self.data: list[torch.Tensor] = []
        self.scales: list[torch.Tensor | None] = []
        offset = 0
        for i in range(len(codec.layer_shapes)):
            data = codec.data_bytes(i)
            scale = codec.format.stored_layer_bytes(i) - data
            self.offsets.append((offset, data, scale))
            self.data.append(self.buffer[:, offset : offset + data])
            self.scales.append(_scales(self.buffer, offset + data, scale))
            offset += data + scale

    def slot(self, slot: int) -> torch.Tensor:
        """The bytes of one slot (a 1-D uint8 view)."""
        return self.buffer[slot]

    def copy_slot(self, slot: int) -> torch.Tensor:
        """A private copy of one slot's bytes that starts on a page boundary, so the disk tier
        writes it with ``O_DIRECT`` (:meth:`server.kv.tiers.disk.DiskStore.write`)."""
        raw = torch.empty(self.block_bytes + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        out = raw[start : start + self.block_bytes]
        out.copy_(self.buffer[slot])
        return out

    def save(self, kv: list[torch.Tensor], blocks: LayerBlocks, slots: list[int]) -> None:
        """Encode paged blocks into slots (``kv``: per-layer views with the block dim first;
        ``blocks``: each layer's block ids, every one held: :func:`server.kv.groups.saveable`)."""
        if kv and self.is_batched(kv[0]):
            return self._save_batched(kv, blocks, slots)
        for i, layer in enumerate(kv):
            block_ids = blocks.of(i)
            pairs = list(zip(block_ids, slots, strict=True))
            if self.codec.format.exact:  # one copy per block, straight into its slot
                for block, slot in pairs:
                    self._slot_values(i, slot, layer).copy_(layer[block])
                continue
            data, scales = self.codec.encode(torch.stack([layer[b] for b in block_ids]))
            pool_scales = self.scales[i]
            for j, (_, slot) in enumerate(pairs):
                self.data[i][slot].copy_(data[j])
                if pool_scales is not None and scales is not None:
                    pool_scales[slot].copy_(scales[j])
        return None

    def load(self, kv: list[torch.Tensor], slots: list[int], blocks: LayerBlocks) -> None:
        """Decode slots into paged blocks, every layer."""
        for i in range(len(kv)):
            self.load_layer(kv, i, slots, blocks.of(i))

    def load_layer(
        self, kv: list[torch.Tensor], i: int, slots: list[int], block_ids: list[int]
    ) -> None:
        """Decode layer ``i`` of slots into paged blocks ``block_ids`` of that layer (the
        worker's copy thread loads a step's blocks one layer at a time); a null block (a
        sliding window's skipped block) is left alone."""
        layer = kv[i]
        if NULL_BLOCK in block_ids:
            kept = [(s, b) for s, b in zip(slots, block_ids, strict=True) if b != NULL_BLOCK]
            if not kept:
                return None
            slots, block_ids = [s for s, _ in kept], [b for _, b in kept]
        if self.is_batched(layer):
            return self._load_layer_batched(layer, i, slots, block_ids)
        pairs = list(zip(slots, block_ids, strict=True))
        if self.codec.format.exact:
            for slot, block in pairs:
                layer[block].copy_(self._slot_values(i, slot, layer))
            return None
        pool_scales = self.scales[i]
        data = torch.stack([self.data[i][s] for s in slots])
        scales = None if pool_scales is None else torch.stack([pool_scales[s] for s in slots])
        blocks = self.codec.decode(i, data, scales)
        for j, (_, block) in enumerate(pairs):
            layer[block].copy_(blocks[j])
        return None

    def is_batched(self, like: torch.Tensor) -> bool:
        """Whether blocks of a paged cache like ``like`` move batched (see :attr:`batched`)."""
        return like.device.type != "cpu" if self.batched is None else self.batched

    def _slot_values(self, layer: int, slot: int, like: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s bytes of ``layer`` viewed as one block of ``like`` (exact formats)."""
        return self.data[layer][slot].view(like.dtype).view(like.shape[1:])

    # On CUDA one batched host<->device transfer per layer beats many small ones; on CPU the
    # indexed gather/scatter of these two costs about 6x a plain copy per block (measured:
    # 4.2-4.6 ms against 0.7 ms per SmolLM2 block on one thread), so CPU copies block by block.
    def _save_batched(self, kv: list[torch.Tensor], blocks: LayerBlocks, slots: list[int]) -> None:
        dst = torch.tensor(slots, dtype=torch.long)
        for i, layer in enumerate(kv):
            src = torch.tensor(blocks.of(i), dtype=torch.long)
            data, scales = self.codec.encode(layer[src.to(layer.device)])  # on the cache's device
            self.data[i][dst] = data.to(self.buffer.device)
            pool_scales = self.scales[i]
            if pool_scales is not None and scales is not None:
                pool_scales[dst] = scales.to(self.buffer.device)

    def _load_layer_batched(
        self, layer: torch.Tensor, i: int, slots: list[int], block_ids: list[int]
    ) -> None:
        dev = layer.device
        src = torch.tensor(slots, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long, device=dev)
        pool_scales = self.scales[i]
        scales = pool_scales[src].to(dev) if pool_scales is not None else None
        layer[dst] = self.codec.decode(i, self.data[i][src].to(dev), scales)

    def load_bytes(self, kv: list[torch.Tensor], data: torch.Tensor, block: LayerBlocks) -> None:
        """Decode one block held in a plain byte tensor (slot layout) into a paged block."""
        load_block_bytes(self.codec, kv, data, block)


def load_block_bytes(
    codec: BlockCodec, kv: list[torch.Tensor], data: torch.Tensor, target: LayerBlocks
) -> None:
    """Decode one stored block (``uint8 [block_bytes]``, slot layout) into the paged block
    ``target`` (one ref) names in every layer of ``kv`` (a layer's null block is skipped)."""
    offset = 0
    for i, layer in enumerate(kv):
        size = codec.data_bytes(i)
        scale_bytes = codec.format.stored_layer_bytes(i) - size
        block_id = target.of(i)[0]
        if block_id == NULL_BLOCK:
            offset += size + scale_bytes
            continue
        values = data[offset : offset + size].view(1, size)
        scales = _scales(data.view(1, -1), offset + size, scale_bytes)
        block = codec.decode(i, values, scales)[0]
        layer[block_id].copy_(block)
        offset += size + scale_bytes


def _scales(buffer: torch.Tensor, start: int, nbytes: int) -> torch.Tensor | None:
    """A float16 ``[rows, nbytes / 2]`` view of ``buffer[:, start:start + nbytes]``."""
    if nbytes == 0:
        return None
    return buffer[:, start : start + nbytes].view(torch.float16).view(buffer.shape[0], -1)
