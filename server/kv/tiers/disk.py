"""The disk tier's files: one file per block, a checksummed header, a manifest per layout.

Layout under ``disk_dir``::

    <fingerprint>/manifest.json          model, dtype, block size, layer layout, hash scheme
    <fingerprint>/ab/cd/<key>.kvb        header + raw block bytes

The fingerprint is a hash of the manifest, so a restart with the same model reuses the files
and a changed model (or dtype, block size, hash seed) gets a fresh folder and ignores the old
one. A block file is written to a temp name, fsynced and renamed, so a reader sees a whole file
or none. Reading checks the magic, the key, the length and a CRC32 of the payload; any defect
raises :class:`BlockFileError` (the caller treats it as a miss). No torch here: the worker hands
in and gets back plain buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from server.kv.keys import block_path, check_key, key_from_path

MANIFEST_FILE = "manifest.json"
_MAGIC = b"LGKVBLK\x01"
_HEAD = struct.Struct("<8sHQI")  # magic, key length, payload length, crc32
_TMP_PREFIX = ".tmp-"


class BlockFileError(OSError):
    """A block file is missing, truncated, for another key or fails its checksum."""


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

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (all layers)."""
        return sum(self.layer_block_bytes)

    def fingerprint(self) -> str:
        """16 hex chars naming the folder of this layout."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskStore:
    """Block files of one manifest. Methods are thread-safe (files are independent)."""

    def __init__(self, disk_dir: Path, manifest: Manifest) -> None:
        self.manifest = manifest
        self.root = Path(disk_dir) / manifest.fingerprint()
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / MANIFEST_FILE
        if not target.exists():
            tmp = self.root / f"{_TMP_PREFIX}{os.getpid()}-{MANIFEST_FILE}"
            tmp.write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True))
            os.replace(tmp, target)

    @property
    def file_bytes(self) -> int:
        """Size on disk of one block file (header + payload), counted against the budget."""
        return _HEAD.size + 64 + self.manifest.block_bytes

    def path(self, key: str) -> Path:
        """The file of a block key."""
        return block_path(self.root, key)

    def write(self, key: str, payload: memoryview) -> None:
        """Write a block atomically (temp file, fsync, rename). Raises OSError on failure."""
        check_key(key)
        data = memoryview(payload).cast("B")
        if data.nbytes != self.manifest.block_bytes:
            raise ValueError(
                f"block payload is {data.nbytes} bytes, expected {self.manifest.block_bytes}"
            )
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{key}"
        head = block_header(key, data)
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def read_into(self, key: str, out: memoryview) -> None:
        """Fill ``out`` (exactly one block of bytes) from the block's file, checking it."""
        dest = memoryview(out).cast("B")
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD.size)
                if len(head) != _HEAD.size:
                    raise BlockFileError(f"{path}: truncated header")
                magic, key_len, length, crc = _HEAD.unpack(head)
                if magic != _MAGIC:
                    raise BlockFileError(f"{path}: not a block file")
                if f.read(key_len) != key.encode():
                    raise BlockFileError(f"{path}: holds another block")
                if length != dest.nbytes:
                    raise BlockFileError(f"{path}: {length} bytes, expected {dest.nbytes}")
                got = f.readinto(dest)
        except FileNotFoundError as e:
            raise BlockFileError(f"{path}: missing") from e
        if got != dest.nbytes:
            raise BlockFileError(f"{path}: truncated payload ({got} of {dest.nbytes} bytes)")
        if zlib.crc32(dest) != crc:
            raise BlockFileError(f"{path}: checksum mismatch")

    def remove(self, key: str) -> bool:
        """Delete a block's file; False if it was not there."""
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def scan(self) -> dict[str, int]:
        """Key -> file size of every block file (left-over temp files are deleted)."""
        found: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                path = Path(dirpath) / name
                if name.startswith(_TMP_PREFIX):
                    with contextlib.suppress(OSError):
                        path.unlink()
                    continue
                key = key_from_path(path)
                if key is not None:
                    with contextlib.suppress(OSError):
                        found[key] = path.stat().st_size
        return found


def block_header(key: str, data: memoryview) -> bytes:
    """The header stored in front of a block's bytes (magic, key, length, CRC32)."""
    kb = key.encode()
    return _HEAD.pack(_MAGIC, len(kb), data.nbytes, zlib.crc32(data)) + kb


def parse_block(raw: bytes, key: str, out: memoryview, where: str) -> None:
    """Check a stored block (header + payload) and copy its payload into ``out``."""
    dest = memoryview(out).cast("B")
    if len(raw) < _HEAD.size:
        raise BlockFileError(f"{where}: truncated header")
    magic, key_len, length, crc = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise BlockFileError(f"{where}: not a block")
    start = _HEAD.size + key_len
    if raw[_HEAD.size : start] != key.encode():
        raise BlockFileError(f"{where}: holds another block")
    if length != dest.nbytes or len(raw) != start + length:
        raise BlockFileError(f"{where}: {len(raw) - start} bytes, expected {dest.nbytes}")
    payload = memoryview(raw)[start:]
    if zlib.crc32(payload) != crc:
        raise BlockFileError(f"{where}: checksum mismatch")
    dest[:] = payload


def remove_block_files(disk_dir: Path, keys: Iterable[str]) -> int:
    """Delete the files of ``keys`` under every layout folder of ``disk_dir``; count removed.

    Used by the API process (which does not know the engine's layout) to free a session's
    blocks so that they are gone when the call returns.
    """
    disk_dir = Path(disk_dir)
    roots = [p.parent for p in disk_dir.glob(f"*/{MANIFEST_FILE}")] if disk_dir.is_dir() else []
    removed = 0
    for key in keys:
        for root in roots:
            try:
                block_path(root, key).unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed
