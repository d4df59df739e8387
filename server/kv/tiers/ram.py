"""The RAM tier: one preallocated byte pool of ``num_slots`` blocks (pinned with CUDA).

Slot ``s`` holds one block of every layer back to back (the same bytes a disk file holds).
The pool is viewed per layer as ``[num_slots, *block_shape]`` of the KV dtype, so copies
to and from vLLM's paged cache are single indexed copies per layer.
"""

from __future__ import annotations

import torch


class RamPool:
    """The worker's RAM blocks; the scheduler side decides which slot holds what."""

    def __init__(
        self, num_slots: int, layer_shapes: list[tuple[tuple[int, ...], torch.dtype]]
    ) -> None:
        sizes = [
            _numel(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in layer_shapes
        ]
        self.block_bytes = sum(sizes)
        self.num_slots = num_slots
        pin = torch.cuda.is_available()
        self.buffer = torch.zeros(
            (max(num_slots, 1), self.block_bytes), dtype=torch.uint8, pin_memory=pin
        )
        self.layers: list[torch.Tensor] = []
        self.offsets: list[tuple[int, int]] = []
        offset = 0
        for (shape, dtype), size in zip(layer_shapes, sizes, strict=False):
            view = self.buffer[:, offset : offset + size].view(dtype)
            self.layers.append(view.view(self.buffer.shape[0], *shape))
            self.offsets.append((offset, size))
            offset += size

    def slot(self, slot: int) -> torch.Tensor:
        """The bytes of one slot (a 1-D uint8 view)."""
        return self.buffer[slot]

    def save(self, kv: list[torch.Tensor], block_ids: list[int], slots: list[int]) -> None:
        """Copy paged blocks into slots (``kv``: per-layer views with the block dim first)."""
        src = torch.tensor(block_ids, dtype=torch.long)
        dst = torch.tensor(slots, dtype=torch.long)
        for pool, layer in zip(self.layers, kv, strict=False):
            pool[dst] = layer[src.to(layer.device)].to(pool.device)

    def load(self, kv: list[torch.Tensor], slots: list[int], block_ids: list[int]) -> None:
        """Copy slots into paged blocks."""
        src = torch.tensor(slots, dtype=torch.long)
        dst = torch.tensor(block_ids, dtype=torch.long)
        for pool, layer in zip(self.layers, kv, strict=False):
            layer[dst.to(layer.device)] = pool[src].to(layer.device)

    def load_bytes(self, kv: list[torch.Tensor], data: torch.Tensor, block_id: int) -> None:
        """Copy one block held in a plain byte tensor (pool layout) into a paged block."""
        for (offset, size), pool, layer in zip(self.offsets, self.layers, kv, strict=False):
            part = data[offset : offset + size].view(pool.dtype).view(pool.shape[1:])
            layer[block_id].copy_(part)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
