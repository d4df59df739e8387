"""Freeing what no checkpoint reads any more, after checkpoints were deleted.

A checkpoint reads the blob rows its ``blob_versions`` names; a list version stored as a delta
(:mod:`.lists`) also reads every version down its chain (``base_version``) to a snapshot; and
list versions, and pending writes stored as item references, read their items.
:func:`op_collect` keeps exactly that closure for one thread and namespace and deletes every
other blob row and item, so a kept checkpoint never loses a version it extends. Operations
are generators of :class:`~.base.Stmt` like the savers'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import delete, select, tuple_

from langgraph_kvcache.checkpoint.list_rows import ITEMS_TYPE, split_digests
from langgraph_kvcache.checkpoint.ops import Op, Stmt
from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, items, writes

CHUNK = 500
"""Most keys per ``IN`` list, well under SQLite's bound-parameter limit."""


def chunks(values: Sequence[Any], size: int = CHUNK) -> Iterable[Sequence[Any]]:
    """``values`` in slices of at most ``size``."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


def reachable(
    roots: Iterable[tuple[str, str]], bases: dict[tuple[str, str], str | None]
) -> set[tuple[str, str]]:
    """The (channel, version) pairs ``roots`` read: themselves and their chains in ``bases``
    (each stored pair -> the version it extends, or None)."""
    keep: set[tuple[str, str]] = set()
    for channel, version in roots:
        current: str | None = version
        while current is not None and (channel, current) not in keep:
            keep.add((channel, current))
            current = bases.get((channel, current))
    return keep


def op_collect(thread_id: str, ns: str) -> Op[None]:
    """Delete the blob rows and list items of (``thread_id``, ``ns``) that no checkpoint left
    there reads."""
    c, b, i = checkpoints.c, blobs.c, items.c
    scope_b = (b.thread_id == thread_id, b.checkpoint_ns == ns)
    kept = yield Stmt(
        select(c.blob_versions).where(c.thread_id == thread_id, c.checkpoint_ns == ns),
        fetch=True,
    )
    roots = {(ch, str(v)) for r in kept for ch, v in r["blob_versions"].items()}
    stored = yield Stmt(select(b.channel, b.version, b.base_version).where(*scope_b), fetch=True)
    bases = {(r["channel"], r["version"]): r["base_version"] for r in stored}
    keep = reachable(roots, bases)
    garbage = sorted(set(bases) - keep)
    for chunk in chunks(garbage):
        yield Stmt(delete(blobs).where(*scope_b, tuple_(b.channel, b.version).in_(chunk)))
    lists = yield Stmt(select(b.blob).where(*scope_b, b.type == ITEMS_TYPE), fetch=True)
    w = writes.c
    referencing = yield Stmt(
        select(w.blob).where(w.thread_id == thread_id, w.checkpoint_ns == ns, w.type == ITEMS_TYPE),
        fetch=True,
    )
    used = {d for r in [*lists, *referencing] for d in split_digests(bytes(r["blob"] or b""))}
    scope_i = (i.thread_id == thread_id, i.checkpoint_ns == ns)
    present = yield Stmt(select(i.item).where(*scope_i), fetch=True)
    unused = sorted({bytes(r["item"]) for r in present} - used)
    for chunk in chunks(unused):
        yield Stmt(delete(items).where(*scope_i, i.item.in_(chunk)))
