"""Start-up checks and full-disk handling of the tiers, scheduler side (no torch, no blocking).

Every recovery logs one warning that names the file or folder and what was done:

- :func:`check_budgets`: a RAM or disk budget too small for one block holds nothing; say so
  at start (naming the flag and the block size) and turn that tier off.
- :func:`forget_unregistered_files`: the session registry vanished (deleted, or a new cache
  folder beside old block files) while block files remain; no session can reach or delete
  them any more, so they are deleted and the registry and the files agree.
- a start that serves at once (the files found and the snapshot taken while the engine
  serves) is :mod:`server.kv.scheduler.warm_up`'s.
- :class:`DiskSpace`: a write failed and the file system is full; the tier's budget shrinks to
  what the file system holds (new blocks replace the oldest instead of failing one by one),
  one warning per episode, and grows back towards the configured budget when room returns.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from server.kv.scheduler.index import BlockIndex
from server.kv.tiers.disk import DiskStore

log = logging.getLogger(__name__)


def check_budgets(
    ram_bytes: int, disk_bytes: int, block_bytes: int, file_bytes: int, *, warn: bool = True
) -> bool:
    """True if the disk tier can be used; with ``warn``, say why a budget holds nothing.

    Saves go through the RAM pool, so a RAM budget below one block turns every tier off.
    """
    say = log.warning if warn else log.debug
    if 0 < ram_bytes < block_bytes:
        say(
            "--kv-ram-bytes %d cannot hold one KV block (%d bytes for this model and dtype): "
            "nothing is saved in any tier; give at least %d bytes",
            ram_bytes,
            block_bytes,
            block_bytes,
        )
        return False
    if 0 < disk_bytes < file_bytes:
        say(
            "--kv-disk-bytes %d cannot hold one block file (%d bytes for this model and "
            "dtype): the disk tier is off; give at least %d bytes, or 0 to silence this",
            disk_bytes,
            file_bytes,
            file_bytes,
        )
        return False
    return disk_bytes > 0 and ram_bytes > 0


def forget_unregistered_files(
    store: DiskStore, files: dict[str, int], registry_path: Path
) -> dict[str, int]:
    """Delete ``files`` when the registry file does not exist yet; return the files kept."""
    if not files or registry_path.exists():
        return files
    for key in files:
        store.remove(key)
    warn_unregistered(registry_path, len(files), store.root)
    return {}


def warn_unregistered(registry_path: Path, count: int, root: Path) -> None:
    """The one warning for block files deleted because the session registry vanished."""
    log.warning(
        "session registry %s is missing (deleted?): an empty one is created, and the %d block "
        "files under %s that no session can reach or delete any more were deleted",
        registry_path,
        count,
        root,
    )


def free_bytes(path: Path) -> int:
    """Bytes free for an unprivileged writer on the file system of ``path``."""
    return shutil.disk_usage(path).free


class DiskSpace:
    """The disk tier's idea of its room, kept in step with the file system.

    ``on_write_failed`` (after a report with failed writes) and ``maybe_regrow`` (every
    report; rate-limited to one ``statvfs`` per ``retry_s``) change ``index.disk_bytes``
    only; the index evicts down to the new budget as it plans the next writes.
    """

    def __init__(
        self,
        root: Path,
        budget: int,
        file_bytes: int,
        *,
        retry_s: float = 30.0,
        free: Callable[[Path], int] = free_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.budget = budget
        self.file_bytes = file_bytes
        self.retry_s = retry_s
        self._free = free
        self._clock = clock
        self._next_check = 0.0
        self.full = False
        """True from a full-disk failure until the budget is back to what was configured."""

    def _room(self, index: BlockIndex, free: int) -> int:
        """Bytes of block files the file system can hold now (whole files, one kept spare)."""
        written = self.file_bytes * index.confirmed_files
        room = written + max(0, free - self.file_bytes)
        return min(self.budget, room // self.file_bytes * self.file_bytes)

    def fit_at_start(self, index: BlockIndex) -> None:
        """Cap the budget at what the file system can hold (warns when it must)."""
        self._shrink(index, reason="the file system cannot hold the budget")

    def on_write_failed(self, index: BlockIndex) -> None:
        """A write failed: if the file system is full, lower the budget to what it holds."""
        self._shrink(index, reason="file system full, a write failed")

    def maybe_regrow(self, index: BlockIndex) -> None:
        """After a full disk, raise the budget again as room returns (rate-limited)."""
        if not self.full or self._clock() < self._next_check:
            return
        self._next_check = self._clock() + self.retry_s
        try:
            room = self._room(index, self._free(self.root))
        except OSError:
            return
        if room > index.disk_bytes:
            index.disk_bytes = room
            self.full = room < self.budget
            log.info("disk tier %s has room again: budget %d of %d bytes", self.root, room,
                     self.budget)  # fmt: skip

    def _shrink(self, index: BlockIndex, *, reason: str) -> None:
        try:
            free = self._free(self.root)
        except OSError:
            return
        room = self._room(index, free)
        self._next_check = self._clock() + self.retry_s
        if room >= index.disk_bytes:
            return  # not a full file system (an I/O error: the worker logged it)
        log.warning(
            "disk tier %s: %s (%d bytes free): budget lowered from %d to %d bytes (%d block "
            "files); new blocks replace the oldest, the budget grows back as room returns",
            self.root,
            reason,
            free,
            index.disk_bytes,
            room,
            room // self.file_bytes,
        )
        index.disk_bytes = room
        self.full = True
