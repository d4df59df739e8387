"""Compact stored format (migration 6): list-valued pending writes as item references shared
with the list version that takes them in, compressed items and checkpoint bodies, the append
recognised from one serialization of the whole list (and an in-place edit still caught), and
29-character versions ordered after the older 51-character ones."""

from __future__ import annotations

import random
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from sqlalchemy import select
from test_lists import Thread, _count

from langgraph_kvcache.checkpoint import compress
from langgraph_kvcache.checkpoint import sync as sync_module
from langgraph_kvcache.checkpoint.list_rows import ITEMS_TYPE, _ByteLRU
from langgraph_kvcache.checkpoint.schema import checkpoints, items, writes
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


@pytest.fixture
def saver(db_url: str) -> Any:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        yield saver


def stored_type(saver: SQLAlchemySaver, serde_type: str) -> str:
    """The stored type of a compressible value: compressed on PostgreSQL only."""
    compressed = saver.dialect in compress.COMPRESSED_DIALECTS
    assert compressed == (saver.dialect == "postgresql")
    return compress.PREFIX + serde_type if compressed else serde_type


def long_msg(i: int) -> HumanMessage:
    return HumanMessage(f"message {i} " + "about the weather and the trip " * 8, id=f"m{i}")


NOISE = random.Random(34).randbytes(300)
"""Incompressible bytes, the same in every process (pytest-xdist workers collect alike)."""


@pytest.mark.parametrize("data", [b"", b"short", NOISE, b"compressible " * 40], ids=repr)
@pytest.mark.parametrize("serde_type", ["msgpack", compress.PREFIX + "odd"])
def test_compress_round_trip(serde_type: str, data: bytes) -> None:
    stored_type, stored = compress.pack(serde_type, data)
    assert compress.unpack(stored_type, stored) == (serde_type, data)
    assert stored_type.startswith(compress.PREFIX) == (
        serde_type.startswith(compress.PREFIX) or len(stored) + compress.MIN_SAVING <= len(data)
    )
    if data == b"compressible " * 40:
        assert stored_type == compress.PREFIX + serde_type and len(stored) < len(data) // 4


def test_list_write_is_stored_as_items_shared_with_the_next_version(db_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        thread = Thread(saver, "t")
        first = thread.put([long_msg(0)])
        saver.put_writes(first, [("messages", [long_msg(1)]), ("other", {"k": 1})], "task")
        thread.put([long_msg(0), long_msg(1)])
        with saver.engine.connect() as conn:
            rows = conn.execute(select(writes.c.channel, writes.c.type)).all()
            stored = conn.execute(select(items.c.type)).scalars().all()
        assert dict(rows)["messages"] == ITEMS_TYPE and dict(rows)["other"] != ITEMS_TYPE
        assert len(stored) == 2  # the write's message is the next version's item
        assert all(t == stored_type(saver, "msgpack") for t in stored)
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:  # remembers nothing
        found = fresh.get_tuple(first)
        assert found is not None
        assert sorted(found.pending_writes) == [
            ("task", "messages", [long_msg(1)]),
            ("task", "other", {"k": 1}),
        ]
        assert Thread(fresh, "t").read(thread.configs[1]) == [long_msg(0), long_msg(1)]
        # A write's items outlive pruning as long as the write does.
        fresh.put_writes(thread.configs[1], [("messages", [long_msg(7)])], "late")
        fresh.prune(["t"], strategy="keep_latest")
        assert _count(fresh, items, "t") == 3
    with SQLAlchemySaver.from_conn_string(db_url) as again:
        latest = again.get_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}})
        assert latest is not None and latest.pending_writes == [("late", "messages", [long_msg(7)])]


def test_in_place_edit_of_an_earlier_item_is_not_taken_for_an_append(
    saver: Any, db_url: str
) -> None:
    thread = Thread(saver, "t")
    messages = [long_msg(0), AIMessage("answer " * 30, id="a")]
    thread.put(list(messages))
    messages[1].content = "edited in place"  # same object, new content
    thread.put([*messages, long_msg(2)])
    assert thread.read(thread.configs[1])[1].content == "edited in place"
    assert thread.read(thread.configs[0])[1].content == "answer " * 30
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:
        assert Thread(fresh, "t").read(thread.configs[1]) == [*messages, long_msg(2)]


def test_bodies_are_stored_without_the_id_and_read_back_whole(saver: Any) -> None:
    thread = Thread(saver, "t")
    config = thread.put([long_msg(0)])
    with saver.engine.connect() as conn:
        body_type = conn.execute(select(checkpoints.c.type)).scalar_one()
    assert body_type == stored_type(saver, "msgpack")
    found = saver.get_tuple(config)
    assert found is not None
    assert found.checkpoint["id"] == config["configurable"]["checkpoint_id"]
    assert list(found.checkpoint)[:2] == ["v", "id"]  # the id keeps its place


def test_compressed_and_plain_rows_read_alike(db_url: str) -> None:
    """Rows written compressed (PostgreSQL's default, and SQLite's before it stopped) and rows
    written plain sit in one database and read back equal through a saver that remembers
    nothing."""
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        saver.lists.compressed = not saver.lists.compressed  # the other form first
        thread = Thread(saver, "t")
        values = [long_msg(0)]
        thread.put(list(values))
        saver.lists.compressed = not saver.lists.compressed
        values.append(long_msg(1))
        thread.put(list(values))
        with saver.engine.connect() as conn:
            types = set(conn.execute(select(items.c.type)).scalars())
            bodies = set(conn.execute(select(checkpoints.c.type)).scalars())
        assert types == bodies == {"msgpack", compress.PREFIX + "msgpack"}
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:
        reader = Thread(fresh, "t")
        assert reader.read(thread.configs[0]) == values[:1]
        assert reader.read(thread.configs[1]) == values


def test_versions_are_short_and_follow_older_long_ones(saver: Any) -> None:
    old = f"{41:032}.{0.123456789:016}"  # the format before migration 6
    new = saver.get_next_version(old, None)
    assert len(new) == 29 and new > old and new.startswith(f"{42:016}.")
    assert saver.get_next_version(new, None) > new
    assert saver.get_next_version(None, None) > f"{0:032}.{0.9:016}"


def test_item_memory_joins_only_remembered_msgpack_items() -> None:
    memory = _ByteLRU(max_bytes=3 * (64 + 10))
    memory.put(b"a", ("msgpack", b"A" * 10))
    memory.put(b"b", ("json", b"B" * 10))
    memory.put(b"c", ("msgpack", b"C" * 10))
    assert memory.msgpack_bytes([b"c", b"a", b"c"]) == b"C" * 10 + b"A" * 10 + b"C" * 10
    assert memory.msgpack_bytes([b"a", b"b"]) is None  # not msgpack: the caller decodes each
    memory.put(b"d", ("msgpack", b"D" * 10))  # evicts the oldest, "a"
    assert memory.get(b"a") is None and memory.msgpack_bytes([b"a"]) is None
    assert memory.msgpack_bytes([b"c", b"d"]) == b"C" * 10 + b"D" * 10


def _spy_statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The SQL of every statement the sync savers run on the fast path from now on."""
    sql: list[str] = []
    original = sync_module.run_plain

    def spy(dialect: Any, driver: Any, stmt: Any) -> Any:
        sql.append(str(stmt.statement))
        return original(dialect, driver, stmt)

    monkeypatch.setattr(sync_module, "run_plain", spy)
    return sql


def test_items_stored_by_the_parents_writes_are_not_sent_again(
    saver: Any, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next checkpoint's list takes in the message its parent's write stored: its ``put``
    names no item row, and a saver that remembers nothing reads it back. After the thread is
    deleted the saver no longer takes those items as stored."""
    thread = Thread(saver, "t")
    first = thread.put([long_msg(0)])
    saver.put_writes(first, [("messages", [long_msg(1)])], "task")
    sql = _spy_statements(monkeypatch)
    second = thread.put([long_msg(0), long_msg(1)])
    monkeypatch.undo()
    assert sql and not [s for s in sql if "checkpoint_items" in s], sql
    assert _count(saver, items, "t") == 2
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:
        found = fresh.get_tuple(second)
        assert found is not None
        assert found.checkpoint["channel_values"]["messages"] == [long_msg(0), long_msg(1)]
    saver.delete_thread("t")
    # A stale config naming the deleted parent: the items must be stored again.
    again = Thread(saver, "t")
    later = again.put([long_msg(0), long_msg(1)], parent=first)
    assert _count(saver, items, "t") == 2
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:
        found = fresh.get_tuple(later)
        assert found is not None
        assert found.checkpoint["channel_values"]["messages"] == [long_msg(0), long_msg(1)]


def test_get_tuple_follows_chains_in_one_statement(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkpoint of a thread whose list chains have leaves, anchors and snapshots reads
    back equal to what was put, from a saver that remembers nothing (which fetches the items)
    and then warm, in one statement."""
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=9) as saver:
        saver.setup()
        thread = Thread(saver, "t")
        values: list[list[Any]] = []
        for i in range(30):
            values.append([*(values[-1] if values else []), long_msg(i)])
            config = thread.put(values[-1])
            saver.put_writes(config, [("messages", [long_msg(100 + i)])], f"task{i}")
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=9) as reader:
        latest = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
        for i, config in [(29, latest), *enumerate(thread.configs)]:
            for attempt in ("cold", "warm"):
                sql = _spy_statements(monkeypatch)
                found = reader.get_tuple(config)
                monkeypatch.undo()
                assert found is not None
                assert found.checkpoint["channel_values"]["messages"] == values[i]
                assert found.pending_writes == [(f"task{i}", "messages", [long_msg(100 + i)])]
                if attempt == "warm":
                    assert len(sql) == 1, sql
