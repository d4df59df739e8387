"""Where each element of a token's key and value lies inside a layer's paged block.

Shifted reuse (:mod:`server.kv.worker.shifted_loads`) moves single tokens between blocks and
re-rotates their keys, so it needs, per layer, the element of the block that holds key or
value component ``d`` of KV head ``h`` for token ``t``: ``where[t, kv, h, d]``, a flat index
into one block.

- vLLM's CPU backend stores a block ``[heads, block_size, 2 * head_size]`` as all keys of a
  head, then all its values, tiled by an ISA-specific kernel. :meth:`TokenLayout.probe` asks
  the backend's own cache-write kernel: four writes of a whole block whose values name each
  element's token, head, component and kind (integers up to 256, exact in bfloat16).
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
        self.strides = [affine(m) if m is not None else None for m in maps]
        """Per layer, where its map is affine per kind (CPU: keys token-major along the
        block, values component-major), ``(offset, token, head, component)`` element strides
        of keys and of values: tokens then move as strided views, not one index per element."""

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


Strides = tuple[tuple[int, int, int, int], tuple[int, int, int, int]]


def affine(where: torch.Tensor) -> Strides | None:
    """``where`` as ``offset + t * st + h * sh + d * sd`` per kind, or None."""
    out = []
    for kind in (0, 1):
        w = where[:, kind]
        base = int(w[0, 0, 0])
        st, sh, sd = (int(w[1, 0, 0]) - base if w.shape[0] > 1 else 0,
                      int(w[0, 1, 0]) - base if w.shape[1] > 1 else 0,
                      int(w[0, 0, 1]) - base if w.shape[2] > 1 else 0)  # fmt: skip
        t, h, d = torch.meshgrid(*(torch.arange(n) for n in w.shape), indexing="ij")
        if not bool((base + t * st + h * sh + d * sd == w).all()):
            return None
        out.append((base, st, sh, sd))
    return out[0], out[1]


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
    """``where`` of vLLM's CPU backend, found with its own cache write (with the ISA it picks):
    four writes of every token, whose values name each element's token, component, head and
    kind (keys, then values); every marker is an integer of at most 256, exact in bfloat16."""
    if head_size > 256 or heads > 256 or block_size > 256:
        return None
    try:
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        if not current_platform.is_cpu():
            return None
        isa = _get_attn_isa(dtype, block_size, head_size)
        scratch = torch.zeros((1, *shape), dtype=dtype)
        keys, values = scratch.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
        slots = torch.arange(block_size, dtype=torch.long)
        grid = (block_size, heads, head_size)
        token = torch.arange(1, block_size + 1).view(-1, 1, 1).expand(grid)
        head = torch.arange(1, heads + 1).view(1, -1, 1).expand(grid)
        component = torch.arange(1, head_size + 1).view(1, 1, -1).expand(grid)
        found = []
        for k, v in ((token, token), (head, head), (component, component), (token, 0 * token)):
            scratch.zero_()
            k, v = k.to(dtype).contiguous(), v.to(dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa)
            found.append(scratch.view(-1).to(torch.long))
        t, h, d, is_key = found[0] - 1, found[1] - 1, found[2] - 1, found[3] > 0
        if bool((t < 0).any() | (h < 0).any() | (d < 0).any()):
            return None  # an element no token writes, or a value no marker gave
        kind = (~is_key).to(torch.long)
        index = ((t * 2 + kind) * heads + h) * head_size + d
        where = torch.full((index.numel(),), -1, dtype=torch.long)
        where[index] = torch.arange(index.numel())
        if bool((where < 0).any()):
            return None  # two elements claimed the same token component
        return where.view(block_size, 2, heads, head_size)
    except Exception as e:  # a vLLM without this kernel or function: layout unknown
        log.debug("probing the CPU KV token layout failed: %s", e)
        return None
