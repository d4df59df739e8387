"""Block-first views of vLLM's paged KV cache tensors, whatever their layout.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``) in its
attention backend's layout: the CPU backend and FlashInfer put the block dimension first,
FlashAttention's ``[2, num_blocks, block_size, heads, head_dim]`` second, MLA's latent cache is
``[num_blocks, block_size, latent_dim]``. The worker moves whole blocks, so it views each layer
with the block dimension first (no copy) and checks that one block has the bytes the scheduler
side planned for. Torch only (no vLLM): ``scripts/gpu_copy_check.py`` builds the same views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def block_first_views(
    kv_caches: Mapping[str, torch.Tensor],
    layers: Sequence[str],
    layer_block_bytes: Sequence[int],
    num_blocks: int,
) -> list[torch.Tensor]:
    """Each layer's cache as a ``[num_blocks, ...]`` view, in ``layers`` order.

    Raises:
        RuntimeError: a layer is missing, has no dimension of ``num_blocks``, or a block of it
            does not hold ``layer_block_bytes`` (a layout the connector does not support).
    """
    views: list[torch.Tensor] = []
    for name, expected in zip(layers, layer_block_bytes, strict=False):
        if name not in kv_caches:
            raise RuntimeError(f"SessionKVConnector: no KV cache tensor for layer {name!r}")
        tensor = kv_caches[name]
        dims = [d for d, n in enumerate(tensor.shape) if n == num_blocks]
        if not dims:
            raise RuntimeError(
                f"SessionKVConnector: cannot find the block dimension of {name!r} "
                f"(shape {tuple(tensor.shape)}, {num_blocks} blocks)"
            )
        view = tensor.movedim(dims[0], 0)
        got = view[0].numel() * view.element_size()
        if got != expected:
            raise RuntimeError(
                f"SessionKVConnector: layer {name!r} has {got} bytes per block, the "
                f"scheduler side expects {expected}; the KV cache layout is not supported"
            )
        views.append(view)
    return views
