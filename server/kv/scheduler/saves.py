"""A step's saves: the blocks it completed, each given a RAM slot, disk room and its token ids.

Scheduler side (no torch, never blocks): slots come from :meth:`BlockIndex.alloc_slots` (the
policy's victims leave RAM when none is free), disk room from :meth:`BlockIndex.reserve_disk`.
A block written to disk carries the key of the block it continues and its token ids, which
its file's header page keeps, so that after a restart the scheduler side knows the tokens of
the blocks it finds on disk (:class:`~server.kv.scheduler.warm_up.FileScan`): reuse up to a
token inside a block and shifted reuse then work on them as before the restart.
"""

from __future__ import annotations

import logging

from server.kv.groups import BlockRef
from server.kv.metadata import SaveItem
from server.kv.scheduler.continuations import Continuations
from server.kv.scheduler.index import BlockIndex

log = logging.getLogger(__name__)


def plan_saves(
    index: BlockIndex,
    wanted: list[tuple[BlockRef, str]],
    continuations: Continuations,
    *,
    policy_ready: bool,
    to_redis: bool,
) -> list[SaveItem]:
    """Saves of the ``(paged block, key)`` pairs in ``wanted``, as many as RAM slots allow;
    ``policy_ready``: the eviction policy knows the registry's pins (before that, the disk tier
    takes only free room)."""
    keys = {k for _, k in wanted}
    slots = index.alloc_slots(len(wanted), protect=keys)
    saves: list[SaveItem] = []
    for (block_id, key), slot in zip(wanted, slots, strict=False):
        room = index.disk_used + index.file_bytes <= index.disk_bytes
        to_disk = (room or policy_ready) and index.reserve_disk(protect=keys)
        index.new_block(key, slot, to_disk)
        stored = continuations.stored(key) if to_disk else None
        parent, tokens = stored or ("", b"")
        saves.append(SaveItem(block_id, key, slot, to_disk, to_redis, parent, tokens))
    if len(slots) < len(wanted):
        log.warning("RAM tier full of locked blocks: %d blocks not saved", len(wanted) - len(slots))
    return saves
