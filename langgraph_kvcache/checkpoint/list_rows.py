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

PREFIX_CACHE_BYTES = 32 * 2**20
"""Default bound of the joined item bytes of list prefixes a saver remembers
(:class:`_PrefixLRU`)."""

MIN_PREFIX_ITEMS = 16
"""Prefixes of fewer items are joined on every use, not remembered."""

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


def in_packed(packed: bytes, digest: bytes) -> bool:
    """Whether ``digest`` is one of the digests packed in ``packed`` (at a digest boundary)."""
    at = packed.find(digest)
    while at >= 0:
        if at % DIGEST_SIZE == 0:
            return True
        at = packed.find(digest, at + 1)
    return False


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


class _PrefixLRU:
    """The items of list versions' leading parts (their anchor's or snapshot's items) joined,
    so a read or an append of a version joins only the items after that part.

    An entry is the packed digests it was built from and the msgpack bytes of those items
    joined (no array header), under (thread, namespace, channel, version). :meth:`get` returns
    it only when its digests are a prefix of the digests asked for, so an entry never stands
    for other items (item bytes are content-addressed, so an entry never goes stale).
    Thread-safe; least recently used entries go first past ``max_bytes``.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[tuple[str, str, str, str], tuple[bytes, bytes]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, str, str], digests: bytes) -> tuple[int, bytes] | None:
        """(bytes of ``digests`` covered, joined item bytes) of the entry ``key`` when its digests
        start ``digests``; else None."""
        entry = self._data.get(key)
        if entry is None or not digests.startswith(entry[0]):
            return None
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
        return len(entry[0]), entry[1]

    def put(self, key: tuple[str, str, str, str], digests: bytes, joined: bytes) -> None:
        size = len(digests) + len(joined) + 64
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= len(old[0]) + len(old[1]) + 64
            self._data[key] = (digests, joined)
            self._size += size
            while self._size > self.max_bytes:
                _, (d, j) = self._data.popitem(last=False)
                self._size -= len(d) + len(j) + 64


def joined_items(
    items: _ByteLRU, prefixes: _PrefixLRU, scope: tuple[str, str, str], state: ListVersion
) -> list[bytes] | None:
    """The msgpack bytes of the items of list version ``state`` of ``scope`` (thread,
    namespace, channel), in parts whose concatenation is those bytes joined (no array
    header); None when some item is not remembered as msgpack in ``items``.

    The items of its anchor (or snapshot) come joined from ``prefixes``; on a miss they are
    joined (behind the snapshot's remembered join, when there is one) and remembered, so
    checking that a new value extends a version joins only the items after its anchor (a leaf
    is fewer than ``anchor_every`` versions past it)."""
    digests = state.digests
    anchor, n = state.anchor
    hit = prefixes.get((*scope, anchor), digests)
    if hit is None:
        root = prefixes.get((*scope, state.root[0]), digests) if state.root[0] != anchor else None
        end = n * DIGEST_SIZE
        if root is not None and root[0] > end:
            root = None
        if n >= MIN_PREFIX_ITEMS and end <= len(digests):
            lead, parts = (root[0], [root[1]]) if root is not None else (0, [])
            more = items.msgpack_bytes(split_digests(digests[lead:end]))
            if more is None:
                return None
            joined = b"".join([*parts, more])
            prefixes.put((*scope, anchor), digests[:end], joined)
            hit = (end, joined)
        else:
            hit = root
    start, parts = (hit[0], [hit[1]]) if hit is not None else (0, [])
    if start < len(digests):
        tail = items.msgpack_bytes(split_digests(digests[start:]))
        if tail is None:
            return None
        parts.append(tail)
    return parts
