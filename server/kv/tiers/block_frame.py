"""One block framed for storage: the header that names and checks it, for a Redis value
(header, key id and payload back to back) and for a block file (a header page, the payload
from the next page on, zeros to the end of its last page), and the ``O_DIRECT`` write of a
file. No torch: plain buffers in and out."""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import zlib
from pathlib import Path

REDIS_MAGIC = b"LGKVBLK\x01"
"""Magic of a block framed for Redis (header, key id, payload, back to back)."""
FILE_MAGIC = b"LGKVBLK\x02"
"""Magic of a block file (header page, payload, padding to whole pages)."""
HEAD = struct.Struct("<8sHQI")  # magic, key length, payload length, crc32
PAGE = 4096
"""The block files' alignment: header page, payload offset and file size (``O_DIRECT``)."""


class BlockFileError(OSError):
    """A block file is missing, truncated, for another key or fails its checksum."""


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


def block_header(key: str, data: memoryview, rank: int | None = None) -> bytes:
    """The header stored in front of a block's bytes in Redis (magic, key, length, CRC32)."""
    kb = header_key_id(key, rank)
    return HEAD.pack(REDIS_MAGIC, len(kb), data.nbytes, zlib.crc32(data)) + kb


TOKENS = struct.Struct("<4sHHI")  # magic, parent key length, token count, crc32 of the rest
TOKENS_MAGIC = b"TOKS"
TOKENS_AT = 256
"""Offset of the token section in a block file's header page (after the header and key)."""


def token_section(parent: str, tokens: bytes) -> bytes:
    """The block's token ids (``tokens``: packed little-endian uint32) and the key of the
    block it continues, as a file's header page holds them; empty when they do not fit."""
    pb = parent.encode()
    body = pb + tokens
    if len(pb) > 0xFFFF or len(tokens) // 4 > 0xFFFF or TOKENS_AT + TOKENS.size + len(body) > PAGE:
        return b""
    return TOKENS.pack(TOKENS_MAGIC, len(pb), len(tokens) // 4, zlib.crc32(body)) + body


def file_tokens(head: bytes) -> tuple[str, bytes] | None:
    """(parent key, packed token ids) from a block file's header page, or None: files written
    without them (or before they were written) have zeros there, and a section that fails
    its checksum counts as none."""
    raw = head[TOKENS_AT:PAGE]
    if len(raw) < TOKENS.size:
        return None
    magic, parent_len, count, crc = TOKENS.unpack_from(raw)
    body = raw[TOKENS.size : TOKENS.size + parent_len + 4 * count]
    if magic != TOKENS_MAGIC or len(body) != parent_len + 4 * count or zlib.crc32(body) != crc:
        return None
    return body[:parent_len].decode(errors="replace"), bytes(body[parent_len:])


def file_header(
    key: str, data: memoryview, rank: int | None = None, tokens: tuple[str, bytes] | None = None
) -> bytes:
    """The header page of a block file (magic, key, length, CRC32, zeros to :data:`PAGE`);
    with ``tokens`` (parent key, packed token ids) their section at :data:`TOKENS_AT`, which
    the checks of the header and payload ignore (they name and check the bytes only)."""
    kb = header_key_id(key, rank)
    head = HEAD.pack(FILE_MAGIC, len(kb), data.nbytes, zlib.crc32(data)) + kb
    section = token_section(*tokens) if tokens else b""
    if not section:
        return head + bytes(PAGE - len(head))
    head += bytes(TOKENS_AT - len(head)) + section
    return head + bytes(PAGE - len(head))


def padding(nbytes: int) -> int:
    """Zero bytes after a payload of ``nbytes`` to the end of its last page."""
    return -nbytes % PAGE


def is_page_aligned(data: memoryview) -> bool:
    """Whether ``data`` starts on a :data:`PAGE` boundary (``O_DIRECT`` needs it)."""
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8).ctypes.data % PAGE == 0


def write_direct(path: Path, head: bytes, data: memoryview) -> None:
    """Write header page, page-aligned payload and padding to a new file with ``O_DIRECT``
    and fsync it. The header page and the payload's last partial page go through one
    page-aligned scratch buffer; the payload's whole pages go straight from ``data``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)  # every tenant's KV: the server's user only
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o600)
    try:
        page = mmap.mmap(-1, PAGE)  # anonymous mappings are page-aligned
        try:
            page[:] = head
            _write_all(fd, memoryview(page))
            whole = data.nbytes - data.nbytes % PAGE
            if whole:
                _write_all(fd, data[:whole])
            if whole < data.nbytes:
                page[:] = bytes(data[whole:]) + bytes(padding(data.nbytes))
                _write_all(fd, memoryview(page))
        finally:
            page.close()
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])


def _check_head(
    raw: bytes, key: str, nbytes: int, where: str, rank: int | None, magics: tuple[bytes, ...]
) -> tuple[bytes, int]:
    """Check a header at the start of ``raw`` (magic among ``magics``, key, payload length
    ``nbytes``); its (magic, payload CRC32)."""
    if len(raw) < HEAD.size:
        raise BlockFileError(f"{where}: truncated header")
    magic, key_len, length, crc = HEAD.unpack_from(raw)
    if magic not in magics:
        raise BlockFileError(f"{where}: not a block")
    if raw[HEAD.size : HEAD.size + key_len] != header_key_id(key, rank):
        raise BlockFileError(f"{where}: holds another block")
    if length != nbytes:
        raise BlockFileError(f"{where}: {length} bytes, expected {nbytes}")
    return magic, crc


def check_file_header(head: bytes, key: str, nbytes: int, where: str, rank: int | None) -> int:
    """Check a block file's header page (magic, key, payload length); its payload's CRC32."""
    if len(head) != PAGE:
        raise BlockFileError(f"{where}: truncated header")
    return _check_head(head, key, nbytes, where, rank, (FILE_MAGIC,))[1]


def parse_block(raw: bytes, key: str, out: memoryview, where: str, rank: int | None = None) -> None:
    """Check a stored block of ``rank`` (a Redis value or a whole block file) and copy its
    payload into ``out``."""
    dest = memoryview(out).cast("B")
    magic, crc = _check_head(raw, key, dest.nbytes, where, rank, (REDIS_MAGIC, FILE_MAGIC))
    start = PAGE if magic == FILE_MAGIC else HEAD.size + len(header_key_id(key, rank))
    size = start + dest.nbytes + (padding(dest.nbytes) if magic == FILE_MAGIC else 0)
    if len(raw) != size:
        raise BlockFileError(f"{where}: {len(raw)} bytes, expected {size}")
    payload = memoryview(raw)[start : start + dest.nbytes]
    if zlib.crc32(payload) != crc:
        raise BlockFileError(f"{where}: checksum mismatch")
    dest[:] = payload
