"""The scheduler's index of blocks: which key sits in which RAM slot and which is on disk.

Pure Python (no torch). Owns the two budgets: ``num_slots`` RAM slots of one block each (the
worker's pool is exactly that big) and ``disk_bytes`` of block files. Every save is written
through to disk, so evicting from RAM drops nothing the disk still holds ("RAM spills to
disk"). A disk write is visible as ``on_disk`` from the moment it is queued: the worker serves
a read of a block whose write is still queued from that write's buffer, and runs writes and
removals in FIFO order, so a read planned later finds the bytes (or fails cleanly).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from server.kv.metadata import NO_SLOT, WorkerReport
from server.kv.scheduler.policy import EvictionPolicy

log = logging.getLogger(__name__)


@dataclass
class BlockState:
    """Where one block is."""

    key: str
    slot: int = NO_SLOT
    """RAM slot holding (or about to hold) the block."""
    ram_ready: bool = False
    """The slot's bytes are valid (the worker confirmed the copy)."""
    on_disk: bool = False
    """A file is written or queued for writing."""
    disk_confirmed: bool = False
    """The worker confirmed the file."""
    locks: int = 0
    """Loads and reads in flight that use the slot."""
    last_access: float = 0.0
    """Unix time of the last save, hit or prefetch."""
    dropped: bool = False
    """Deleted while locked: freed when the last lock goes."""


class BlockIndex:
    """Blocks by key, RAM slot allocation and disk budget, with policy-driven eviction."""

    def __init__(
        self, *, num_slots: int, file_bytes: int, disk_bytes: int, policy: EvictionPolicy
    ) -> None:
        self.num_slots = num_slots
        self.file_bytes = file_bytes
        self.disk_bytes = disk_bytes
        self.policy = policy
        self.blocks: dict[str, BlockState] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.disk_used = 0
        self.removes: list[str] = []
        """Disk files to delete, handed to the worker with the next plan."""
        self.dirty: set[str] = set()
        """Keys whose tiers changed since the last publish to the registry."""
        self.evicted = {"ram": 0, "disk": 0}

    # ------------------------------------------------------------------ queries

    def tier_of(self, key: str) -> str | None:
        """ "ram", "disk" or None (not loadable)."""
        state = self.blocks.get(key)
        if state is None or state.dropped:
            return None
        if state.ram_ready:
            return "ram"
        return "disk" if state.on_disk else None

    def ram_blocks(self) -> int:
        """Slots in use (ready or being filled)."""
        return self.num_slots - len(self.free_slots)

    def disk_blocks(self) -> int:
        """Block files written or queued."""
        return self.disk_used // self.file_bytes if self.file_bytes else 0

    def gauges(self, block_bytes: int, *, redis_blocks: int) -> dict[str, float]:
        """``lgkv_tier_blocks`` / ``lgkv_tier_bytes`` samples of every tier."""
        counts = {"ram": self.ram_blocks(), "disk": self.disk_blocks(), "redis": redis_blocks}
        out: dict[str, float] = {}
        for tier, n in counts.items():
            out[f'lgkv_tier_blocks{{tier="{tier}"}}'] = float(n)
            size = self.disk_used if tier == "disk" else n * block_bytes
            out[f'lgkv_tier_bytes{{tier="{tier}"}}'] = float(size)
        return out

    def location(self, key: str) -> tuple[bool, bool]:
        """(in RAM, on disk) as published to the registry."""
        state = self.blocks.get(key)
        if state is None or state.dropped:
            return False, False
        return state.ram_ready, state.on_disk and state.disk_confirmed

    # ------------------------------------------------------------------ changes

    def add_disk_file(self, key: str) -> bool:
        """Register a file found at start; False if the budget is full."""
        if self.disk_used + self.file_bytes > self.disk_bytes:
            return False
        state = self.blocks.setdefault(key, BlockState(key, last_access=0.0))
        state.on_disk = state.disk_confirmed = True
        self.disk_used += self.file_bytes
        self.dirty.add(key)
        return True

    def touch(self, key: str) -> None:
        """Mark a block used now."""
        state = self.blocks.get(key)
        if state is not None:
            state.last_access = time.time()

    def alloc_slots(self, count: int, protect: set[str]) -> list[int]:
        """Up to ``count`` free slots, evicting the policy's first victims if needed."""
        got: list[int] = []
        while self.free_slots and len(got) < count:
            got.append(self.free_slots.pop())
        if len(got) == count:
            return got
        candidates = [
            (s.key, s.last_access)
            for s in self.blocks.values()
            if s.slot != NO_SLOT and s.ram_ready and s.locks == 0 and s.key not in protect
        ]
        for key in self.policy.order(candidates, allow_pinned=True):
            if len(got) == count:
                break
            state = self.blocks[key]
            if self.policy.is_pinned(key) and not state.on_disk:
                continue  # a pinned block leaves RAM only if the disk keeps it
            got.append(state.slot)
            self._leave_ram(state, free=False)
            self.evicted["ram"] += 1
        return got

    def reserve_disk(self, protect: set[str]) -> bool:
        """Make room for one more file (evicting unpinned files); False if impossible."""
        if self.disk_bytes < self.file_bytes:
            return False
        if self.disk_used + self.file_bytes <= self.disk_bytes:
            self.disk_used += self.file_bytes
            return True
        candidates = [
            (s.key, s.last_access)
            for s in self.blocks.values()
            if s.on_disk and not s.dropped and s.key not in protect
        ]
        for key in self.policy.order(candidates, allow_pinned=False):
            self._leave_disk(self.blocks[key])
            self.evicted["disk"] += 1
            if self.disk_used + self.file_bytes <= self.disk_bytes:
                self.disk_used += self.file_bytes
                return True
        return False

    def new_block(self, key: str, slot: int, to_disk: bool) -> BlockState:
        """A block being saved into ``slot`` (and to disk when ``to_disk``, space reserved)."""
        state = self.blocks.setdefault(key, BlockState(key))
        state.slot, state.ram_ready, state.dropped = slot, False, False
        if to_disk and not state.on_disk:
            state.on_disk, state.disk_confirmed = True, False
        elif to_disk:
            self.disk_used -= self.file_bytes  # already counted
        state.last_access = time.time()
        self.dirty.add(key)
        return state

    def drop(self, key: str, *, remove_file: bool = True) -> None:
        """Forget a block in every tier (session deleted or expired)."""
        state = self.blocks.get(key)
        if state is None:
            return
        if state.on_disk:
            self.disk_used -= self.file_bytes
            state.on_disk = state.disk_confirmed = False
            if remove_file:
                self.removes.append(key)
        if state.locks > 0 or (state.slot != NO_SLOT and not state.ram_ready):
            state.dropped = True  # a copy is in flight; free the slot when it reports
        else:
            self._leave_ram(state)
        self.dirty.add(key)
        self._forget_if_empty(state)

    # ------------------------------------------------------------- worker events

    def apply(self, report: WorkerReport) -> None:
        """Apply the worker's completions: RAM copies, reads, disk writes and failures, slots
        released. A Redis write only marks the block's location changed: the publisher, not
        the index, tracks what is in Redis and for how long."""
        owners = self.slot_owners() if report.released_slots else {}
        for key in report.saved:
            self.saved(key)
        for key in report.read_ok:
            self.read_ok(key)
        for key in report.written:
            self.written(key)
        for key in report.redis_written:
            self.dirty.add(key)
        for key in report.write_failed:
            self.disk_lost(key)
        for key in report.read_failed:
            self.read_failed(key)
        for slot in report.released_slots:
            self.release(slot, owners)

    def saved(self, key: str) -> None:
        """The RAM copy of a save finished."""
        state = self.blocks.get(key)
        if state is None:
            return
        state.ram_ready = state.slot != NO_SLOT
        self._settle(state)

    def read_ok(self, key: str) -> None:
        """A disk read into the block's slot finished."""
        self.saved(key)

    def written(self, key: str) -> None:
        """The block's file is on disk."""
        state = self.blocks.get(key)
        if state is not None and state.on_disk:
            state.disk_confirmed = True
            self.dirty.add(key)

    def read_failed(self, key: str) -> None:
        """A file was unreadable. When a newer write of the block is queued (its disk copy is
        not confirmed yet: the block was recomputed and saved meanwhile), that write replaces
        the bad file, so the file is kept; otherwise as :meth:`disk_lost`."""
        state = self.blocks.get(key)
        if state is not None and state.on_disk and not state.disk_confirmed:
            if state.slot != NO_SLOT and not state.ram_ready:
                state.dropped = True
            self.dirty.add(key)
            self._settle(state)
            return
        self.disk_lost(key)

    def disk_lost(self, key: str) -> None:
        """A write failed or a file was unreadable: the block is no longer on disk."""
        state = self.blocks.get(key)
        if state is None:
            return
        if state.on_disk:
            state.on_disk = state.disk_confirmed = False
            self.disk_used -= self.file_bytes
            self.removes.append(key)
        if state.slot != NO_SLOT and not state.ram_ready:
            state.dropped = True  # a read into the slot failed: the slot's bytes are garbage
        self.dirty.add(key)
        self._settle(state)

    def release(self, slot: int, owners: dict[int, str]) -> None:
        """A load or read stopped using ``slot``."""
        key = owners.get(slot)
        state = self.blocks.get(key) if key is not None else None
        if state is None or state.slot != slot:
            return
        state.locks = max(0, state.locks - 1)
        self._settle(state)

    def slot_owners(self) -> dict[int, str]:
        """Slot -> key of every assigned slot."""
        return {s.slot: s.key for s in self.blocks.values() if s.slot != NO_SLOT}

    # ----------------------------------------------------------------- helpers

    def _settle(self, state: BlockState) -> None:
        if state.dropped and state.locks == 0:
            self._leave_ram(state)
            state.dropped = False
            if not state.on_disk:
                self.blocks.pop(state.key, None)
        self.dirty.add(state.key)

    def _leave_ram(self, state: BlockState, *, free: bool = True) -> None:
        if state.slot != NO_SLOT and free:
            self.free_slots.append(state.slot)
        state.slot, state.ram_ready = NO_SLOT, False
        self.dirty.add(state.key)
        self._forget_if_empty(state)

    def _leave_disk(self, state: BlockState) -> None:
        state.on_disk = state.disk_confirmed = False
        self.disk_used -= self.file_bytes
        self.removes.append(state.key)
        self.dirty.add(state.key)
        self._forget_if_empty(state)

    def _forget_if_empty(self, state: BlockState) -> None:
        if state.slot == NO_SLOT and not state.on_disk and state.locks == 0:
            self.blocks.pop(state.key, None)
