"""The stored shapes of list channels (:mod:`.lists`): item digests, what a saver knows about a
stored list version, the rows one ``put`` writes for a list, and the bounded memory of
serialized items by digest. No database access and no serializer."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

ITEMS_TYPE = "lgkv.items"
"""``checkpoint_blobs.type`` of a list version stored as item digests."""

DIGEST_SIZE = 16
"""Bytes per item digest."""

StoredBlob = tuple[str, bytes | None, str | None, int | None]
"""A ``checkpoint_blobs`` row as read: (type, bytes, base version, versions since snapshot)."""

DEFAULT_SNAPSHOT_EVERY = 100
"""Default ``snapshot_every``: a chain of list versions restarts with a snapshot every 100
versions (anchors every 10)."""

ITEM_CACHE_BYTES = 64 * 2**20
"""Default bound of the serialized item bytes a saver remembers (by digest)."""

CHAIN_CACHE_ENTRIES = 2048
"""Checkpoints whose list versions a saver remembers (to write deltas against them)."""


class MissingItems(LookupError):
    """Some list items were neither remembered nor fetched (the reader fetches and retries)."""

    def __init__(self, digest: bytes) -> None:
        super().__init__(
            f"checkpoint data is missing: list item {digest.hex()} is not stored. Was the "
            "thread pruned by another process while this one wrote to it?"
        )


@dataclass(frozen=True)
class ListVersion:
    """What a saver knows about one stored version of a list channel."""

    version: str
    digests: bytes
    """The digests of every item of the value, in order (``DIGEST_SIZE`` bytes each)."""
    count: int
    """Versions since its chain's snapshot (0: a snapshot)."""
    root: tuple[str, int]
    """(version, item count) of its chain's snapshot (itself for a snapshot)."""
    anchor: tuple[str, int]
    """(version, item count) that a leaf appended after this version extends: itself for a
    snapshot or an anchor, its own base for a leaf."""


@dataclass(frozen=True)
class PlannedList:
    """The rows one ``put`` writes for one list channel."""

    blob_row: dict[str, Any]
    item_rows: list[dict[str, Any]]
    state: ListVersion


def msgpack_array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` elements."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 2**16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def split_digests(data: bytes) -> list[bytes]:
    """The digests packed in a :data:`ITEMS_TYPE` row."""
    return [data[i : i + DIGEST_SIZE] for i in range(0, len(data), DIGEST_SIZE)]


def is_item_list(value: Any) -> bool:
    """Whether ``value`` is stored as items: exactly a ``list`` (not a subclass, not a tuple)."""
    return type(value) is list


class _ByteLRU:
    """A thread-safe map of digest -> (serde type, bytes), bounded by total bytes (the oldest
    entries go first), with the msgpack items' bytes also by digest alone, so a whole msgpack
    list is joined in one C-level pass (:meth:`msgpack_bytes`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, tuple[str, bytes]] = OrderedDict()
        self._msgpack: dict[bytes, bytes] = {}
        self._size = 0
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> tuple[str, bytes] | None:
        # No reordering on reads (a dict read is atomic): eviction is first in, first out.
        return self._data.get(digest)

    def msgpack_bytes(self, digests: list[bytes]) -> bytes | None:
        """The bytes of ``digests``' items joined, when every one is a remembered msgpack item;
        else None."""
        try:
            return b"".join(map(self._msgpack.__getitem__, digests))
        except KeyError:
            return None

    def put(self, digest: bytes, item: tuple[str, bytes]) -> None:
        size = len(item[1]) + 64
        if size > self.max_bytes:
            return
        with self._lock:
            if digest in self._data:
                return
            self._data[digest] = item
            if item[0] == "msgpack":
                self._msgpack[digest] = item[1]
            self._size += size
            while self._size > self.max_bytes:
                gone, old = self._data.popitem(last=False)
                self._msgpack.pop(gone, None)
                self._size -= len(old[1]) + 64
