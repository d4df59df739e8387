"""The saver's hot statements, built once per dialect (and row count) and reused.

Reads: checkpoints with their blobs and pending writes in one round trip.

``checkpoint_rows(dialect, where, limit)`` selects the wanted checkpoints into a CTE ``c`` and
returns one ``UNION ALL`` of three row kinds, told apart by ``kind``:

- ``0``: a checkpoint (``a`` = parent id, ``data`` = serialized body, ``b`` = metadata text,
  ``c`` = ``blob_versions`` text);
- ``1``: a blob one of them references through its ``blob_versions`` (``a`` = channel,
  ``b`` = version), and for list versions stored as deltas (:mod:`.lists`) the (at most two)
  versions down their chain to its snapshot (``checkpoint_id`` = the version it extends,
  ``idx`` = versions since the snapshot); each blob comes once even when many checkpoints
  share it;
- ``2``: a pending write of one of them (``a`` = channel, ``b`` = task id, ``c`` = task path).

SQLite expands ``blob_versions`` with ``json_each``, PostgreSQL with ``jsonb_each_text``. The
statements for ``get_tuple`` (latest and by id) are built once per dialect and reused, so their
cache keys and compiled SQL are computed once.

The write statements are in :mod:`.write_queries`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Integer,
    Select,
    Text,
    bindparam,
    cast,
    func,
    literal_column,
    null,
    select,
    true,
    union_all,
)

from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, items, writes

KIND_CHECKPOINT, KIND_BLOB, KIND_WRITE = 0, 1, 2


CHECKPOINT_COLUMNS = (
    "thread_id",
    "checkpoint_ns",
    "checkpoint_id",
    "parent_checkpoint_id",
    "type",
    "checkpoint",
    "metadata",
    "blob_versions",
)
"""The checkpoint columns the union reads (its ``wanted`` selection must have them)."""


def checkpoint_rows(
    dialect: str,
    where: list[Any],
    limit: Any | None,
    *,
    one: bool = False,
    wanted: Any | None = None,
    channels: list[Any] | None = None,
) -> Select[Any]:
    """The union described in the module docstring for checkpoints matching ``where``.

    ``one``: at most one checkpoint matches, so no two blob references share a chain and the
    chain rows need no ``DISTINCT``. ``wanted``: a selection of :data:`CHECKPOINT_COLUMNS` to
    use instead of ``where`` and ``limit``. ``channels``: only the blobs and writes of these
    channels (SQL expressions, e.g. bind parameters)."""
    ck = checkpoints.c
    if wanted is None:
        wanted = (
            select(*(ck[name] for name in CHECKPOINT_COLUMNS))
            .where(*where)
            .order_by(ck.checkpoint_id.desc())
        )
        if limit is not None:
            wanted = wanted.limit(limit)
    c = wanted.cte("c")
    if dialect == "postgresql":
        each = func.jsonb_each_text(c.c.blob_versions).table_valued("key", "value")
    else:
        each = func.json_each(c.c.blob_versions).table_valued("key", "value")
    refs = (
        select(
            c.c.thread_id,
            c.c.checkpoint_ns,
            each.c.key.label("channel"),
            cast(each.c.value, Text).label("version"),
        )
        .select_from(c)
        .join(each, true())
        .where(*([each.c.key.in_(channels)] if channels is not None else []))
        .distinct()  # also for one checkpoint: SQLite then materializes it, a better plan
        .subquery("r")
    )
    w = writes.c
    chain = _blob_chain(refs, distinct=not one)
    text_null = cast(null(), Text)
    checkpoint_part = select(
        literal_column(str(KIND_CHECKPOINT), Integer).label("kind"),
        c.c.thread_id,
        c.c.checkpoint_ns,
        c.c.checkpoint_id,
        c.c.parent_checkpoint_id.label("a"),
        cast(c.c.metadata, Text).label("b"),
        cast(c.c.blob_versions, Text).label("c"),
        c.c.type,
        c.c.checkpoint.label("data"),
        cast(null(), Integer).label("idx"),
    )
    blob_part = select(
        literal_column(str(KIND_BLOB), Integer),
        chain.c.thread_id,
        chain.c.checkpoint_ns,
        chain.c.base_version,
        chain.c.channel,
        chain.c.version,
        text_null,
        chain.c.type,
        chain.c.blob,
        chain.c.since_snapshot,
    )
    write_part = select(
        literal_column(str(KIND_WRITE), Integer),
        w.thread_id,
        w.checkpoint_ns,
        w.checkpoint_id,
        w.channel,
        w.task_id,
        w.task_path,
        w.type,
        w.blob,
        w.idx,
    ).join_from(
        c,
        writes,
        (w.thread_id == c.c.thread_id)
        & (w.checkpoint_ns == c.c.checkpoint_ns)
        & (w.checkpoint_id == c.c.checkpoint_id),
    )
    if channels is not None:
        write_part = write_part.where(w.channel.in_(channels))
    return union_all(checkpoint_part, blob_part, write_part)  # type: ignore[return-value]


def _blob_chain(refs: Any, *, distinct: bool) -> Any:
    """The blobs ``refs`` (thread, namespace, channel, version) name, and for list versions
    stored as deltas the versions they extend (``base_version``): at most two links, a leaf's
    anchor and the snapshot (:mod:`.lists`). A recursive CTE, so each link is a primary-key
    lookup from the row before it whatever the planner's statistics. ``UNION`` (distinct)
    when many references may share a link, else ``UNION ALL``."""
    b = blobs.c
    columns = (
        b.thread_id,
        b.checkpoint_ns,
        b.channel,
        b.version,
        b.type,
        b.blob,
        b.base_version,
        b.since_snapshot,
    )
    start = select(*columns).join_from(
        refs,
        blobs,
        (b.thread_id == refs.c.thread_id)
        & (b.checkpoint_ns == refs.c.checkpoint_ns)
        & (b.channel == refs.c.channel)
        & (b.version == refs.c.version),
    )
    chain = start.cte("chain", recursive=True)
    step = select(*columns).join_from(
        chain,
        blobs,
        (b.thread_id == chain.c.thread_id)
        & (b.checkpoint_ns == chain.c.checkpoint_ns)
        & (b.channel == chain.c.channel)
        & (b.version == chain.c.base_version),
    )
    return chain.union(step) if distinct else chain.union_all(step)


@cache
def get_latest(dialect: str) -> Select[Any]:
    """Latest checkpoint of (``:thread_id``, ``:checkpoint_ns``)."""
    ck = checkpoints.c
    where = [ck.thread_id == bindparam("thread_id"), ck.checkpoint_ns == bindparam("checkpoint_ns")]
    return checkpoint_rows(dialect, where, 1, one=True)


@cache
def get_by_id(dialect: str) -> Select[Any]:
    """Checkpoint ``:checkpoint_id`` of (``:thread_id``, ``:checkpoint_ns``)."""
    ck = checkpoints.c
    where = [
        ck.thread_id == bindparam("thread_id"),
        ck.checkpoint_ns == bindparam("checkpoint_ns"),
        ck.checkpoint_id == bindparam("checkpoint_id"),
    ]
    return checkpoint_rows(dialect, where, None, one=True)


ITEM_BATCHES = (1, 4, 16, 64, 256)
"""Sizes of the prebuilt :func:`select_items` statements (a request is padded up to one)."""


@cache
def select_items(n: int) -> Any:
    """Items ``:item0`` ... ``:item<n-1>`` of (``:thread_id``, ``:checkpoint_ns``)."""
    i = items.c
    return select(i.item, i.type, i.blob).where(
        i.thread_id == bindparam("thread_id"),
        i.checkpoint_ns == bindparam("checkpoint_ns"),
        i.item.in_([bindparam(f"item{k}") for k in range(n)]),
    )


@cache
def select_thread_items() -> Any:
    """Every list item of (``:thread_id``, ``:checkpoint_ns``)."""
    i = items.c
    return select(i.item, i.type, i.blob).where(
        i.thread_id == bindparam("thread_id"), i.checkpoint_ns == bindparam("checkpoint_ns")
    )


def item_batches(digests: list[bytes]) -> list[tuple[Any, dict[str, Any]]]:
    """(statement, digest parameters) pairs that fetch ``digests``, padded to prebuilt sizes."""
    out = []
    largest = ITEM_BATCHES[-1]
    for start in range(0, len(digests), largest):
        chunk = digests[start : start + largest]
        size = next(n for n in ITEM_BATCHES if n >= len(chunk))
        padded = chunk + [chunk[0]] * (size - len(chunk))
        out.append((select_items(size), {f"item{k}": d for k, d in enumerate(padded)}))
    return out
