"""Append-aware storage of list-valued channels (``add_messages``' ``messages`` and the like).

LangGraph gives a saver each new version of a channel as a whole value, so a list that grows by
one message per step would cost O(N^2) bytes over N steps if each version were stored whole.
Here a version of a list channel is stored as *references* to its items instead:

- each item is stored once per thread and namespace in ``checkpoint_items`` (compressed when
  it pays, :mod:`.compress`), keyed by a 16-byte BLAKE2b digest of its own serialized form
  (which is its slice of the whole list's msgpack);
- a version's row in ``checkpoint_blobs`` has type :data:`ITEMS_TYPE` and holds digests: a
  *snapshot* (``base_version`` NULL) lists every item; a *delta* (``base_version`` set) lists
  only the items after those of the version it extends. A delta is written when the new value
  starts with the parent checkpoint's version's items, byte for byte after serde; anything
  else (a removal, an edit, a reorder, ``update_state`` that rewrites) is a snapshot. A chain
  restarts with a snapshot every ``snapshot_every`` versions; in between, every
  ``anchor_every``-th version (an *anchor*, ``isqrt(snapshot_every)``) extends the snapshot and
  the others (*leaves*) extend the last anchor, so a read follows at most two links. A
  snapshot lists digests, not items, so no item is stored twice and the bytes per step stay
  nearly flat;
- reads concatenate the digests along the chain and rebuild the list: items decoded before
  come as copies of the remembered objects (:mod:`.item_objects`: chat messages of plain data,
  equal to a fresh decode and sharing nothing with it), the others are decoded. When every one
  of those was serialized by msgpack (``JsonPlusSerializer``'s default), their bytes joined
  behind a msgpack array header are a msgpack list, decoded in one ``loads_typed`` call, as a
  plain saver decodes its whole list. Writing: the whole new list is serialized once, and
  when its bytes are the header, the base's remembered item bytes and the new items, only the
  new items are digested (:meth:`ListState._serialize`).

Which version a delta extends comes from :class:`ListState`, a per-saver memory of the list
versions of recently written or read checkpoints (a miss costs a snapshot, never a wrong
value), and the items' bytes are remembered by digest (content-addressed, so always valid).
With ``EncryptedSerializer`` the digests are keyed per saver and computed over the plaintext
(the ciphertext is randomised), so appends are still found without storing plaintext hashes.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer

from langgraph_kvcache.checkpoint import compress
from langgraph_kvcache.checkpoint.item_objects import OBJECT_CACHE_BYTES, ItemObjects
from langgraph_kvcache.checkpoint.list_rows import (
    CHAIN_CACHE_ENTRIES,
    DEFAULT_SNAPSHOT_EVERY,
    DIGEST_SIZE,
    ITEM_CACHE_BYTES,
    ITEMS_TYPE,
    PREFIX_CACHE_BYTES,
    ListVersion,
    MissingItems,
    PlannedList,
    StoredBlob,
    _ByteLRU,
    _PrefixLRU,
    in_packed,
    joined_items,
    msgpack_array_header,
    split_digests,
)


class ListState:
    """One saver's memory for append-aware storage: the list versions of recent checkpoints
    and the serialized items by digest. Thread-safe; bounded (see the module constants).

    Args:
        serde: The saver's serializer.
        snapshot_every: Store a full snapshot (of digests) at least every this many versions of
            a chain; ``1`` stores every version as a snapshot. Reads follow at most two links
            whatever the value.
        item_cache_bytes: Bound of the remembered serialized items.
        object_cache_bytes: Bound of the remembered decoded items (chat messages handed out as
            copies, :mod:`.item_objects`), in estimated bytes; ``0`` decodes every read.
        compressed: Store new items (and, through :func:`codec.checkpoint_row`, checkpoint
            bodies) compressed when it pays (:mod:`.compress`).
    """

    def __init__(
        self,
        serde: SerializerProtocol,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        item_cache_bytes: int = ITEM_CACHE_BYTES,
        object_cache_bytes: int = OBJECT_CACHE_BYTES,
        compressed: bool = True,
    ) -> None:
        if not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(
                f"snapshot_every must be a positive int (got {snapshot_every!r}); "
                f"{DEFAULT_SNAPSHOT_EVERY} is the default"
            )
        self.serde = serde
        self.snapshot_every = snapshot_every
        self.compressed = compressed
        self.anchor_every = max(2, math.isqrt(snapshot_every))
        """Every ``anchor_every``-th version of a chain (an anchor) lists all items since the
        snapshot; the others (leaves) those since the last anchor, so reads follow at most two
        links."""
        self.items = _ByteLRU(item_cache_bytes)
        self.objects = ItemObjects(object_cache_bytes)
        """Decoded items by digest, handed out as copies (reads skip most deserializing)."""
        self.prefixes = _PrefixLRU(PREFIX_CACHE_BYTES)
        """The remembered items of recent anchors and snapshots joined (:func:`joined_items`)."""
        encrypted = isinstance(serde, EncryptedSerializer)
        self._digest_serde: SerializerProtocol = serde.serde if encrypted else serde
        self._digest_key = os.urandom(16) if encrypted else b""
        self._encrypted = encrypted
        self._chains: OrderedDict[tuple[str, str, str], dict[str, ListVersion]] = OrderedDict()
        self._written: OrderedDict[tuple[str, str, str], frozenset[bytes]] = OrderedDict()
        """Digests of the items that committed pending writes stored, by the checkpoint they
        were written against (the next checkpoint's list takes them in: no need to send them
        again)."""
        self._lock = threading.Lock()

    # -- what this saver knows about checkpoints ------------------------------------------

    def remember(self, thread_id: str, ns: str, checkpoint_id: str, lists: dict[str, ListVersion]):
        """Record the list versions of a checkpoint just written or read."""
        key = (thread_id, ns, checkpoint_id)
        with self._lock:
            self._chains[key] = lists
            self._chains.move_to_end(key)
            while len(self._chains) > CHAIN_CACHE_ENTRIES:
                self._chains.popitem(last=False)

    def recall(self, thread_id: str, ns: str, checkpoint_id: str | None) -> dict[str, ListVersion]:
        """The list versions recorded for a checkpoint (empty when unknown)."""
        if not checkpoint_id:
            return {}
        with self._lock:
            return self._chains.get((thread_id, ns, checkpoint_id), {})

    def remember_written(
        self, thread_id: str, ns: str, checkpoint_id: str, digests: Iterable[bytes]
    ) -> None:
        """Record the items a pending write against a checkpoint stored (call after commit)."""
        key = (thread_id, ns, checkpoint_id)
        with self._lock:
            self._written[key] = self._written.get(key, frozenset()).union(digests)
            self._written.move_to_end(key)
            while len(self._written) > CHAIN_CACHE_ENTRIES:
                self._written.popitem(last=False)

    def written(self, thread_id: str, ns: str, checkpoint_id: str | None) -> frozenset[bytes]:
        """Digests of the items stored by committed pending writes against a checkpoint."""
        if not checkpoint_id:
            return frozenset()
        with self._lock:
            return self._written.get((thread_id, ns, checkpoint_id), frozenset())

    def forget_threads(self, thread_ids: Iterable[str]) -> None:
        """Drop what is known about ``thread_ids`` (after they lost or may lose checkpoints), so
        no delta is written against a version that was deleted and no item is taken as stored
        that may be gone."""
        gone = set(thread_ids)
        with self._lock:
            for key in [k for k in self._chains if k[0] in gone]:
                del self._chains[key]
            for key in [k for k in self._written if k[0] in gone]:
                del self._written[key]

    # -- writing ----------------------------------------------------------------------------

    def _digest(self, typed: tuple[str, bytes]) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, key=self._digest_key)
        h.update(typed[0].encode())
        h.update(b"\0")
        h.update(typed[1])
        return h.digest()

    def plan(
        self,
        thread_id: str,
        ns: str,
        channel: str,
        version: str,
        value: list[Any],
        base: ListVersion | None,
        stored: frozenset[bytes] = frozenset(),
    ) -> PlannedList:
        """The rows that store ``value`` as ``version`` of ``channel``. ``base`` is the parent
        checkpoint's version of the channel (None: unknown); ``stored``: digests of items known
        to be stored in the thread already (no row is written for them). When ``value`` starts with
        ``base``'s items and the chain is shorter than ``snapshot_every``, a delta: an anchor
        (extending the snapshot) every ``anchor_every`` versions, else a leaf (extending the
        last anchor); otherwise a snapshot."""
        base_packed = base.digests if base is not None else b""
        k = len(base_packed) // DIGEST_SIZE
        parts = None
        if base is not None and k <= len(value) and not self._encrypted:
            parts = joined_items(self.items, self.prefixes, (thread_id, ns, channel), base)
        plain, same = self._serialize(value, parts, k)
        # Only when the whole-list check failed are the base's items compared one by one.
        base_digests = split_digests(base_packed) if same < k else []
        new: list[bytes] = []  # the digests of items ``same`` onwards
        prefix = base is not None and k <= len(plain)
        for i in range(same, len(plain)):
            typed = plain[i]
            if prefix and i < k:
                known = None if self._encrypted else self.items.get(base_digests[i])
                if known == typed:
                    new.append(base_digests[i])
                    continue
                digest = self._digest(typed)
                if digest != base_digests[i]:
                    prefix = False
                new.append(digest)
            else:
                new.append(self._digest(typed))
        packed = base_packed[: same * DIGEST_SIZE] + b"".join(new)
        n = same + len(new)
        count = base.count + 1 if base is not None and prefix else 0
        if count >= self.snapshot_every:
            count = 0
        if count == 0:  # a snapshot
            start, base_version = 0, None
            state = ListVersion(version, packed, 0, (version, n), (version, n))
        elif count % self.anchor_every == 0:  # an anchor: extends the snapshot
            assert base is not None
            start, base_version = base.root[1], base.root[0]
            state = ListVersion(version, packed, count, base.root, (version, n))
        else:  # a leaf: extends the nearest anchor (or the snapshot)
            assert base is not None
            start, base_version = base.anchor[1], base.anchor[0]
            state = ListVersion(version, packed, count, base.root, base.anchor)
        item_rows = []
        seen: set[bytes] = set()
        # Items before ``same`` are the base's, stored with it, as is any item the base has
        # (looked up in its packed digests for a few new items, in a set for many).
        first = max(start, same)
        if n - first > 8:
            in_base = set(base_digests or split_digests(base_packed)).__contains__
        else:
            in_base = functools.partial(in_packed, base_packed)
        for i in range(first, n):
            digest = new[i - same]
            if digest in stored or digest in seen or in_base(digest):
                continue
            seen.add(digest)
            item_rows.append(self._item_row(thread_id, ns, digest, plain[i], value[i]))
        blob_row = {
            "thread_id": thread_id,
            "checkpoint_ns": ns,
            "channel": channel,
            "version": version,
            "type": ITEMS_TYPE,
            "blob": packed[start * DIGEST_SIZE :],
            "base_version": base_version,
            "since_snapshot": count,
        }
        return PlannedList(blob_row, item_rows, state)

    def _serialize(
        self, value: list[Any], base_parts: list[bytes] | None, k: int
    ) -> tuple[list[Any], int]:
        """``value``'s items serialized (plaintext serde), and how many leading ones are known to
        be the base's ``k`` items, byte for byte; those leading entries are None (the base
        stores them, so no row needs their bytes). ``base_parts``: the base's items' bytes
        joined, in parts (:func:`joined_items`), or None when not all remembered.

        An append is recognised with one serialization of the whole list, as a plain saver does:
        when it is the msgpack array header, the base's items' remembered bytes and the new
        items' own serializations, the first items are the base's (msgpack is prefix-free, so
        the boundaries are the same). Otherwise every item is serialized on its own."""
        if k and base_parts is not None and len(value) >= k and not self._encrypted:
            kind, whole = self._digest_serde.dumps_typed(value)
            head = msgpack_array_header(len(value))
            at = len(head)
            same = kind == "msgpack" and whole.startswith(head)
            for part in base_parts if same else ():
                if not whole.startswith(part, at):
                    same = False
                    break
                at += len(part)
            if same:
                new = [self._digest_serde.dumps_typed(item) for item in value[k:]]
                tail = b"".join([t[1] for t in new])
                if all(t[0] == "msgpack" for t in new) and whole[at:] == tail:
                    return [*([None] * k), *new], k
        return [self._digest_serde.dumps_typed(item) for item in value], 0

    def _item_row(
        self, thread_id: str, ns: str, digest: bytes, plain: tuple[str, bytes], value: Any
    ) -> dict[str, Any]:
        """The ``checkpoint_items`` row of one item (encrypted like other values with
        ``EncryptedSerializer``, compressed when it pays: :mod:`.compress`), remembered."""
        typed = self.serde.dumps_typed(value) if self._encrypted else plain
        self.items.put(digest, typed)
        stored_type, data = compress.pack(*typed, compressed=self.compressed)
        return {
            "thread_id": thread_id,
            "checkpoint_ns": ns,
            "item": digest,
            "type": stored_type,
            "blob": data,
        }

    def store_items(
        self, thread_id: str, ns: str, value: list[Any]
    ) -> tuple[bytes, list[dict[str, Any]]]:
        """``value``'s item digests (packed) and the rows of all its items, for a pending write
        stored as references (kept when already stored: the items are content-addressed, so
        the list version that takes them in later shares the rows)."""
        plain, _ = self._serialize(value, None, 0)
        digests = [self._digest(typed) for typed in plain]
        rows = {
            d: self._item_row(thread_id, ns, d, t, v)
            for d, t, v in zip(digests, plain, value, strict=True)
        }
        return b"".join(digests), list(rows.values())

    # -- reading ----------------------------------------------------------------------------

    def chain_digests(
        self,
        thread_id: str,
        ns: str,
        channel: str,
        version: str,
        blobs: Mapping[tuple[str, str, str, str], StoredBlob],
    ) -> ListVersion:
        """Follow ``version``'s chain in ``blobs`` (rows as read) back to its snapshot: at most
        two links (leaf -> anchor -> snapshot)."""
        parts: list[bytes] = []
        versions: list[str] = []
        count = 0
        current: str | None = version
        while current is not None:
            row = blobs.get((thread_id, ns, channel, current))
            if row is None or row[0] != ITEMS_TYPE:
                raise LookupError(
                    f"checkpoint data is missing: version {current!r} of channel {channel!r} "
                    f"(thread {thread_id!r}, namespace {ns!r}) is gone, though a later version "
                    "extends it. Was the thread pruned or deleted by another process while "
                    "this one wrote to it? Delete the thread or fork from an older checkpoint."
                )
            if not versions:
                count = row[3] or 0
            parts.append(row[1] or b"")
            versions.append(current)
            current = row[2]
        sizes = [len(p) // DIGEST_SIZE for p in reversed(parts)]
        totals = [sum(sizes[: i + 1]) for i in range(len(sizes))]  # root first
        digests = b"".join(reversed(parts))
        root = (versions[-1], totals[0])
        if count == 0 or count % self.anchor_every == 0:
            anchor = (version, totals[-1])
        else:
            anchor = (versions[1], totals[-2])
        return ListVersion(version, digests, count, root, anchor)

    def decode(self, digests: bytes, items: Mapping[bytes, tuple[str, bytes]]) -> list[Any]:
        """The list whose items have ``digests``: copies of the items decoded before
        (:class:`ItemObjects`), the others decoded from this saver's memory of their bytes or
        from ``items`` (the msgpack ones in one ``loads_typed`` call, as the whole list's
        bytes would be).

        Raises :class:`MissingItems` when some item is in neither (fetch them and retry).
        """
        split = split_digests(digests)
        out, missing = self.objects.copies(split)
        if not missing:
            return out
        wanted = [split[i] for i in missing]
        remembered = self.items.get
        typed = [remembered(d) or items.get(d) for d in wanted]
        if None in typed:
            raise MissingItems(wanted[typed.index(None)])
        if all(t[0] == "msgpack" for t in typed):  # type: ignore[index]
            # The common case: their bytes behind an array header are one msgpack list.
            data = msgpack_array_header(len(typed)) + b"".join([t[1] for t in typed])  # type: ignore[index]
            decoded = self.serde.loads_typed(("msgpack", data))
        else:
            decoded = [self.serde.loads_typed(t) for t in typed]  # type: ignore[arg-type]
        sizes = [len(t[1]) for t in typed]  # type: ignore[index]
        keep = self.objects.keep
        for i, digest, obj, size in zip(missing, wanted, decoded, sizes, strict=True):
            out[i] = keep(digest, obj, size)
        return out

    def missing(self, digests: Iterable[bytes]) -> list[bytes]:
        """The digests among ``digests`` whose items this saver does not remember."""
        return sorted({d for d in digests if self.items.get(d) is None})
