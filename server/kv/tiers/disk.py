"""The disk tier's files: one file per block, a checksummed header, a manifest per layout.

Layout under ``disk_dir``::

    <fingerprint>/manifest.json          model, weights, dtype, block size, layers, hash scheme,
                                         stored format (``--kv-offload-dtype``)
    <fingerprint>/ab/cd/<key>.kvb        header page (4 KiB) + raw block bytes, padded to 4 KiB
    <fingerprint>/ab/cd/<key>.r<N>.kvb   the same, of tensor-parallel rank N (``tp_size`` > 1)

The fingerprint is a hash of the manifest, so a restart with the same model reuses the files
and a changed model (or dtype, block size, hash seed, stored format, tensor-parallel size) gets
a fresh folder and ignores the old one: a block stored as int8 is never read as float16, and a
rank's shard of heads is never read as another layout's block.

Tensor parallelism: each worker rank writes and reads only its own file of a block
(``DiskStore(..., rank=N)``; its header names the key and the rank); the scheduler side's
store (``rank=None``) sees a block as present only when the files of every rank are, and
counts all of them against the disk budget. A block file is written
to a temp name, fsynced and renamed, so a reader sees a whole file or none. The header takes a
whole 4 KiB page and the file is padded to whole pages, so a page-aligned payload (the worker's
copies are) is written with ``O_DIRECT``: straight from the buffer to the device, without the
page-cache copy that costs a buffered write several milliseconds of CPU per block (the cores
the model runs on) plus the kernel's write-back later; where the file system refuses
``O_DIRECT`` the same bytes are written through the page cache. Reading checks the
magic, the key, the length and a CRC32 of the payload; any defect raises
:class:`BlockFileError` (the caller treats it as a miss). No torch here: the worker hands in and
gets back plain buffers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

from server.kv.keys import block_path, check_key, parse_block_name
from server.kv.tiers.block_frame import (
    PAGE,
    BlockFileError,
    check_file_header,
    file_header,
    file_tokens,
    is_page_aligned,
    padding,
    write_direct,
)
from server.kv.tiers.manifest import FILE_LAYOUT, Manifest

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_TMP_PREFIX = ".tmp-"


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
        self._direct = hasattr(os, "O_DIRECT")
        """Write page-aligned payloads with ``O_DIRECT`` (off once the file system refuses)."""
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

    def write(self, key: str, payload: memoryview, tokens: tuple[str, bytes] | None = None) -> None:
        """Write a block atomically (temp file, fsync, rename). Raises OSError on failure.

        A page-aligned ``payload`` goes to the device with ``O_DIRECT`` where the file system
        allows it; any other through the page cache (same bytes either way). ``tokens``: the
        key of the block it continues and its packed token ids, kept in the header page
        (:func:`read_tokens` gives them back after a restart)."""
        check_key(key)
        data = memoryview(payload).cast("B")
        if data.nbytes != self.manifest.block_bytes:
            raise ValueError(
                f"block payload is {data.nbytes} bytes, expected {self.manifest.block_bytes}"
            )
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{key}"
        head = file_header(key, data, self.rank, tokens)
        direct = self._direct and is_page_aligned(data)
        try:
            if direct:
                write_direct(tmp, head, data)
            else:
                with _create(tmp) as f:
                    f.write(head)
                    f.write(data)
                    f.write(bytes(padding(data.nbytes)))
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not (direct and isinstance(e, OSError) and e.errno == errno.EINVAL):
                raise
            self._no_direct(e)
            self.write(key, payload, tokens)

    def read_tokens(self, key: str) -> tuple[str, bytes] | None:
        """(parent key, packed token ids) from the header page of the block's file (the
        first rank's), or None: none written, or the file is missing or unreadable."""
        try:
            with open(self.paths(key)[0], "rb") as f:
                return file_tokens(f.read(PAGE))
        except OSError:
            return None

    def read_into(self, key: str, out: memoryview) -> None:
        """Fill ``out`` (exactly one block of bytes) from the block's file, checking it.

        Reads go through the page cache: a file written with ``O_DIRECT`` is not there, and a
        cold buffered read (with the kernel's read-ahead) took 5 ms per 5.9 MB block here,
        against 9.5 ms with ``O_DIRECT``, for the same CPU (mostly the CRC)."""
        dest = memoryview(out).cast("B")
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                crc = check_file_header(f.read(PAGE), key, dest.nbytes, str(path), self.rank)
                size, expected = os.fstat(f.fileno()).st_size, rank_file_bytes(self.manifest)
                if size != expected:
                    raise BlockFileError(f"{path}: {size} bytes, expected {expected}")
                got = f.readinto(dest)
        except FileNotFoundError as e:
            raise BlockFileError(f"{path}: missing") from e
        if got != dest.nbytes:
            raise BlockFileError(f"{path}: truncated payload ({got} of {dest.nbytes} bytes)")
        if zlib.crc32(dest) != crc:
            raise BlockFileError(f"{path}: checksum mismatch")

    def _no_direct(self, error: OSError) -> None:
        """The file system refused ``O_DIRECT``: page-cache writes from now on."""
        self._direct = False
        log.info("KV disk tier %s: no O_DIRECT here (%s); using the page cache", self.root, error)

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
        """Key -> size of every sound block file (:meth:`iter_scan`, joined)."""
        return {key: size for chunk in self.iter_scan() for key, size in chunk}

    def iter_scan(self, chunk: int = 4096) -> Iterator[list[tuple[str, int]]]:
        """(key, size) of every sound block file, in chunks of about ``chunk`` keys, as the
        walk finds them; the scheduler side runs it once at start, on a background thread
        (:class:`~server.kv.scheduler.recovery.FileScan`), and indexes each chunk as it comes.

        Recovers what crashes and damage left, with one warning per recovery naming the file:
        temp files of interrupted writes are deleted (quietly: a crash mid-write is normal);
        a manifest that is unreadable or names another layout means no file beside it can be
        trusted, so they are deleted and the manifest is rewritten; a block file of the wrong
        size (truncated) is deleted; empty fan-out folders are removed. With several
        tensor-parallel ranks a block counts only when every rank's file is there (a block's
        files share one fan-out folder); the files of a block that lacks one (a save
        interrupted between ranks) are deleted.
        """
        self._remove_earlier_file_layouts()
        trusted = self._manifest_ok()
        untrusted = partial = 0
        out: list[tuple[str, int]] = []
        for dirpath, _dirs, files in os.walk(self.root, topdown=False):
            here = Path(dirpath)
            seen: dict[str, set[int | None]] = {}
            untrusted += self._scan_folder(here, files, trusted, seen)
            for key, got in seen.items():
                if len(got) == len(self.ranks):
                    out.append((key, self.file_bytes))
                else:
                    self.remove(key)
                    partial += 1
            if here != self.root:
                with contextlib.suppress(OSError):
                    here.rmdir()  # only when empty
            if len(out) >= chunk:
                yield out
                out = []
        if out:
            yield out
        if partial:
            log.warning(
                "%d KV blocks under %s lacked the file of some tensor-parallel rank (a save "
                "interrupted between ranks): their files were deleted",
                partial,
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

    def _scan_folder(
        self, here: Path, files: list[str], trusted: bool, seen: dict[str, set[int | None]]
    ) -> int:
        """Note the sound block files of one folder in ``seen`` (key -> ranks found), delete
        the rest; the count of block files deleted as untrusted."""
        one_file = rank_file_bytes(self.manifest)
        untrusted = 0
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
        return untrusted

    def _remove_earlier_file_layouts(self) -> None:
        """Delete the folder of this manifest under an earlier block file layout (left by an
        older version of this server): its files can never be read again, and the disk budget
        does not count them. Folders of other models, dtypes or formats stay."""
        for files in range(1, FILE_LAYOUT):
            old = self.root.parent / self.manifest.fingerprint(files)
            if old == self.root or not old.is_dir():
                continue
            count = sum(1 for p in old.rglob("*") if p.is_file())
            shutil.rmtree(old, ignore_errors=True)
            log.warning(
                "KV disk tier: deleted %s (%d files in block file layout %d, which this version "
                "no longer reads); its blocks are recomputed when next needed",
                old,
                count,
                files,
            )

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


def rank_file_bytes(manifest: Manifest) -> int:
    """Size on disk of one block file of ``manifest`` (header + key id + one rank's
    payload)."""
    return PAGE + manifest.block_bytes + padding(manifest.block_bytes)


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
