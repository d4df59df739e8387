"""Worker side of ``--kv-offload-dtype``: convert blocks between the paged cache and the tiers.

:class:`BlockCodec` encodes a batch of blocks of one layer (``[n, *block_shape]`` in the
engine's dtype) into the stored format of :class:`~server.kv.formats.BlockFormat` and decodes
them back, vectorised over the batch:

- ``auto`` (or the engine's own dtype): the elements unchanged (exact).
- ``float16`` / ``bfloat16``: a cast (float16 saturates at +-65504 instead of overflowing).
- ``int8``: symmetric absmax quantization, ``q = round(x / s)`` with ``s = amax / 127``; keys
  have one scale per head and channel, values one per head and token (see
  :mod:`server.kv.formats`).
- ``fp8``: float8 e4m3 of ``x / s`` with ``s = amax / 448``, the same scales.

Stored elements are raw bytes (``uint8`` views), so a pool slot, a file and a Redis value hold
the same bytes. Scales are float32 and never zero, so decoding finite input is finite.
"""

from __future__ import annotations

import torch

from server.kv.formats import BlockFormat, FormatError, dtype_name

_FP16_MAX = 65504.0
_INT8_MAX = 127.0
_FP8_MAX = 448.0
_TINY = 1e-30


def fp8_available() -> bool:
    """True when this torch has float8 e4m3 (``--kv-offload-dtype fp8`` needs it)."""
    return hasattr(torch, "float8_e4m3fn")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name (``"float32"``, ``"fp8"`` -> float8 e4m3)."""
    if name == "fp8":
        if not fp8_available():
            raise FormatError("--kv-offload-dtype fp8 needs a torch with float8_e4m3fn")
        return torch.float8_e4m3fn
    dtype = getattr(torch, dtype_name(name), None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"unknown torch dtype {name!r}")
    return dtype


class BlockCodec:
    """Encodes and decodes blocks of each layer for one :class:`BlockFormat`.

    Contract: ``decode(*encode(x))`` equals ``x`` exactly when ``fmt.exact``; otherwise its
    error per element is at most half a quantization step (``int8``: ``amax / 254`` of the
    element's scale group, a key channel or a value token of one head; float casts: the
    cast's rounding).
    """

    def __init__(self, fmt: BlockFormat, layer_shapes: list[tuple[int, ...]]) -> None:
        if len(layer_shapes) != len(fmt.layer_block_bytes):
            raise FormatError("one block shape per layer is needed")
        self.format = fmt
        self.engine_dtype = torch_dtype(fmt.engine_dtype)
        self.stored_dtype = torch_dtype(fmt.stored_dtype)
        self.layer_shapes = [tuple(s) for s in layer_shapes]
        for i, shape in enumerate(self.layer_shapes):
            if _numel(shape) != fmt.layer_numel(i):
                raise FormatError(f"layer {i}: shape {shape} does not match the format")
        self.item_bytes = torch.empty((), dtype=self.stored_dtype).element_size()

    @property
    def name(self) -> str:
        """The offload dtype."""
        return self.format.offload_dtype

    def data_bytes(self, layer: int) -> int:
        """Stored bytes of one block's elements of ``layer`` (scales excluded)."""
        return _numel(self.layer_shapes[layer]) * self.item_bytes

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x``: ``[n, *block_shape]`` blocks of one layer in the engine's dtype. Returns the
        stored elements as ``uint8 [n, data_bytes]`` and the scales ``float32 [n, groups]``
        (``None`` for unscaled formats). ``x`` is not modified."""
        n = x.shape[0]
        if self.format.exact:
            return _as_bytes(x, n), None
        if not self.format.scaled:
            y = x
            if self.stored_dtype == torch.float16:
                y = x.clamp(-_FP16_MAX, _FP16_MAX)
            return _as_bytes(y.to(self.stored_dtype), n), None
        kv = self._split(x).to(torch.float32)  # [n, heads, 2, tokens, head_size]
        top = _INT8_MAX if self.stored_dtype == torch.int8 else _FP8_MAX
        keys = kv[:, :, 0].abs().amax(dim=2, keepdim=True).div_(top).clamp_(min=_TINY)
        values = kv[:, :, 1].abs().amax(dim=3, keepdim=True).div_(top).clamp_(min=_TINY)
        q = kv / torch.stack((keys.expand_as(kv[:, :, 0]), values.expand_as(kv[:, :, 1])), 2)
        if self.stored_dtype == torch.int8:
            q = q.round_().clamp_(-_INT8_MAX, _INT8_MAX)
        else:
            q = q.clamp_(-_FP8_MAX, _FP8_MAX)
        scales = torch.cat((keys.reshape(n, -1), values.reshape(n, -1)), dim=1)
        return _as_bytes(q.to(self.stored_dtype), n), scales

    def decode(self, layer: int, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`encode` for ``layer``: ``uint8 [n, data_bytes]`` (and scales)
        -> ``[n, *block_shape]`` in the engine's dtype (for exact formats it may share memory
        with ``data``)."""
        n = data.shape[0]
        shape = (n, *self.layer_shapes[layer])
        values = data.contiguous().view(self.stored_dtype)
        if self.format.exact:
            return values.view(shape)
        if not self.format.scaled:
            return values.view(shape).to(self.engine_dtype)
        if scales is None:
            raise FormatError(f"{self.name} blocks need their scales")
        kv = self._split(values).to(torch.float32)
        heads, tokens, head = kv.shape[1], kv.shape[3], kv.shape[4]
        keys = scales[:, : heads * head].reshape(n, heads, 1, head)
        vals = scales[:, heads * head :].reshape(n, heads, tokens, 1)
        kv[:, :, 0].mul_(keys)
        kv[:, :, 1].mul_(vals)
        return kv.view(shape).to(self.engine_dtype)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, ...]`` -> ``[n, heads, 2 (keys, values), tokens, head_size]`` (a view)."""
        fmt = self.format
        return x.reshape(x.shape[0], fmt.kv_heads, 2, fmt.block_tokens, -1)


def _as_bytes(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(n, -1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
