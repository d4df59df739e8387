"""Where each element of a token's key and value lies inside a layer's paged block.

Shifted reuse (:mod:`server.kv.worker.shifted_loads`) moves single tokens between blocks and
re-rotates their keys, so it needs, per layer, the element of the block that holds key or
value component ``d`` of KV head ``h`` for token ``t``: ``where[t, kv, h, d]``, a flat index
into one block.

- vLLM's CPU backend stores a block ``[heads, block_size, 2 * head_size]`` as all keys of a
  head, then all its values, tiled by an ISA-specific kernel. :meth:`TokenLayout.probe` asks
  the backend's own cache-write kernel: for each token, kind and head it writes the marker
  ``1..head_size`` and records where each component landed (exact in bfloat16 up to 256).
- A block ``[2, block_size, heads, head_size]`` (FlashInfer's NHD, vLLM's CPU-less layouts
  with the block dimension first) is read from its shape.

Any other layout gets no map: shifted loads are then misses (vLLM computes those tokens),
with a warning at start. Torch only; vLLM is imported only to find the CPU kernel.
"""

from __future__ import annotations

import logging

import torch

from server.kv.worker.token_slots import per_layout

log = logging.getLogger(__name__)


class TokenLayout:
    """Per layer, ``where[t, kv, h, d]`` (``torch.long``), or ``None`` where unknown."""

    def __init__(self, maps: list[torch.Tensor | None], reason: str = "") -> None:
        self.maps = maps
        self.reason = reason
        """Why the layout is unknown (empty when every layer's map is known)."""

    @property
    def known(self) -> bool:
        """True when every layer's map is known."""
        return bool(self.maps) and all(m is not None for m in self.maps)

    @classmethod
    def probe(cls, views: list[torch.Tensor], block_size: int) -> TokenLayout:
        """The maps of the layers' paged caches (``views``: block dimension first)."""
        maps = per_layout(views, lambda v: _probe(tuple(v.shape[1:]), v.dtype, block_size))
        reason = ""
        if not maps or any(m is None for m in maps):
            shape = tuple(views[0].shape[1:]) if views else ()
            reason = f"token positions inside KV blocks of shape {shape} are unknown"
        return cls(maps, reason)


def _probe(shape: tuple[int, ...], dtype: torch.dtype, block_size: int) -> torch.Tensor | None:
    if len(shape) == 4 and shape[:2] == (2, block_size):
        flat = torch.arange(2 * block_size * shape[2] * shape[3]).view(shape)
        return flat.permute(1, 0, 2, 3).contiguous()
    cpu = len(shape) == 3 and shape[1] == block_size and shape[2] % 2 == 0
    if cpu and dtype.is_floating_point:
        return _probe_cpu_kernel(shape, dtype, block_size, shape[0], shape[2] // 2)
    return None


def _probe_cpu_kernel(
    shape: tuple[int, ...], dtype: torch.dtype, block_size: int, heads: int, head_size: int
) -> torch.Tensor | None:
    """``where`` of vLLM's CPU backend, found by running its cache write (with the ISA it
    picks) once per token, kind and head."""
    if head_size > 256:
        return None  # markers 1..head_size must be exact in bfloat16
    try:
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        if not current_platform.is_cpu():
            return None
        isa = _get_attn_isa(dtype, block_size, head_size)
        scratch = torch.zeros((1, *shape), dtype=dtype)
        keys, values = scratch.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
        flat = scratch.view(-1)
        where = torch.full((block_size, 2, heads, head_size), -1, dtype=torch.long)
        marker = torch.arange(1, head_size + 1, dtype=dtype)
        for t in range(block_size):
            slot = torch.tensor([t], dtype=torch.long)
            for kind in (0, 1):
                for h in range(heads):
                    k = torch.zeros((1, heads, head_size), dtype=dtype)
                    v = torch.zeros((1, heads, head_size), dtype=dtype)
                    (k if kind == 0 else v)[0, h] = marker
                    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slot, isa)
                    at = flat.nonzero().view(-1)
                    if at.numel() != head_size:
                        return None
                    components = flat[at].to(torch.long) - 1
                    if components.unique().numel() != head_size:
                        return None
                    where[t, kind, h, components] = at
                    scratch.zero_()
        if bool((where < 0).any()):
            return None
        return where
    except Exception as e:  # a vLLM without this kernel or function: layout unknown
        log.debug("probing the CPU KV token layout failed: %s", e)
        return None
