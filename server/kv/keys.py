"""Block names: vLLM block hashes as hex strings and the file paths derived from them.

A block is named by vLLM's own block hash (a sha256 chain over the token prefix, with
``cache_salt`` mixed into the first block), so a name is stable across restarts and equal
prefixes share blocks. Session ids never reach a path: files are named by hash only.

With tensor parallelism (``tp_size`` > 1) every rank holds its own shard of each block's KV
heads, in its own file: ``<key>.r<rank>.kvb``. An engine with one rank keeps the plain
``<key>.kvb``, so the files of earlier versions stay valid.
"""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

_HEX = re.compile(r"[0-9a-f]{16,128}")
_RANKED = re.compile(r"([0-9a-f]{16,128})\.r([0-9]{1,4})")

BLOCK_SUFFIX = ".kvb"
"""File name suffix of a block file in the disk tier."""


class InvalidBlockKey(ValueError):
    """A string is not a block key (lowercase hex, 16-128 characters)."""


def block_key(block_hash: bytes) -> str:
    """The hex key of a vLLM block hash (``BlockHash`` is ``bytes``)."""
    return bytes(block_hash).hex()


def check_key(key: str) -> str:
    """Return ``key`` if it is a well-formed block key, else raise :class:`InvalidBlockKey`."""
    if not _HEX.fullmatch(key):
        raise InvalidBlockKey(f"not a block key: {key!r} (expected lowercase hex)")
    return key


def block_path(root: Path, key: str, rank: int | None = None) -> Path:
    """Fan-out path of a block file: ``root/ab/cd/<key>.kvb`` (two 256-way levels), or
    ``<key>.r<rank>.kvb`` for tensor-parallel rank ``rank`` of a layout with several ranks."""
    check_key(key)
    name = f"{key}{BLOCK_SUFFIX}" if rank is None else f"{key}.r{rank}{BLOCK_SUFFIX}"
    return root / key[:2] / key[2:4] / name


def parse_block_name(path: Path) -> tuple[str, int | None] | None:
    """(key, rank) of a block file path (rank None for an unranked file), or None for any
    other file (temp files, manifest)."""
    name = path.name
    if not name.endswith(BLOCK_SUFFIX):
        return None
    stem = name[: -len(BLOCK_SUFFIX)]
    if _HEX.fullmatch(stem):
        return stem, None
    ranked = _RANKED.fullmatch(stem)
    return (ranked.group(1), int(ranked.group(2))) if ranked else None


def key_from_path(path: Path) -> str | None:
    """The key of a block file path (of any rank), or None for any other file."""
    parsed = parse_block_name(path)
    return parsed[0] if parsed else None


# ------------------------------------------------------------------------ tail blocks
# A tail block holds the partly filled last block of a finished request. Its key is
# ``<parent><digest:60 hex><n:4 hex>``: the key of the last full block before it (or a root
# derived from the cache salt and LoRA when there is none), a digest of the parent and the
# exact n token ids, and n. vLLM block hashes are at most 32 bytes (64 hex), so a key longer
# than 64 hex characters is a tail, and the key alone says which block it extends and how
# many tokens it holds (a restart rebuilds the tail index from the file names).

TAIL_SUFFIX_HEX = 64
"""Hex characters a tail key adds to its parent's key."""


def tail_key(parent: str, tokens: list[int]) -> str:
    """The key of a tail of ``tokens`` (1 to 65535 token ids) after block ``parent``."""
    n = len(tokens)
    if not 0 < n < 1 << 16:
        raise ValueError(f"a tail holds 1 to 65535 tokens, got {n}")
    data = b"lgkv-tail\0" + bytes.fromhex(parent) + struct.pack(f"<{n}I", *tokens)
    return f"{parent}{hashlib.sha256(data).hexdigest()[:60]}{n:04x}"


def parse_tail_key(key: str) -> tuple[str, int] | None:
    """(parent key, token count) of a tail key; None for a full block's key."""
    if len(key) <= TAIL_SUFFIX_HEX:
        return None
    return key[:-TAIL_SUFFIX_HEX], int(key[-4:], 16)


def tail_root(cache_salt: str | None, lora: str | None) -> str:
    """The parent of a tail in a request's first block: tenants (cache salt) and adapters
    never share it, as vLLM mixes both into the first block's hash."""
    data = f"lgkv-tail-root\0{cache_salt or ''}\0{lora or ''}".encode()
    return hashlib.sha256(data).hexdigest()
