"""Which token of a paged block each element of a layer's block holds, so a saved tail block
keeps its own tokens and nothing else.

vLLM hands a request paged blocks that earlier requests (other tenants' too) used and freed;
the slots of a request's partly filled last block past its tokens still hold what they left
there. Attention never reads them, but a saved tail would carry them into RAM, files and Redis,
past the ``DELETE`` of the session that wrote them. :meth:`TokenSlots.tail_copies` gives the
worker private copies of tail blocks with those slots zeroed (vLLM's live paged blocks are
never written).

Where a token lies inside a block is the attention backend's business:

- vLLM's CPU backend stores a block per KV head as all its keys, then all its values, tiled by
  an ISA-specific kernel (``vec``, ``vec16``, ``amx``, ``neon``...: a token's key is spread
  over the head's rows). :meth:`TokenSlots.probe` asks the backend's own cache-write kernel:
  it writes a marker for each token into a scratch block and records which elements it set.
- Other backends (CUDA) keep a token's elements along one dimension of the block, the one of
  ``block_size`` elements; where two dimensions have that size, the layout is ambiguous.

A layout neither way explains gets no map: tails are then saved unzeroed, with a warning at
start (never a wrong answer: a wrong map would zero a token attention reads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from server.kv.groups import LayerBlocks

log = logging.getLogger(__name__)

_UNCLAIMED = -1


class TokenSlots:
    """Per layer, the token index of every element of one paged block (``block_size`` for
    elements no token writes, which are zeroed with any tail); ``None``: layout unknown."""

    def __init__(self, maps: list[torch.Tensor | None], block_size: int) -> None:
        self.maps = maps
        self.block_size = block_size

    @property
    def known(self) -> bool:
        """True when every layer's token positions are known."""
        return bool(self.maps) and all(m is not None for m in self.maps)

    @classmethod
    def probe(cls, views: list[torch.Tensor], block_size: int) -> TokenSlots:
        """The maps of the layers' paged caches (``views``: block dimension first)."""
        maps = per_layout(views, lambda v: _probe_layer(tuple(v.shape[1:]), v.dtype, v.device,
                                                        block_size))  # fmt: skip
        slots = cls(maps, block_size)
        if not slots.known:
            log.warning(
                "SessionKVConnector: token positions inside this KV cache layout are unknown "
                "(block shape %s, %s); saved tail blocks keep the unused slots as vLLM left "
                "them",
                tuple(views[0].shape[1:]) if views else (),
                views[0].dtype if views else "-",
            )
        return slots

    def tail_copies(
        self, kv: list[torch.Tensor], blocks: LayerBlocks, counts: list[int]
    ) -> list[torch.Tensor]:
        """Per layer, ``[len(blocks), *block_shape]``: copies of the paged blocks ``blocks``
        names whose elements of tokens ``>= counts[j]`` are zero (``kv``: per-layer views with
        the block dimension first; not modified)."""
        out: list[torch.Tensor] = []
        for i, (layer, positions) in enumerate(zip(kv, self.maps, strict=True)):
            index = torch.tensor(blocks.of(i), dtype=torch.long, device=layer.device)
            copies = layer[index]  # indexing copies: the paged blocks stay
            if positions is not None:
                limits = torch.tensor(counts, dtype=positions.dtype, device=layer.device)
                limits = limits.view(-1, *([1] * positions.dim()))
                copies.masked_fill_(positions.unsqueeze(0) >= limits, 0)
            out.append(copies)
        return out


def per_layout(
    views: list[torch.Tensor], probe: Callable[[torch.Tensor], torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """``probe`` of each layer's view, run once per block shape, dtype and device."""
    found: dict[tuple[object, ...], torch.Tensor | None] = {}
    maps: list[torch.Tensor | None] = []
    for view in views:
        what = (tuple(view.shape[1:]), view.dtype, view.device)
        if what not in found:
            found[what] = probe(view)
        maps.append(found[what])
    return maps


def _probe_layer(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, block_size: int
) -> torch.Tensor | None:
    if device.type == "cpu" and _cpu_platform():
        return _probe_cpu_kernel(shape, dtype, block_size)
    dims = [d for d, n in enumerate(shape) if n == block_size]
    if len(dims) != 1:
        return None
    index = torch.arange(block_size, dtype=torch.int32, device=device)
    view = [1] * len(shape)
    view[dims[0]] = block_size
    return index.view(view).expand(shape).contiguous()


def _cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _probe_cpu_kernel(
    shape: tuple[int, ...], dtype: torch.dtype, block_size: int
) -> torch.Tensor | None:
    """Token of each element of a CPU-backend block ``[heads, block_size, 2 * head_size]``,
    found by running the backend's cache write (with the ISA it picks) once per token."""
    if len(shape) != 3 or shape[1] != block_size or shape[2] % 2 or not dtype.is_floating_point:
        return None
    heads, head_size = shape[0], shape[2] // 2
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size)
        scratch = torch.zeros((1, *shape), dtype=dtype)
        keys, values = scratch.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
        marker = torch.ones((1, heads, head_size), dtype=dtype)
        token = torch.full(shape, _UNCLAIMED, dtype=torch.int32)
        for t in range(block_size):
            ops.cpu_attn_reshape_and_cache(
                marker, marker, keys, values, torch.tensor([t], dtype=torch.long), isa
            )
            written = scratch[0] != 0
            if int(written.sum()) != 2 * heads * head_size or bool((token[written] >= 0).any()):
                return None  # not one token's elements, or overlapping another's
            token[written] = t
            scratch.zero_()
    except Exception as e:  # a vLLM without this kernel or function: layout unknown
        log.debug("probing the CPU KV layout failed: %s", e)
        return None
    token[token == _UNCLAIMED] = block_size
    return token
