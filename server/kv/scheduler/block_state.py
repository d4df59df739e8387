"""Where one block is: the scheduler index's record of a block (RAM slot, disk file, locks).

Pure Python (no torch). :class:`~server.kv.scheduler.index.BlockIndex` owns every record and
the maps over them; a record tells its index when its slot changes, so the index's slot map
never disagrees with the records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.kv.metadata import NO_SLOT

if TYPE_CHECKING:
    from server.kv.scheduler.index import BlockIndex

__all__ = ["BlockState"]


class BlockState:
    """Where one block is. Setting ``slot`` keeps the index's slot map in step."""

    __slots__ = (
        "_index",
        "_slot",
        "counted",
        "disk_confirmed",
        "dropped",
        "key",
        "last_access",
        "locks",
        "on_disk",
        "ram_ready",
    )

    def __init__(
        self,
        key: str,
        slot: int = NO_SLOT,
        ram_ready: bool = False,
        on_disk: bool = False,
        disk_confirmed: bool = False,
        locks: int = 0,
        last_access: float = 0.0,
        dropped: bool = False,
    ) -> None:
        self.key = key
        self._index: BlockIndex | None = None
        self._slot = slot
        self.ram_ready = ram_ready
        """The slot's bytes are valid (the worker confirmed the copy)."""
        self.on_disk = on_disk
        """A file is written or queued for writing."""
        self.disk_confirmed = disk_confirmed
        """The worker confirmed the file."""
        self.locks = locks
        """Loads and reads in flight that use the slot."""
        self.last_access = last_access
        """Unix time of the last save, hit or prefetch."""
        self.dropped = dropped
        """Deleted while locked: freed when the last lock goes."""
        self.counted = (False, False)
        """(write unconfirmed, file confirmed) as the index's counters count it."""

    @property
    def slot(self) -> int:
        """RAM slot holding (or about to hold) the block."""
        return self._slot

    @slot.setter
    def slot(self, slot: int) -> None:
        old, self._slot = self._slot, slot
        if self._index is not None and old != slot:
            self._index.slot_moved(self, old)

    def __repr__(self) -> str:
        return (
            f"BlockState({self.key!r}, slot={self._slot}, ram_ready={self.ram_ready}, "
            f"on_disk={self.on_disk}, disk_confirmed={self.disk_confirmed}, locks={self.locks}, "
            f"last_access={self.last_access}, dropped={self.dropped})"
        )
