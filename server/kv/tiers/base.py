"""The interface every persistent tier implements (disk now; a Redis tier would too).

A store keeps whole blocks as bytes under their hex key. It never raises on a lookup miss
silently: ``read_into`` raises ``OSError`` (``BlockFileError`` for the disk) on a missing or
damaged block, and the worker turns that into a miss plus a warning.
"""

from __future__ import annotations

from typing import Literal, Protocol

TierName = Literal["ram", "disk", "redis"]
"""Names used in metrics labels and in the session API's ``tiers`` object."""

TIERS: tuple[TierName, ...] = ("ram", "disk", "redis")


class BlockStore(Protocol):
    """Byte storage of blocks by key (thread-safe: the worker calls it from its I/O thread)."""

    def write(self, key: str, payload: memoryview) -> None:
        """Store one block atomically; raise OSError on failure."""

    def read_into(self, key: str, out: memoryview) -> None:
        """Fill ``out`` with the block; raise OSError if missing or damaged."""

    def remove(self, key: str) -> bool:
        """Delete the block; False if it was not there."""

    def scan(self) -> dict[str, int]:
        """Every stored key with its stored size in bytes."""
