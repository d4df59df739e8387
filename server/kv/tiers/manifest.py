"""What the bytes of a block mean: the :class:`Manifest` of a layout, and its fingerprint.

Every tier keys a block's bytes by the fingerprint of its manifest: the disk tier's folder
(:mod:`.disk`), the Redis key prefix (:mod:`.redis`), the registry's layout
(:mod:`server.kv.layout`). Equal manifests can share blocks; any change of model, weights,
dtype, block size, hash seed, stored format, tensor-parallel size or KV cache groups gives
another fingerprint, so bytes of one layout are never read as another's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from server.kv.formats import SCALE_SCHEME, SCALED, BlockFormat

__all__ = ["FILE_LAYOUT", "Manifest"]

FILE_LAYOUT = 2
"""Version of the block file layout, part of the fingerprint (1: header and payload back to
back; 2: a header page and page padding, for ``O_DIRECT``)."""


@dataclass(frozen=True)
class Manifest:
    """What the bytes of a block mean; equal manifests can share files."""

    model_id: str
    """Served model name or path."""
    dtype: str
    """KV cache dtype, e.g. ``torch.float32``."""
    block_size: int
    """Tokens per block."""
    layers: tuple[str, ...]
    """Attention layer names in the order their bytes appear in a block."""
    layer_block_bytes: tuple[int, ...]
    """Bytes of one block of each layer."""
    hash_scheme: str
    """vLLM's prefix hash algorithm and the hex of its NONE_HASH seed block."""
    offload_dtype: str = "auto"
    """Stored format of the blocks (:data:`server.kv.formats.OFFLOAD_DTYPES`)."""
    kv_heads: int = 1
    """KV heads per layer (where ``int8``/``fp8`` scales go)."""
    weights: str = ""
    """Fingerprint of the weight files (:func:`server.kv.weights.weights_fingerprint`): other
    weights in the same folder, with the same config, never reuse these blocks."""
    tp_size: int = 1
    """Tensor-parallel ranks. ``layer_block_bytes`` and ``kv_heads`` are one rank's share
    (vLLM splits the KV heads between ranks); each rank stores its own file of a block."""
    groups: tuple[int, ...] = ()
    """Per layer, the vLLM KV cache group it belongs to (empty: one group). With several
    groups (sliding-window and global layers under vLLM's hybrid KV cache manager) a block
    holds every layer of every group at the same token positions."""

    @property
    def block_format(self) -> BlockFormat:
        """The stored format and its sizes."""
        scaled = self.offload_dtype in SCALED
        return BlockFormat(
            self.offload_dtype,
            self.dtype.removeprefix("torch."),
            self.layer_block_bytes,
            kv_heads=self.kv_heads if scaled else 1,
            block_tokens=self.block_size if scaled else 1,
        )

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one rank's shard of a block (all layers) as stored: one file."""
        if self.offload_dtype == "auto":
            return sum(self.layer_block_bytes)
        return self.block_format.block_bytes

    @property
    def total_block_bytes(self) -> int:
        """Payload bytes of one block over every rank: what the RAM budget counts."""
        return self.block_bytes * self.tp_size

    @property
    def ranks(self) -> tuple[int | None, ...]:
        """The rank part of the block files' names: ``(None,)`` for one rank, else 0..N-1."""
        return (None,) if self.tp_size == 1 else tuple(range(self.tp_size))

    def fingerprint(self, files: int = FILE_LAYOUT) -> str:
        """16 hex chars naming the folder of this layout (and the Redis key prefix).

        Scaled formats add :data:`~server.kv.formats.SCALE_SCHEME`; block file layouts after
        the first add ``files`` (:data:`FILE_LAYOUT`), so files of an earlier layout are never
        read as this one's (``DiskStore.scan`` deletes them)."""
        fields: dict[str, object] = asdict(self)
        if files > 1:
            fields["files"] = files
        if self.tp_size == 1:  # as before tensor parallelism: one-rank files stay valid
            del fields["tp_size"]
        if not self.groups:  # one group, as before groups: its files stay valid
            del fields["groups"]
        if self.offload_dtype == "auto":
            del fields["offload_dtype"], fields["kv_heads"]
        elif self.offload_dtype in SCALED:
            fields["scales"] = SCALE_SCHEME
        else:
            del fields["kv_heads"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
