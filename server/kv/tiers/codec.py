"""Worker side of ``--kv-offload-dtype``: convert blocks between the paged cache and the tiers.

:class:`BlockCodec` encodes a batch of blocks of one layer (``[n, *block_shape]`` in the
engine's dtype) into the stored format of :class:`~server.kv.formats.BlockFormat` and decodes
them back, vectorised over the batch:

- ``auto`` (or the engine's own dtype): the elements unchanged (exact).
- ``float16`` / ``bfloat16``: a cast (float16 saturates at +-65504 instead of overflowing).
- ``int8``: centered absmax quantization per group of ``SCALE_GROUP`` contiguous elements
  (half a token's head vector, or one key channel over half of ``head_size`` tokens; see
  :mod:`server.kv.formats`): the center ``c`` is midway between the group's minimum and
  maximum, ``q = round((x - c) / s)`` with ``s = max|x - c| / 127``; ``s`` and ``c`` stored
  as float16. On SmolLM2's KV the centers halve the squared error of key groups next to plain
  absmax (``s = max|x| / 127``), whose channels sit away from zero.
- ``fp8``: float8 e4m3 of ``(x - c) / s`` with ``s = max|x - c| / 448``, the same groups.

Stored elements are raw bytes (``uint8`` views), so a pool slot, a file and a Redis value hold
the same bytes. Scales are never zero, and the elements are taken relative to the stored
(float16-rounded) center and divided by the stored scale, so decoding finite input is finite
and the error bound holds for the stored values.
"""

from __future__ import annotations

import torch

from server.kv.formats import BlockFormat, FormatError, dtype_name

_FP16_MAX = 65504.0
_INT8_MAX = 127.0
_FP8_MAX = 448.0
_FP16_TINY = 2.0**-24


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
    error per element is at most half a quantization step (``int8``: ``max|x - c| / 254`` of
    the element's group, at most ``amax / 254``; float casts: the cast's rounding).
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
        stored elements as ``uint8 [n, data_bytes]`` and ``float16 [n, 2 * groups]``: the
        groups' scales, then their centers (``None`` for unscaled formats). ``x`` is not
        modified."""
        n = x.shape[0]
        if self.format.exact:
            return _as_bytes(x, n), None
        if not self.format.scaled:
            y = x
            if self.stored_dtype == torch.float16:
                y = x.clamp(-_FP16_MAX, _FP16_MAX)
            return _as_bytes(y.to(self.stored_dtype), n), None
        rows = x.reshape(n, self._groups, -1).to(torch.float32)
        top = _INT8_MAX if self.stored_dtype == torch.int8 else _FP8_MAX
        lo, hi = rows.aminmax(dim=-1, keepdim=True)
        center = lo.add_(hi).mul_(0.5).clamp_(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        q = rows - center.to(torch.float32)  # a new tensor: x stays as it was
        amax = q.abs().amax(dim=-1, keepdim=True)
        scale = amax.div_(top).clamp_(_FP16_TINY, _FP16_MAX).to(torch.float16)
        q.div_(scale.to(torch.float32))
        if self.stored_dtype == torch.int8:
            q = q.round_().clamp_(-_INT8_MAX, _INT8_MAX)
        else:
            q = q.clamp_(-_FP8_MAX, _FP8_MAX)
        meta = torch.cat([scale.view(n, -1), center.view(n, -1)], dim=1)
        return _as_bytes(q.to(self.stored_dtype), n), meta

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
        rows = values.view(n, self._groups, -1).to(torch.float32)
        meta = scales.reshape(n, 2, self._groups, 1).to(torch.float32)
        rows.mul_(meta[:, 0]).add_(meta[:, 1])
        return rows.view(shape).to(self.engine_dtype)

    @property
    def _groups(self) -> int:
        return self.format.groups(0)


def _as_bytes(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(n, -1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
