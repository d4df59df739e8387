"""Block names: vLLM block hashes as hex strings and the file paths derived from them.

A block is named by vLLM's own block hash (a sha256 chain over the token prefix, with
``cache_salt`` mixed into the first block), so a name is stable across restarts and equal
prefixes share blocks. Session ids never reach a path: files are named by hash only.
"""

from __future__ import annotations

import re
from pathlib import Path

_HEX = re.compile(r"^[0-9a-f]{16,128}$")

BLOCK_SUFFIX = ".kvb"
"""File name suffix of a block file in the disk tier."""


class InvalidBlockKey(ValueError):
    """A string is not a block key (lowercase hex, 16-128 characters)."""


def block_key(block_hash: bytes) -> str:
    """The hex key of a vLLM block hash (``BlockHash`` is ``bytes``)."""
    return bytes(block_hash).hex()


def check_key(key: str) -> str:
    """Return ``key`` if it is a well-formed block key, else raise :class:`InvalidBlockKey`."""
    if not _HEX.match(key):
        raise InvalidBlockKey(f"not a block key: {key!r} (expected lowercase hex)")
    return key


def block_path(root: Path, key: str) -> Path:
    """Fan-out path of a block file: ``root/ab/cd/<key>.kvb`` (two 256-way levels)."""
    check_key(key)
    return root / key[:2] / key[2:4] / f"{key}{BLOCK_SUFFIX}"


def key_from_path(path: Path) -> str | None:
    """The key of a block file path, or None for any other file (temp files, manifest)."""
    name = path.name
    if not name.endswith(BLOCK_SUFFIX):
        return None
    key = name[: -len(BLOCK_SUFFIX)]
    return key if _HEX.match(key) else None
