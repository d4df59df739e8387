"""The server's files as ``benchmarks/faults.py`` reads and damages them: a session's block
keys (from the registry), a block's files, block files that fail their check, the shared-memory
segments the server recorded, and the damage done to block files.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import struct
from pathlib import Path
from typing import Protocol

SHM = Path("/dev/shm")


class HasCacheDir(Protocol):
    """A server with a ``--cache-dir`` (this benchmark's or the tests' server object)."""

    cache_dir: Path


def session_keys(cache_dir: Path, session: str) -> list[str]:
    """The session's block keys in prefix order, as the registry lists them."""
    with contextlib.closing(sqlite3.connect(cache_dir / "sessions.sqlite3")) as db:
        rows = db.execute(
            "SELECT key FROM session_blocks WHERE session_id = ? ORDER BY idx", (session,)
        ).fetchall()
    return [r[0] for r in rows]


def block_files(cache_dir: Path, key: str) -> list[Path]:
    """The files of a block key in every layout folder."""
    return sorted((cache_dir / "blocks").glob(f"*/{key[:2]}/{key[2:4]}/{key}.kvb"))


def corrupt_files(cache_dir: Path) -> int:
    """Block files that fail their header or checksum."""
    from server.kv.tiers.block_frame import BlockFileError, parse_block

    bad = 0
    for path in (cache_dir / "blocks").glob("*/*/*/*.kvb"):
        raw = path.read_bytes()
        key = path.name.removesuffix(".kvb")
        try:
            length = struct.unpack_from("<8sHQ", raw)[2] if len(raw) >= 18 else 0
            parse_block(raw, key, memoryview(bytearray(length)), str(path))
        except BlockFileError:
            bad += 1
    return bad


def recorded_segments(cache_dir: Path) -> set[str]:
    """Shared-memory names the server's records list (see ``server.shm``)."""
    import json

    names: set[str] = set()
    for path in (cache_dir / "shm").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            names |= set(json.loads(path.read_text()).get("segments", {}))
    return names


def existing(names: set[str]) -> set[str]:
    return {n for n in names if (SHM / n).exists()}


def count_lines(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


def damage(path: Path, how: str, other: Path | None = None) -> None:
    """Truncate, flip a payload byte of, or swap (with ``other``) a block file."""
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "flipped":
        raw[-100] ^= 0xFF
        path.write_bytes(raw)
    elif how == "swapped":
        assert other is not None
        data = other.read_bytes()
        other.write_bytes(raw)
        path.write_bytes(data)


def damage_session(server: HasCacheDir, session: str, first: int, how: str) -> None:
    """Damage block ``first`` of a session's files (and the next one, for a swap)."""
    files = [block_files(server.cache_dir, k)[0] for k in session_keys(server.cache_dir, session)]
    damage(files[first], how, files[first + 1] if how == "swapped" else None)
