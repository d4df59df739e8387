"""``get_delta_channel_history`` (LangGraph's ``DeltaChannel``) in one statement per call.

The contract is the base class's parent-chain walk: for each requested channel, the pending
writes of the target's ancestors (nearest first, each checkpoint's writes in ``get_tuple``
order), up to the nearest ancestor that stores a value for the channel (its ``seed``).
Instead of one ``get_tuple`` per ancestor, one recursive query walks ``parent_checkpoint_id``
from the target and stops after the first ancestor whose ``blob_versions`` holds every
requested channel (a snapshot of them all; an inline value can stop a channel earlier, which
the Python walk below sees). It returns those ancestors in the union shape of
``queries.checkpoint_rows`` restricted to the requested channels' blobs and writes, so the
same decoding (and list-item fetching) serves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import DeltaChannelHistory, PendingWrite, get_checkpoint_id
from sqlalchemy import Integer, Text, and_, bindparam, case, func, literal, select

from langgraph_kvcache.checkpoint import queries
from langgraph_kvcache.checkpoint.schema import checkpoints

if TYPE_CHECKING:
    from langgraph_kvcache.checkpoint.base import BaseSQLAlchemySaver, Op

MAX_DEPTH = 1_000_000
"""Guard against a parent cycle in damaged data: the walk stops this deep."""


@cache
def ancestors_query(dialect: str, n_channels: int) -> Any:
    """The rows of (``:thread_id``, ``:checkpoint_ns``, ``:checkpoint_id``; the latest when
    NULL) and its ancestors
    back to the first one that stores channels ``:ch0`` .. ``:ch<n-1>``, with those channels'
    blobs and writes."""
    channels = [bindparam(f"ch{i}") for i in range(n_channels)]
    ck = checkpoints.c
    columns = queries.CHECKPOINT_COLUMNS
    newest = checkpoints.alias("newest")
    latest = (
        select(func.max(newest.c.checkpoint_id))
        .where(
            newest.c.thread_id == bindparam("thread_id"),
            newest.c.checkpoint_ns == bindparam("checkpoint_ns"),
        )
        .scalar_subquery()
    )
    start = select(
        *(ck[name] for name in columns),
        literal(0, Integer).label("done"),
        literal(0, Integer).label("depth"),
    ).where(
        ck.thread_id == bindparam("thread_id"),
        ck.checkpoint_ns == bindparam("checkpoint_ns"),
        ck.checkpoint_id == func.coalesce(bindparam("checkpoint_id", type_=Text), latest),
    )
    anc = start.cte("anc", recursive=True)
    parent = checkpoints.alias("p")
    if dialect == "postgresql":
        keys = func.jsonb_each_text(parent.c.blob_versions).table_valued("key")
    else:
        keys = func.json_each(parent.c.blob_versions).table_valued("key")
    stored = (
        select(func.count()).select_from(keys).where(keys.c.key.in_(channels)).scalar_subquery()
    )
    step = (
        select(
            *(parent.c[name] for name in columns),
            case((stored == n_channels, 1), else_=0),
            anc.c.depth + 1,
        )
        .select_from(anc)
        .join(
            parent,
            and_(
                parent.c.thread_id == anc.c.thread_id,
                parent.c.checkpoint_ns == anc.c.checkpoint_ns,
                parent.c.checkpoint_id == anc.c.parent_checkpoint_id,
            ),
        )
        .where(anc.c.done == 0, anc.c.depth < MAX_DEPTH)
    )
    anc = anc.union_all(step)
    wanted = select(*(anc.c[name] for name in columns))
    return queries.checkpoint_rows(dialect, [], None, wanted=wanted, channels=channels)


def op_delta_history(
    saver: BaseSQLAlchemySaver, config: RunnableConfig, channels: Sequence[str]
) -> Op[dict[str, DeltaChannelHistory]]:
    """The base class's ``get_delta_channel_history`` result, from one query (plus list-item
    fetches when a seed is a list whose items the saver does not remember). Without a
    ``checkpoint_id`` the target is the latest checkpoint: the one no other row names as its
    parent."""
    from langgraph_kvcache.checkpoint.base import Stmt

    if not channels:
        return {}
    names = list(dict.fromkeys(channels))
    collected: dict[str, list[PendingWrite]] = {ch: [] for ch in names}
    seeds: dict[str, Any] = {}
    checkpoint_id = get_checkpoint_id(config)
    configurable = config["configurable"]
    params: dict[str, Any] = {
        "thread_id": str(configurable["thread_id"]),
        "checkpoint_ns": configurable.get("checkpoint_ns", ""),
        "checkpoint_id": checkpoint_id,
        **{f"ch{i}": ch for i, ch in enumerate(names)},
    }
    rows = yield Stmt(ancestors_query(saver.dialect, len(names)), params, fetch=True, plain=True)
    tuples = yield from saver._op_load(rows)
    by_id = {t.config["configurable"]["checkpoint_id"]: t for t in tuples}
    remaining = set(names)
    parents = {t.parent_config["configurable"]["checkpoint_id"] for t in tuples if t.parent_config}
    heads = [t for t in tuples if t.config["configurable"]["checkpoint_id"] not in parents]
    target = by_id.get(checkpoint_id) if checkpoint_id else (heads[0] if heads else None)
    cursor = target.parent_config if target else None
    while cursor is not None and remaining:
        found = by_id.get(cursor["configurable"]["checkpoint_id"])
        if found is None:
            break
        for write in reversed(found.pending_writes or []):
            if write[1] in remaining:
                collected[write[1]].append(write)
        for ch in list(remaining):
            if ch in found.checkpoint["channel_values"]:
                seeds[ch] = found.checkpoint["channel_values"][ch]
                remaining.discard(ch)
        cursor = found.parent_config
    result: dict[str, DeltaChannelHistory] = {}
    for ch in channels:
        entry: DeltaChannelHistory = {"writes": list(reversed(collected[ch]))}
        if ch in seeds:
            entry["seed"] = seeds[ch]
        result[ch] = entry
    return result
