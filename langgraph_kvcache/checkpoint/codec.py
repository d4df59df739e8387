"""Turning checkpoints into rows and rows back into checkpoint tuples.

Pure functions of a serializer: no database access. The savers' operations in :mod:`.base`
call these between statements.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    PendingWrite,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import _DeltaSnapshot

BlobKey = tuple[str, str, str, str]
"""(thread_id, checkpoint_ns, channel, version) of a stored channel value."""

WriteKey = tuple[str, str, str]
"""(thread_id, checkpoint_ns, checkpoint_id) a pending write belongs to."""


def next_version(current: str | int | float | None) -> str:
    """The PostgreSQL saver's version scheme: zero-padded counter plus a random tiebreak."""
    if current is None:
        current_v = 0
    elif isinstance(current, (int, float)):
        current_v = int(current)
    else:
        current_v = int(current.split(".")[0])
    return f"{current_v + 1:032}.{random.random():016}"


def split_values(checkpoint: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split channel values into (inline, blob) ones, as the PostgreSQL saver does.

    Scalars stay in the checkpoint body; everything else goes to the blobs table. A
    ``_DeltaSnapshot`` goes to the blobs table with an inline ``True`` marker.
    """
    inline: dict[str, Any] = {}
    blob_values: dict[str, Any] = {}
    for key, value in checkpoint["channel_values"].items():
        if isinstance(value, _DeltaSnapshot):
            blob_values[key] = value
            inline[key] = True
        elif value is None or isinstance(value, (str, int, float, bool)):
            inline[key] = value
        else:
            blob_values[key] = value
    return inline, blob_values


def checkpoint_row(
    serde: SerializerProtocol,
    config: RunnableConfig,
    checkpoint: Checkpoint,
    metadata: CheckpointMetadata,
    new_versions: ChannelVersions,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``checkpoints`` row and the new ``checkpoint_blobs`` rows for one ``put``."""
    configurable = config["configurable"]
    thread_id = str(configurable["thread_id"])
    ns = configurable.get("checkpoint_ns", "")
    inline, blob_values = split_values(checkpoint)
    body = {**checkpoint, "channel_values": inline}
    type_, data = serde.dumps_typed(body)
    run_id = metadata.get("run_id")
    row = {
        "thread_id": thread_id,
        "checkpoint_ns": ns,
        "checkpoint_id": checkpoint["id"],
        "parent_checkpoint_id": configurable.get("checkpoint_id"),
        "run_id": None if run_id is None else str(run_id),
        "type": type_,
        "checkpoint": data,
        "metadata": metadata,
    }
    blob_rows = []
    for channel, version in new_versions.items():
        if channel in blob_values:
            b_type, b_data = serde.dumps_typed(blob_values[channel])
            blob_rows.append(
                {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "channel": channel,
                    "version": str(version),
                    "type": b_type,
                    "blob": b_data,
                }
            )
    return row, blob_rows


def write_rows(
    serde: SerializerProtocol,
    config: RunnableConfig,
    writes: Sequence[tuple[str, Any]],
    task_id: str,
    task_path: str,
) -> list[dict[str, Any]]:
    """``checkpoint_writes`` rows; special channels get their negative ``WRITES_IDX_MAP`` index."""
    configurable = config["configurable"]
    rows = []
    for idx, (channel, value) in enumerate(writes):
        type_, data = serde.dumps_typed(value)
        rows.append(
            {
                "thread_id": str(configurable["thread_id"]),
                "checkpoint_ns": configurable.get("checkpoint_ns", ""),
                "checkpoint_id": configurable["checkpoint_id"],
                "task_id": task_id,
                "task_path": task_path,
                "idx": WRITES_IDX_MAP.get(channel, idx),
                "channel": channel,
                "type": type_,
                "blob": data,
            }
        )
    return rows


def load_body(serde: SerializerProtocol, type_: str, data: bytes) -> Checkpoint:
    """Decode a checkpoint body (inline values only)."""
    return serde.loads_typed((type_, data))


def blob_keys(thread_id: str, ns: str, body: Checkpoint) -> Iterable[BlobKey]:
    """The blob rows a decoded body needs: every versioned channel not held inline.

    A ``True`` inline value may be a ``_DeltaSnapshot`` marker, so it is looked up too; a
    blob, when present, wins over the inline value.
    """
    inline = body["channel_values"]
    for channel, version in body["channel_versions"].items():
        if channel not in inline or inline[channel] is True:
            yield (thread_id, ns, channel, str(version))


def make_tuple(
    serde: SerializerProtocol,
    row: Mapping[str, Any],
    body: Checkpoint,
    blobs: Mapping[BlobKey, tuple[str, bytes | None]],
    writes: Sequence[Mapping[str, Any]],
) -> CheckpointTuple:
    """Assemble a ``CheckpointTuple`` from its row, decoded body, blobs and pending writes."""
    thread_id, ns = row["thread_id"], row["checkpoint_ns"]
    values = dict(body["channel_values"])
    for key in blob_keys(thread_id, ns, body):
        found = blobs.get(key)
        if found is not None and found[0] != "empty":
            values[key[2]] = serde.loads_typed(found)
    ordered = sorted(writes, key=lambda w: writes_sort_key(w["task_path"], w["task_id"], w["idx"]))
    pending: list[PendingWrite] = [
        (w["task_id"], w["channel"], serde.loads_typed((w["type"], w["blob"]))) for w in ordered
    ]
    parent = row["parent_checkpoint_id"]
    return CheckpointTuple(
        config={
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": row["checkpoint_id"],
            }
        },
        checkpoint={**body, "channel_values": values},
        metadata=row["metadata"],
        parent_config=(
            {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent}}
            if parent
            else None
        ),
        pending_writes=pending,
    )
