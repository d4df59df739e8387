"""The disk tier's files: one file per block, a checksummed header, a manifest per layout.

Layout under ``disk_dir``::

    <fingerprint>/manifest.json          model, weights, dtype, block size, layers, hash scheme,
                                         stored format (``--kv-offload-dtype``)
    <fingerprint>/ab/cd/<key>.kvb        header + raw block bytes
    <fingerprint>/ab/cd/<key>.r<N>.kvb   the same, of tensor-parallel rank N (``tp_size`` > 1)

The fingerprint is a hash of the manifest, so a restart with the same model reuses the files
and a changed model (or dtype, block size, hash seed, stored format, tensor-parallel size) gets
a fresh folder and ignores the old one: a block stored as int8 is never read as float16, and a
rank's shard of heads is never read as another layout's block.

Tensor parallelism: each worker rank writes and reads only its own file of a block
(``DiskStore(..., rank=N)``; its header names the key and the rank); the scheduler side's
store (``rank=None``) sees a block as present only when the files of every rank are, and
counts all of them against the disk budget. A block file is written
to a temp name, fsynced and renamed, so a reader sees a whole file or none. Reading checks the
magic, the key, the length and a CRC32 of the payload; any defect raises
:class:`BlockFileError` (the caller treats it as a miss). No torch here: the worker hands in and
gets back plain buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from server.kv.formats import SCALE_SCHEME, SCALED, BlockFormat
from server.kv.keys import block_path, check_key, parse_block_name

log = logging.getLogger(__name__)

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

    def fingerprint(self) -> str:
        """16 hex chars naming the folder of this layout (and the Redis key prefix).

        ``auto`` manifests hash as before the format existed, so their files stay valid; scaled
        formats add :data:`~server.kv.formats.SCALE_SCHEME`."""
        fields: dict[str, object] = asdict(self)
        if self.tp_size == 1:  # as before tensor parallelism: one-rank files stay valid
            del fields["tp_size"]
        if self.offload_dtype == "auto":
            del fields["offload_dtype"], fields["kv_heads"]
        elif self.offload_dtype in SCALED:
            fields["scales"] = SCALE_SCHEME
        else:
            del fields["kv_heads"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskStore:
    """Block files of one manifest. Methods are thread-safe (files are independent).

    ``rank``: the tensor-parallel rank whose files this store writes and reads (a worker);
    ``None`` (the scheduler side, or a one-rank layout) sees every rank's files: ``scan`` and
    ``remove`` cover them all, ``write`` and ``read_into`` need a single-rank layout."""

    def __init__(self, disk_dir: Path, manifest: Manifest, rank: int | None = None) -> None:
        self.manifest = manifest
        if rank is not None and not 0 <= rank < manifest.tp_size:
            raise ValueError(f"rank {rank} is outside tensor-parallel size {manifest.tp_size}")
        self.rank = rank if manifest.tp_size > 1 else None
        self.ranks = manifest.ranks if self.rank is None else (self.rank,)
        """The ranks whose files this store covers."""
        self.root = Path(disk_dir) / manifest.fingerprint()
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.root / MANIFEST_FILE).exists():
            self._write_manifest()

    def _write_manifest(self) -> None:
        tmp = self.root / f"{_TMP_PREFIX}{os.getpid()}-{MANIFEST_FILE}"
        tmp.write_text(json.dumps(asdict(self.manifest), indent=2, sort_keys=True))
        os.replace(tmp, self.root / MANIFEST_FILE)

    @property
    def file_bytes(self) -> int:
        """Size on disk of one block in this store: its file, or the files of every rank
        (header + payload each); what the disk budget counts."""
        return rank_file_bytes(self.manifest) * len(self.ranks)

    def path(self, key: str) -> Path:
        """The file of a block key (of this store's rank)."""
        if len(self.ranks) != 1:
            raise ValueError("a store of every tensor-parallel rank has no single block file")
        return block_path(self.root, key, self.ranks[0])

    def paths(self, key: str) -> list[Path]:
        """The files of a block key, one per rank this store covers."""
        return [block_path(self.root, key, rank) for rank in self.ranks]

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
        head = block_header(key, data, self.rank)
        try:
            with _create(tmp) as f:
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
                if f.read(key_len) != header_key_id(key, self.rank):
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
        """Delete a block's file (every rank's, for a store of every rank); False if none
        was there."""
        removed = False
        for path in self.paths(key):
            try:
                path.unlink()
                removed = True
            except FileNotFoundError:
                pass
        path = self.paths(key)[0]
        for folder in (path.parent, path.parent.parent):  # empty fan-out folders go too
            try:
                folder.rmdir()
            except OSError:
                break
        return removed

    def scan(self) -> dict[str, int]:
        """Key -> size of every sound block file; the scheduler side calls it once at start.

        Recovers what crashes and damage left, with one warning per recovery naming the file:
        temp files of interrupted writes are deleted (quietly: a crash mid-write is normal);
        a manifest that is unreadable or names another layout means no file beside it can be
        trusted, so they are deleted and the manifest is rewritten; a block file of the wrong
        size (truncated) is deleted; empty fan-out folders are removed. With several
        tensor-parallel ranks a block counts only when every rank's file is there; the files
        of a block that lacks one (a save interrupted between ranks) are deleted.
        """
        trusted = self._manifest_ok()
        one_file = rank_file_bytes(self.manifest)
        seen: dict[str, set[int | None]] = {}
        untrusted = 0
        for dirpath, _dirs, files in os.walk(self.root, topdown=False):
            here = Path(dirpath)
            for name in files:
                path = here / name
                parsed = parse_block_name(path)
                if not name.startswith(_TMP_PREFIX) and parsed is None:
                    continue  # the manifest, or a file that is not ours
                try:
                    size = path.stat().st_size
                    ours = parsed is not None and parsed[1] in self.ranks
                    if parsed is not None and ours and trusted and size == one_file:
                        seen.setdefault(parsed[0], set()).add(parsed[1])
                        continue
                    path.unlink()
                except OSError:
                    continue
                if parsed is not None and trusted:
                    log.warning(
                        "KV block file %s is %d bytes, expected %d (truncated or damaged) or "
                        "names another rank: deleted; its tokens are recomputed",
                        path,
                        size,
                        one_file,
                    )
                untrusted += parsed is not None and not trusted
            if here != self.root:
                with contextlib.suppress(OSError):
                    here.rmdir()  # only when empty
        found = {key: self.file_bytes for key, got in seen.items() if len(got) == len(self.ranks)}
        partial = [key for key in seen if key not in found]
        for key in partial:
            self.remove(key)
        if partial:
            log.warning(
                "%d KV blocks under %s lacked the file of some tensor-parallel rank (a save "
                "interrupted between ranks): their files were deleted",
                len(partial),
                self.root,
            )
        if not trusted:
            self._write_manifest()
            log.warning(
                "KV manifest %s is unreadable or names another layout: the %d block files "
                "beside it were deleted and the manifest rewritten",
                self.root / MANIFEST_FILE,
                untrusted,
            )
        return found

    def _manifest_ok(self) -> bool:
        """True when ``manifest.json`` describes this store's layout."""
        try:
            data = json.loads((self.root / MANIFEST_FILE).read_text())
            return Manifest(**data).fingerprint() == self.manifest.fingerprint()
        except FileNotFoundError:
            self._write_manifest()  # deleted: the folder's name is the layout's fingerprint
            return True
        except (OSError, ValueError, TypeError):
            return False


KEY_ID_CHARS = 64
"""Characters of the key id in every block header: all block files of a layout are one size."""


def header_key_id(key: str, rank: int | None = None) -> bytes:
    """The key as the header names it: a full block's key (64 hex characters) as is, a longer
    tail key (:func:`server.kv.keys.tail_key`) by the SHA-256 of it, so a tail's file is the
    same size as a full block's and budgets, start-up checks and Redis values stay uniform.
    A tensor-parallel rank's shard is named by the SHA-256 of the key and the rank, so one
    rank's bytes never pass for another's."""
    if rank is not None:
        return hashlib.sha256(f"{key}\0rank{rank}".encode()).hexdigest().encode()
    if len(key) <= KEY_ID_CHARS:
        return key.encode()
    return hashlib.sha256(key.encode()).hexdigest().encode()


def rank_file_bytes(manifest: Manifest) -> int:
    """Size on disk of one block file of ``manifest`` (header + key id + one rank's
    payload)."""
    return _HEAD.size + KEY_ID_CHARS + manifest.block_bytes


def block_file_bytes(manifest: Manifest) -> int:
    """Size on disk of one block of ``manifest``: the files of every rank."""
    return rank_file_bytes(manifest) * manifest.tp_size


def _create(path: Path):  # type: ignore[no-untyped-def]
    """Open a new file for writing, re-creating its folder if a concurrent removal of the
    last file beside it took the folder away."""
    try:
        return open(path, "wb")
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "wb")


def block_header(key: str, data: memoryview, rank: int | None = None) -> bytes:
    """The header stored in front of a block's bytes (magic, key, length, CRC32)."""
    kb = header_key_id(key, rank)
    return _HEAD.pack(_MAGIC, len(kb), data.nbytes, zlib.crc32(data)) + kb


def parse_block(raw: bytes, key: str, out: memoryview, where: str, rank: int | None = None) -> None:
    """Check a stored block (header + payload) of ``rank`` and copy its payload into ``out``."""
    dest = memoryview(out).cast("B")
    if len(raw) < _HEAD.size:
        raise BlockFileError(f"{where}: truncated header")
    magic, key_len, length, crc = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        raise BlockFileError(f"{where}: not a block")
    start = _HEAD.size + key_len
    if raw[_HEAD.size : start] != header_key_id(key, rank):
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
            for rank in _ranks_of(root):
                try:
                    block_path(root, key, rank).unlink()
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


def _ranks_of(root: Path) -> tuple[int | None, ...]:
    """The rank parts of the file names of the layout folder ``root`` (from its manifest)."""
    try:
        tp_size = int(json.loads((root / MANIFEST_FILE).read_text()).get("tp_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        tp_size = 1
    return (None,) if tp_size <= 1 else tuple(range(tp_size))
