"""Storage semantics on SQLite and PostgreSQL: blobs stored once, garbage collection, write
upserts, write order, metadata filters, encryption, and the lifecycle hooks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
from langgraph.checkpoint.base import ERROR, INTERRUPT, CheckpointTuple, empty_checkpoint
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from sqlalchemy import func, select

from langgraph_kvcache.checkpoint.lists import ListState
from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, items, writes
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver
from langgraph_kvcache.errors import KVCacheError, ThreadNotEmptyError

STATIC = {"doc": "a long retrieved document " * 50}


def _put_chain(
    saver: SQLAlchemySaver, thread_id: str, n: int, *, ns: str = "", run_id: str | None = None
) -> list[dict[str, Any]]:
    """``n`` checkpoints: ``messages`` changes every step, ``static`` only in the first."""
    configs: list[dict[str, Any]] = []
    versions: dict[str, Any] = {}
    parent: dict[str, Any] = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}}
    for step in range(n):
        checkpoint = empty_checkpoint()
        new_versions = {"messages": saver.get_next_version(versions.get("messages"), None)}
        if step == 0:
            new_versions["static"] = saver.get_next_version(None, None)
        versions.update(new_versions)
        checkpoint["channel_versions"] = dict(versions)
        checkpoint["channel_values"] = {
            "messages": [f"m{i}" for i in range(step + 1)],
            "static": STATIC,
            "step": step,
        }
        metadata: dict[str, Any] = {"source": "loop", "step": step, "parents": {}}
        if run_id:
            metadata["run_id"] = run_id
        parent = saver.put(parent, checkpoint, metadata, new_versions)
        configs.append(parent)
    return configs


def _count(saver: SQLAlchemySaver, table: Any, **where: str) -> int:
    query = select(func.count()).select_from(table)
    for column, value in where.items():
        query = query.where(table.c[column] == value)
    with saver.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


@pytest.fixture
def saver(db_url: str) -> Any:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        yield saver


def test_unchanged_channel_stored_once(saver: SQLAlchemySaver) -> None:
    configs = _put_chain(saver, "t", 5)
    assert _count(saver, blobs, channel="static") == 1
    assert _count(saver, blobs, channel="messages") == 5
    assert _count(saver, blobs, channel="step") == 0  # scalars stay inline
    latest = saver.get_tuple(configs[-1])
    assert latest is not None
    assert latest.checkpoint["channel_values"] == {
        "messages": [f"m{i}" for i in range(5)],
        "static": STATIC,
        "step": 4,
    }
    first = saver.get_tuple(configs[0])
    assert first is not None and first.checkpoint["channel_values"]["messages"] == ["m0"]


def test_prune_keep_latest_collects_blobs(saver: SQLAlchemySaver) -> None:
    configs = _put_chain(saver, "t", 4)
    _put_chain(saver, "other", 2)
    saver.put_writes(configs[0], [("messages", "old")], "task-old")
    saver.put_writes(configs[-1], [("messages", "new")], "task-new")
    saver.prune(["t"])
    kept = list(saver.list({"configurable": {"thread_id": "t"}}))
    assert [t.config for t in kept] == [configs[-1]]
    assert kept[0].parent_config is None
    assert kept[0].checkpoint["channel_values"]["static"] == STATIC
    assert kept[0].pending_writes == [("task-new", "messages", "new")]
    # The latest messages version is a delta over the first one, its chain's snapshot
    # (lists.py): both stay, with "static"; the four messages are stored once each.
    assert _count(saver, blobs, thread_id="t") == 3
    assert _count(saver, items, thread_id="t") == 4
    assert _count(saver, writes, thread_id="t") == 1
    assert _count(saver, checkpoints, thread_id="other") == 2
    with pytest.raises(ValueError, match="Unknown prune strategy"):
        saver.prune(["t"], strategy="everything")
    with pytest.raises(TypeError):
        saver.prune("t")


def test_delete_for_runs_collects_blobs_and_parents(saver: SQLAlchemySaver) -> None:
    configs = _put_chain(saver, "t", 3)
    # Re-label: the first checkpoint was made by run-1, the others by run-2.
    with saver.engine.begin() as conn:
        conn.execute(checkpoints.update().values(run_id="run-2"))
        conn.execute(
            checkpoints.update()
            .where(checkpoints.c.checkpoint_id == configs[0]["configurable"]["checkpoint_id"])
            .values(run_id="run-1")
        )
    saver.put_writes(configs[0], [("messages", "x")], "task")
    saver.delete_for_runs(["run-1"])
    assert saver.get_tuple(configs[0]) is None
    second = saver.get_tuple(configs[1])
    assert second is not None and second.parent_config is None
    # "static" was written by run-1's checkpoint but later ones still use it: kept.
    assert second.checkpoint["channel_values"]["static"] == STATIC
    assert _count(saver, blobs, thread_id="t", channel="static") == 1
    # The deleted checkpoint's messages version is the snapshot the later deltas extend: kept.
    assert _count(saver, blobs, thread_id="t", channel="messages") == 3
    assert _count(saver, items, thread_id="t") == 3
    assert _count(saver, writes, thread_id="t") == 0
    saver.delete_for_runs(["missing"])
    assert _count(saver, checkpoints, thread_id="t") == 2


def test_put_writes_upsert_semantics_and_order(saver: SQLAlchemySaver) -> None:
    (config,) = _put_chain(saver, "t", 1)
    saver.put_writes(config, [("a", 1), ("b", 2)], "task-b", "~path-b")
    saver.put_writes(config, [("a", 99)], "task-b", "~path-b")  # regular: first write wins
    saver.put_writes(config, [(ERROR, "first")], "task-a", "~path-a")
    saver.put_writes(config, [(ERROR, "second")], "task-a", "~path-a")  # special: upsert
    saver.put_writes(config, [(INTERRUPT, "stop")], "task-c", "")
    found = saver.get_tuple(config)
    assert found is not None
    # Sorted by (task_path, task_id, idx): "" < "~path-a" < "~path-b".
    assert found.pending_writes == [
        ("task-c", INTERRUPT, "stop"),
        ("task-a", ERROR, "second"),
        ("task-b", "a", 1),
        ("task-b", "b", 2),
    ]


@pytest.mark.parametrize(
    ("filter_", "expected"),
    [
        ({"source": "input"}, [0]),
        ({"step": 1}, [1]),
        ({"flag": True}, [1]),
        ({"flag": False}, [0]),
        ({"nothing": None}, [0]),
        ({"tags": ["a", "b"]}, [1]),
        ({"source": "loop", "score": 0.5}, [1]),
        ({"source": "input", "step": 1}, []),
    ],
)
def test_metadata_filters(
    saver: SQLAlchemySaver, filter_: dict[str, Any], expected: list[int]
) -> None:
    metadatas = [
        {"source": "input", "step": 0, "flag": False, "nothing": None, "tags": ["a"]},
        {"source": "loop", "step": 1, "flag": True, "score": 0.5, "tags": ["a", "b"]},
    ]
    config: dict[str, Any] = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    for metadata in metadatas:
        config = saver.put(config, empty_checkpoint(), metadata, {})
    found = saver.list({"configurable": {"thread_id": "t"}}, filter=filter_)
    assert sorted(t.metadata["step"] for t in found) == expected


def test_copy_thread_refuses_non_empty_target(saver: SQLAlchemySaver) -> None:
    _put_chain(saver, "a", 2)
    _put_chain(saver, "b", 1)
    with pytest.raises(ThreadNotEmptyError, match="delete it first") as info:
        saver.copy_thread("a", "b")
    assert isinstance(info.value, KVCacheError)
    saver.copy_thread("a", "c")
    assert _count(saver, blobs, thread_id="c") == _count(saver, blobs, thread_id="a")


def test_encrypted_serializer(db_url: str) -> None:
    pytest.importorskip("Crypto", reason="pycryptodome is needed for EncryptedSerializer")
    serde = EncryptedSerializer.from_pycryptodome_aes(key=b"0123456789abcdef")
    with SQLAlchemySaver.from_conn_string(db_url, serde=serde) as saver:
        saver.setup()
        config = saver.put(
            {"configurable": {"thread_id": "t", "checkpoint_ns": ""}},
            {
                **empty_checkpoint(),
                "channel_values": {"secret": ["top-secret-text"]},
                "channel_versions": {"secret": "1"},
            },
            {"source": "input", "step": -1},
            {"secret": "1"},
        )
        found = saver.get_tuple(config)
        assert found is not None
        assert found.checkpoint["channel_values"]["secret"] == ["top-secret-text"]
        with saver.engine.connect() as conn:
            raw = conn.execute(select(items.c.type, items.c.blob)).one()  # the list's one item
            digests = conn.execute(select(blobs.c.blob)).scalar_one()
        assert raw.type.endswith("+aes")
        assert b"top-secret-text" not in raw.blob
        # Digests of encrypted items are keyed per saver: no plaintext hash is stored.
        plain_typed = JsonPlusSerializer().dumps_typed("top-secret-text")
        assert digests != ListState(JsonPlusSerializer())._digest(plain_typed)
    with SQLAlchemySaver.from_conn_string(db_url) as plain, pytest.raises(Exception):  # noqa: B017
        plain.get_tuple(config)


def test_memory_database_is_shared_across_threads() -> None:
    with SQLAlchemySaver.from_conn_string("sqlite:///:memory:") as saver:
        saver.setup()
        (config,) = _put_chain(saver, "t", 1)
        seen: list[CheckpointTuple | None] = []
        reader = threading.Thread(target=lambda: seen.append(saver.get_tuple(config)))
        reader.start()
        reader.join()
        assert seen[0] is not None and seen[0].config == config


class RecordingSaver(SQLAlchemySaver):
    """Records the lifecycle hooks (the extension point for KV-cache sessions)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[Any, ...]] = []

    def _after_get_tuple(self, config: Any, found: CheckpointTuple | None) -> None:
        self.calls.append(("get_tuple", config["configurable"]["thread_id"], found is not None))

    def _after_delete_threads(self, thread_ids: Sequence[str]) -> None:
        self.calls.append(("delete_threads", list(thread_ids)))

    def _after_copy_thread(self, source: str, target: str) -> None:
        self.calls.append(("copy_thread", source, target))

    def _after_prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        self.calls.append(("prune", list(thread_ids), strategy))

    def _after_delete_for_runs(self, run_ids: Sequence[str], thread_ids: Sequence[str]) -> None:
        self.calls.append(("delete_for_runs", list(run_ids), list(thread_ids)))


def test_lifecycle_hooks(sqlite_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(sqlite_url) as base:
        saver = RecordingSaver(base.engine)
        saver.setup()
        _put_chain(saver, "a", 2, run_id="r1")
        saver.get_tuple({"configurable": {"thread_id": "a"}})
        saver.get_tuple({"configurable": {"thread_id": "zz"}})
        saver.copy_thread("a", "b")
        saver.prune(["b"])
        saver.delete_for_runs(["r1", "r-none"])
        saver.prune(["b"], strategy="delete")
        saver.delete_thread("a")
        assert saver.calls == [
            ("get_tuple", "a", True),
            ("get_tuple", "zz", False),
            ("copy_thread", "a", "b"),
            ("prune", ["b"], "keep_latest"),
            ("delete_for_runs", ["r1", "r-none"], ["a", "b"]),
            ("delete_threads", ["b"]),
            ("prune", ["b"], "delete"),
            ("delete_threads", ["a"]),
        ]
