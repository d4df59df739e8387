"""Turning checkpoints into rows and rows back into checkpoint tuples.

Pure functions of a serializer: no database access. The savers' operations in :mod:`.base`
call these between statements.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from langgraph_kvcache.checkpoint import compress
from langgraph_kvcache.checkpoint.list_rows import (
    ITEMS_TYPE,
    ListVersion,
    StoredBlob,
    is_item_list,
    split_digests,
)
from langgraph_kvcache.checkpoint.lists import ListState
from langgraph_kvcache.checkpoint.queries import KIND_BLOB, KIND_CHECKPOINT

BlobKey = tuple[str, str, str, str]
"""(thread_id, checkpoint_ns, channel, version) of a stored channel value."""


WriteKey = tuple[str, str, str]
"""(thread_id, checkpoint_ns, checkpoint_id) a pending write belongs to."""


def next_version(current: str | int | float | None) -> str:
    """The next channel version: ``"<16-digit counter>.<12 hex digits>"``.

    Like the PostgreSQL saver's (a zero-padded counter and a random tiebreak, so two forks
    that reach the same counter still name different blob rows) but 29 characters, not 51:
    versions are repeated in every checkpoint's ``channel_versions`` and ``versions_seen``
    and in the blobs' keys. Strings compare in counter order, also against the 32-digit
    versions of older rows (whose first 16 digits are zeros, below any new counter)."""
    if current is None:
        current_v = 0
    elif isinstance(current, (int, float)):
        current_v = int(current)
    else:
        current_v = int(current.split(".")[0])
    return f"{current_v + 1:016}.{random.getrandbits(48):012x}"


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


class PutRows:
    """What one ``put`` writes: the checkpoint row, new blob rows, new list items, and the
    list versions to remember for the new checkpoint once written."""

    def __init__(
        self,
        row: dict[str, Any],
        blob_rows: list[dict[str, Any]],
        item_rows: list[dict[str, Any]],
        lists: dict[str, ListVersion],
    ) -> None:
        self.row, self.blob_rows, self.item_rows, self.lists = row, blob_rows, item_rows, lists


class WriteRows:
    """What one ``put_writes`` writes: write rows, the list items they reference, and whether
    the writes replace existing ones (all special channels)."""

    def __init__(
        self, rows: list[dict[str, Any]], item_rows: list[dict[str, Any]], upsert: bool
    ) -> None:
        self.rows, self.item_rows, self.upsert = rows, item_rows, upsert


def checkpoint_row(
    serde: SerializerProtocol,
    config: RunnableConfig,
    checkpoint: Checkpoint,
    metadata: CheckpointMetadata,
    new_versions: ChannelVersions,
    lists: ListState,
) -> PutRows:
    """The rows for one ``put``. New versions of list channels are planned by ``lists``
    (a delta against the parent checkpoint's version when the list was appended to)."""
    configurable = config["configurable"]
    thread_id = str(configurable["thread_id"])
    ns = configurable.get("checkpoint_ns", "")
    inline, blob_values = split_values(checkpoint)
    versions = checkpoint["channel_versions"]
    # The versions of blob-stored channels live only in the ``blob_versions`` column (SQL joins
    # on them); the body keeps the rest. ``make_tuple`` merges them back.
    blob_versions = {ch: versions[ch] for ch in blob_values if ch in versions}
    body = {
        **checkpoint,
        "id": None,  # the checkpoint_id column has it; make_tuple puts it back (same position)
        "channel_values": inline,
        "channel_versions": {ch: v for ch, v in versions.items() if ch not in blob_versions},
    }
    type_, data = compress.pack(*serde.dumps_typed(body), compressed=lists.compressed)
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
        "blob_versions": blob_versions,
    }
    parent_lists = lists.recall(thread_id, ns, configurable.get("checkpoint_id"))
    written = lists.written(thread_id, ns, configurable.get("checkpoint_id"))
    known: dict[str, ListVersion] = {}
    blob_rows: list[dict[str, Any]] = []
    item_rows: list[dict[str, Any]] = []
    for channel, version in new_versions.items():
        if channel not in blob_values:
            continue
        value = blob_values[channel]
        if is_item_list(value):
            planned = lists.plan(
                thread_id, ns, channel, str(version), value, parent_lists.get(channel), written
            )
            blob_rows.append(planned.blob_row)
            item_rows.extend(planned.item_rows)
            known[channel] = planned.state
            continue
        b_type, b_data = serde.dumps_typed(value)
        blob_rows.append(
            {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "channel": channel,
                "version": str(version),
                "type": b_type,
                "blob": b_data,
                "base_version": None,
                "since_snapshot": None,
            }
        )
    for channel, state in parent_lists.items():
        if channel not in known and str(blob_versions.get(channel)) == state.version:
            known[channel] = state
    return PutRows(row, blob_rows, item_rows, known)


def write_rows(
    serde: SerializerProtocol,
    config: RunnableConfig,
    writes: Sequence[tuple[str, Any]],
    task_id: str,
    task_path: str,
    lists: ListState,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``checkpoint_writes`` rows and the ``checkpoint_items`` rows they reference.

    Special channels get their negative ``WRITES_IDX_MAP`` index. A regular write whose value
    is a list (``add_messages``' new messages) is stored as its items' digests (type
    :data:`ITEMS_TYPE`), its items in ``checkpoint_items``, where the list version that takes
    them in shares them."""
    configurable = config["configurable"]
    thread_id = str(configurable["thread_id"])
    ns = configurable.get("checkpoint_ns", "")
    rows = []
    item_rows: dict[bytes, dict[str, Any]] = {}
    for idx, (channel, value) in enumerate(writes):
        if channel not in WRITES_IDX_MAP and is_item_list(value):
            type_ = ITEMS_TYPE
            data, new_items = lists.store_items(thread_id, ns, value)
            item_rows.update((r["item"], r) for r in new_items)
        else:
            type_, data = serde.dumps_typed(value)
        rows.append(
            {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": configurable["checkpoint_id"],
                "task_id": task_id,
                "task_path": task_path,
                "idx": WRITES_IDX_MAP.get(channel, idx),
                "channel": channel,
                "type": type_,
                "blob": data,
            }
        )
    return rows, list(item_rows.values())


class LoadedRows:
    """The rows of ``queries.checkpoint_rows``, sorted by kind, before decoding.

    :meth:`item_digests` names the list items the checkpoints need; the caller fetches those a
    :class:`ListState` lacks and passes them to :meth:`tuples`.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.heads: list[Mapping[str, Any]] = []
        self.blobs: dict[BlobKey, StoredBlob] = {}
        self.pending: dict[WriteKey, list[Mapping[str, Any]]] = {}
        self.scopes: set[tuple[str, str]] = set()
        for row in rows:
            kind = row["kind"]
            if kind == KIND_CHECKPOINT:
                self.heads.append(row)
            elif kind == KIND_BLOB:
                key = (row["thread_id"], row["checkpoint_ns"], row["a"], row["b"])
                self.blobs[key] = (row["type"], row["data"], row["checkpoint_id"], row["idx"])
            else:
                key = (row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"])
                self.pending.setdefault(key, []).append(row)
        self.heads.sort(key=lambda r: r["checkpoint_id"], reverse=True)

    def item_digests(self) -> dict[tuple[str, str], set[bytes]]:
        """Digests of the list items of the rows, per (thread, namespace)."""
        out: dict[tuple[str, str], set[bytes]] = {}
        for (thread_id, ns, _, _), (type_, data, _, _) in self.blobs.items():
            if type_ == ITEMS_TYPE and data:
                found = out.setdefault((thread_id, ns), set())
                found.update(split_digests(data))
        for (thread_id, ns, _), rows in self.pending.items():
            for w in rows:
                if w["type"] == ITEMS_TYPE and w["data"]:
                    found = out.setdefault((thread_id, ns), set())
                    found.update(split_digests(bytes(w["data"])))
        return out

    def tuples(
        self,
        serde: SerializerProtocol,
        lists: ListState,
        items: Mapping[bytes, tuple[str, bytes]],
    ) -> list[CheckpointTuple]:
        """Checkpoint tuples, newest first; ``items`` holds list items fetched for them."""
        return [
            make_tuple(serde, head, self.blobs, self.pending, lists, items) for head in self.heads
        ]


def load_tuples(
    serde: SerializerProtocol, rows: Sequence[Mapping[str, Any]], lists: ListState
) -> list[CheckpointTuple]:
    """Checkpoint tuples from rows whose list items ``lists`` already remembers."""
    return LoadedRows(rows).tuples(serde, lists, {})


def _write_value(
    serde: SerializerProtocol,
    row: Mapping[str, Any],
    lists: ListState,
    items: Mapping[bytes, tuple[str, bytes]],
) -> Any:
    """A pending write's value: serialized, or item digests (:func:`write_rows`)."""
    if row["type"] == ITEMS_TYPE:
        return lists.decode(bytes(row["data"] or b""), items)
    return serde.loads_typed((row["type"], row["data"]))


def make_tuple(
    serde: SerializerProtocol,
    head: Mapping[str, Any],
    blobs: Mapping[BlobKey, StoredBlob],
    pending: Mapping[WriteKey, list[Mapping[str, Any]]],
    lists: ListState,
    items: Mapping[bytes, tuple[str, bytes]],
) -> CheckpointTuple:
    """One ``CheckpointTuple`` from its checkpoint row, the blobs, items and pending writes."""
    thread_id, ns, checkpoint_id = head["thread_id"], head["checkpoint_ns"], head["checkpoint_id"]
    body: Checkpoint = serde.loads_typed(compress.unpack(head["type"], head["data"]))
    body["id"] = checkpoint_id  # stored as None (rows before migration 6 have it anyway)
    values = dict(body["channel_values"])
    blob_versions = json.loads(head["c"])
    known: dict[str, ListVersion] = {}
    for channel, version in blob_versions.items():
        stored = blobs.get((thread_id, ns, channel, str(version)))
        if stored is None or stored[0] == "empty":
            continue
        if stored[0] == ITEMS_TYPE:
            state = lists.chain_digests(thread_id, ns, channel, str(version), blobs)
            values[channel] = lists.decode(state.digests, items)
            known[channel] = state
        else:
            values[channel] = serde.loads_typed((stored[0], stored[1]))
    if known:
        lists.remember(thread_id, ns, checkpoint_id, known)
    writes = sorted(
        pending.get((thread_id, ns, checkpoint_id), ()),
        key=lambda w: writes_sort_key(w["c"], w["b"], w["idx"]),
    )
    parent = head["a"]
    return CheckpointTuple(
        config={
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        },
        checkpoint={
            **body,
            "channel_values": values,
            "channel_versions": {**body["channel_versions"], **blob_versions},
        },
        metadata=json.loads(head["b"]),
        parent_config=(
            {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent}}
            if parent
            else None
        ),
        pending_writes=[(w["b"], w["a"], _write_value(serde, w, lists, items)) for w in writes],
    )
