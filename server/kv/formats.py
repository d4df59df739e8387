"""How KV blocks are stored in the tiers (``--kv-offload-dtype``): names and byte sizes, no torch.

A block leaves vLLM's paged cache in the engine's dtype (float32 on CPU). The tiers may keep it
in a smaller format; :class:`BlockFormat` says how many bytes that takes, so the scheduler side
sizes the RAM pool and the disk budget by stored bytes, and :mod:`server.kv.tiers.codec`
(worker side, torch) converts. Stored layout of one block: for every layer in manifest order,
the layer's elements in the stored dtype, then (``int8``/``fp8`` only) its float16 scales and
centers.

Scales (:data:`SCALE_SCHEME`): one scale and one center per group of :data:`SCALE_GROUP`
contiguous elements (the whole row of ``head_size`` elements where 32 does not divide it); a
group is stored as ``(x - center) / scale`` with the center midway between its minimum and
maximum, so values that sit away from zero (a key channel's offset) spend the 255 levels on
their own range, not on ``[-amax, amax]``. vLLM's CPU layout of a layer block is
``[kv_heads, 2 * block_tokens, head_size]`` as a view (each head's keys, then its values;
SmolLM2: 3 heads of 64, 128 tokens per block). What a row holds depends on the attention
kernel's layout inside that view: vLLM CPU's ``vec`` kernel (float32 on x86,
csrc/cpu/cpu_attn_vec.hpp) writes values row-major, so a value row is one token's head
vector, and keys column-major (``[head_size, block_tokens]``), so a key row is one channel
over ``head_size`` consecutive tokens: per-channel key scales, as KIVI recommends, and
per-token value scales, each over 32 elements. Groups that mix channels or tokens of another
layout keep the same error bound per group. SmolLM2: 4 float16 bytes per 32 int8 bytes, 3.56x
smaller than float32 (measured in docs/operations.md: 96% of greedy continuations identical,
against 89% for one absmax scale per 64-element row).
"""

from __future__ import annotations

from dataclasses import dataclass

OFFLOAD_DTYPES = ("auto", "float16", "bfloat16", "int8", "fp8")
"""Accepted formats; ``auto`` stores the engine's own dtype (exact)."""

SCALED = ("int8", "fp8")
"""Formats that store a scale and a center per group of elements."""

SCALE_BYTES = 2
"""Bytes of one scale or center (float16; the quantization uses the rounded values)."""

SCALE_GROUP = 32
"""Contiguous elements that share a scale and a center (half a row of SmolLM2's 64)."""

SCALE_SCHEME = f"groups:{SCALE_GROUP};center,absmax;float16"
"""What the scales of ``int8``/``fp8`` blocks mean (part of the manifest fingerprint)."""

_ELEMENT_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class FormatError(ValueError):
    """An offload format or engine dtype this module does not know, or a bad geometry."""


def dtype_name(dtype: object) -> str:
    """``torch.float32`` (or its string ``"torch.float32"``) -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def element_bytes(dtype: object) -> int:
    """Bytes of one element of ``dtype`` (a torch dtype, its string or a format name)."""
    name = dtype_name(dtype)
    if name not in _ELEMENT_BYTES:
        raise FormatError(f"unknown KV element dtype {name!r}")
    return _ELEMENT_BYTES[name]


@dataclass(frozen=True)
class BlockFormat:
    """The stored format of one model's blocks: offload dtype plus the block geometry."""

    offload_dtype: str
    """One of :data:`OFFLOAD_DTYPES`."""
    engine_dtype: str
    """The paged cache's dtype, e.g. ``"float32"``."""
    layer_block_bytes: tuple[int, ...]
    """Bytes of one block of each layer in the paged cache."""
    kv_heads: int = 1
    """KV heads per layer block (the scales' geometry, ``int8``/``fp8``)."""
    block_tokens: int = 1
    """Tokens per block (the scales' geometry, ``int8``/``fp8``)."""

    def __post_init__(self) -> None:
        if self.offload_dtype not in OFFLOAD_DTYPES:
            raise FormatError(
                f"kv offload dtype must be one of {', '.join(OFFLOAD_DTYPES)}, "
                f"got {self.offload_dtype!r}"
            )
        size = element_bytes(self.engine_dtype)
        for nbytes in self.layer_block_bytes:
            if nbytes % size:
                raise FormatError(f"{nbytes} bytes per layer block is not whole {size}-byte items")
            rows = 2 * self.kv_heads * self.block_tokens
            if self.scaled and (rows <= 0 or (nbytes // size) % rows):
                raise FormatError(
                    f"{self.kv_heads} heads x 2 x {self.block_tokens} tokens do not divide "
                    f"{nbytes // size} elements"
                )

    @property
    def stored_dtype(self) -> str:
        """Element dtype in the tiers (``auto`` resolves to the engine's)."""
        return self.engine_dtype if self.offload_dtype == "auto" else self.offload_dtype

    @property
    def exact(self) -> bool:
        """True when blocks are stored bit for bit (``auto`` or the engine's own dtype)."""
        return dtype_name(self.stored_dtype) == dtype_name(self.engine_dtype)

    @property
    def scaled(self) -> bool:
        """True when blocks carry per-group scales."""
        return self.offload_dtype in SCALED

    def layer_numel(self, layer: int) -> int:
        """Elements of one block of layer ``layer``."""
        return self.layer_block_bytes[layer] // element_bytes(self.engine_dtype)

    def head_size(self, layer: int) -> int:
        """Elements per token and head of layer ``layer``."""
        return self.layer_numel(layer) // (2 * self.kv_heads * self.block_tokens)

    def num_scales(self, layer: int) -> int:
        """float16 values after the elements of one block of layer ``layer`` (0 for unscaled
        formats): a scale per group, then a center per group."""
        return 2 * self.groups(layer) if self.scaled else 0

    def group_size(self, layer: int) -> int:
        """Elements per scale group of layer ``layer``: :data:`SCALE_GROUP` when it divides
        the row (``head_size``), else the whole row."""
        head = self.head_size(layer)
        return SCALE_GROUP if head % SCALE_GROUP == 0 else head

    def groups(self, layer: int) -> int:
        """Scale groups of one block of layer ``layer``."""
        return self.layer_numel(layer) // self.group_size(layer)

    def stored_layer_bytes(self, layer: int) -> int:
        """Stored bytes of one block of layer ``layer`` (elements, then scales)."""
        data = self.layer_numel(layer) * element_bytes(self.stored_dtype)
        return data + self.num_scales(layer) * SCALE_BYTES

    @property
    def block_bytes(self) -> int:
        """Stored bytes of one block (all layers): what every tier budget counts."""
        return sum(self.stored_layer_bytes(i) for i in range(len(self.layer_block_bytes)))

    @property
    def engine_block_bytes(self) -> int:
        """Bytes of one block in the paged cache (all layers)."""
        return sum(self.layer_block_bytes)

    @property
    def ratio(self) -> float:
        """Compression ratio: engine bytes over stored bytes (1.0 for ``auto``)."""
        return self.engine_block_bytes / self.block_bytes if self.block_bytes else 1.0
