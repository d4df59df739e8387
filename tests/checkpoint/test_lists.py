"""Append-aware list storage (langgraph_kvcache/checkpoint/lists.py) on SQLite and PostgreSQL:
what is stored for appends and for everything else, chain length, pruning and copying chains,
old rows after the migration, and ``get_delta_channel_history`` in one statement."""

from __future__ import annotations

from typing import Any

import pytest
from checkpoint_graphs import delta_graph
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint
from langgraph.graph import START, MessagesState, StateGraph
from sqlalchemy import event, func, select, text

from langgraph_kvcache.checkpoint import sync as sync_module
from langgraph_kvcache.checkpoint import write_queries
from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.list_rows import ITEMS_TYPE, split_digests
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS, statements_for
from langgraph_kvcache.checkpoint.schema import blobs, items
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


def _rows(saver: SQLAlchemySaver, thread_id: str, channel: str) -> list[Any]:
    b = blobs.c
    with saver.engine.connect() as conn:
        return list(
            conn.execute(
                select(b.version, b.type, b.blob, b.base_version, b.since_snapshot)
                .where(b.thread_id == thread_id, b.channel == channel)
                .order_by(b.version)
            )
        )


def _count(saver: SQLAlchemySaver, table: Any, thread_id: str) -> int:
    with saver.engine.connect() as conn:
        query = select(func.count()).select_from(table).where(table.c.thread_id == thread_id)
        return int(conn.execute(query).scalar_one())


class Thread:
    """Puts checkpoints with a ``messages`` list channel, like LangGraph does."""

    def __init__(self, saver: SQLAlchemySaver, thread_id: str) -> None:
        self.saver, self.thread_id = saver, thread_id
        self.config: dict[str, Any] = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": ""}
        }
        self.version: str | None = None
        self.configs: list[dict[str, Any]] = []

    def put(self, messages: list[Any], parent: dict[str, Any] | None = None) -> dict[str, Any]:
        self.version = self.saver.get_next_version(self.version, None)
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"messages": messages}
        checkpoint["channel_versions"] = {"messages": self.version}
        config = parent or self.config
        self.config = self.saver.put(config, checkpoint, {}, {"messages": self.version})
        self.configs.append(self.config)
        return self.config

    def read(self, config: dict[str, Any]) -> list[Any]:
        found = self.saver.get_tuple(config)
        assert found is not None
        return found.checkpoint["channel_values"]["messages"]


def msg(i: int) -> HumanMessage:
    return HumanMessage(f"message {i}", id=str(i))


@pytest.fixture
def saver(db_url: str) -> Any:
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=9) as saver:
        saver.setup()
        yield saver


def test_appends_store_each_item_once_in_short_chains(saver: SQLAlchemySaver) -> None:
    thread = Thread(saver, "t")
    values = []
    for i in range(30):
        values.append(msg(i))
        thread.put(list(values))
    rows = _rows(saver, "t", "messages")
    assert all(r.type == ITEMS_TYPE for r in rows)
    assert _count(saver, items, "t") == 30  # each message stored once
    # snapshot_every=9: anchors every 3 versions; a snapshot at 0, 9, 18, 27.
    assert [r.since_snapshot for r in rows] == [i % 9 for i in range(30)]
    snapshots = [i for i, r in enumerate(rows) if r.base_version is None]
    assert snapshots == [0, 9, 18, 27]
    by_version = {r.version: r for r in rows}
    for r in rows:  # at most two links: leaf -> anchor -> snapshot
        links, current = 0, r
        while current.base_version is not None:
            current, links = by_version[current.base_version], links + 1
        assert links <= 2
    # A leaf stores only what follows its anchor, not the whole list.
    assert len(split_digests(rows[8].blob)) == 2
    # A fresh saver (nothing remembered) reads every version back.
    with SQLAlchemySaver.from_conn_string(saver.engine.url) as reader:
        for i, config in enumerate(thread.configs):
            found = reader.get_tuple(config)
            assert found is not None
            assert found.checkpoint["channel_values"]["messages"] == values[: i + 1]


def test_non_appends_store_snapshots(saver: SQLAlchemySaver) -> None:
    thread = Thread(saver, "t")
    thread.put([msg(0), msg(1)])
    thread.put([msg(0), msg(1), msg(2)])  # append: delta
    edited = [msg(0), HumanMessage("edited", id="1"), msg(2)]
    thread.put(edited)  # edit: snapshot
    thread.put([msg(2), msg(0)])  # removal and reorder: snapshot
    thread.put([])  # empty
    rows = _rows(saver, "t", "messages")
    assert [r.base_version is None for r in rows] == [True, False, True, True, True]
    assert [thread.read(c) for c in thread.configs] == [
        [msg(0), msg(1)],
        [msg(0), msg(1), msg(2)],
        edited,
        [msg(2), msg(0)],
        [],
    ]
    assert _count(saver, items, "t") == 4  # 0, 1, 2 and the edited 1


def test_fork_from_old_checkpoint_extends_it(saver: SQLAlchemySaver) -> None:
    thread = Thread(saver, "t")
    for i in range(4):
        thread.put([msg(j) for j in range(i + 1)])
    fork = thread.put([msg(0), msg(1), HumanMessage("fork")], parent=thread.configs[1])
    assert thread.read(fork) == [msg(0), msg(1), HumanMessage("fork")]
    assert thread.read(thread.configs[3]) == [msg(j) for j in range(4)]
    assert _rows(saver, "t", "messages")[-1].base_version is not None  # a delta on step 1


def test_prune_and_copy_keep_chains_and_free_the_rest(saver: SQLAlchemySaver) -> None:
    thread = Thread(saver, "t")
    for i in range(14):  # snapshot at 9; the latest (13) is a leaf on anchor 12
        thread.put([msg(j) for j in range(i + 1)])
    thread.put([msg(100)])  # not an append: a snapshot of one new item
    latest = thread.put([msg(100), msg(101)])
    saver.copy_thread("t", "copy")
    saver.prune(["t"])
    # Kept: the latest (a leaf) and the snapshot it extends; items: 100 and 101 only.
    assert len(_rows(saver, "t", "messages")) == 2
    assert _count(saver, items, "t") == 2
    assert thread.read(latest) == [msg(100), msg(101)]
    # The copy is whole and reads like the source did.
    copied = {"configurable": {**thread.configs[13]["configurable"], "thread_id": "copy"}}
    assert thread.read(copied) == [msg(j) for j in range(14)]
    # Writing on after the prune still works (a fresh snapshot or a delta on what was kept).
    after = thread.put([msg(100), msg(101), msg(102)], parent=latest)
    assert thread.read(after) == [msg(100), msg(101), msg(102)]
    saver.delete_thread("copy")
    assert _count(saver, items, "copy") == 0 and not _rows(saver, "copy", "messages")


def test_delete_for_runs_keeps_the_versions_later_checkpoints_extend(
    saver: SQLAlchemySaver,
) -> None:
    thread = Thread(saver, "t")
    thread.put([msg(0)])
    first = thread.configs[0]
    thread.put([msg(0), msg(1)])
    thread.put([msg(0), msg(1), msg(2)])
    with saver.engine.begin() as conn:
        conn.execute(
            text("UPDATE checkpoints SET run_id = 'r1' WHERE checkpoint_id = :id"),
            {"id": first["configurable"]["checkpoint_id"]},
        )
    saver.delete_for_runs(["r1"])
    assert saver.get_tuple(first) is None
    assert thread.read(thread.configs[2]) == [msg(0), msg(1), msg(2)]
    assert len(_rows(saver, "t", "messages")) == 3  # the first version is a snapshot others use


def test_rows_from_before_the_migration_stay_readable(db_url: str) -> None:
    """A database at schema version 4 with a full list blob (the old layout) migrates without
    rewriting it, reads it back, and a thread continues from it."""
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        with saver.engine.begin() as conn:
            for migration in MIGRATIONS[:5]:
                for sql in statements_for(migration, saver.dialect):
                    conn.exec_driver_sql(sql)
            for v in range(5):
                conn.execute(text("INSERT INTO checkpoint_migrations (v) VALUES (:v)"), {"v": v})
            old_value = [msg(0), msg(1)]
            type_, data = saver.serde.dumps_typed(old_value)
            version = f"{1:032}.{0.25:016}"  # the 51-character versions of that time
            body = {**empty_checkpoint(), "channel_values": {}, "channel_versions": {}}
            b_type, b_data = saver.serde.dumps_typed(body)
            conn.execute(
                text(
                    "INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, "
                    "type, blob) VALUES ('old', '', 'messages', :v, :t, :b)"
                ),
                {"v": version, "t": type_, "b": data},
            )
            conn.execute(
                text(
                    "INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, type, "
                    "checkpoint, metadata, blob_versions) VALUES ('old', '', :id, :t, :b, "
                    "'{}', :bv)"
                ),
                {"id": body["id"], "t": b_type, "b": b_data, "bv": f'{{"messages": "{version}"}}'},
            )
        saver.setup()
        old = {
            "configurable": {"thread_id": "old", "checkpoint_ns": "", "checkpoint_id": body["id"]}
        }
        found = saver.get_tuple(old)
        assert found is not None and found.checkpoint["channel_values"]["messages"] == old_value
        with saver.engine.connect() as conn:
            row = conn.execute(select(blobs.c.type, blobs.c.base_version)).one()
        assert row.type == type_ and row.base_version is None  # not converted
        thread = Thread(saver, "old")
        thread.version = version
        new = thread.put([*old_value, msg(2)], parent=old)
        assert thread.read(new) == [*old_value, msg(2)]
        assert thread.read(old) == old_value


def _count_statements(saver: SQLAlchemySaver, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    original = sync_module.run_plain

    def counting(dialect: Any, driver: Any, stmt: Any) -> Any:
        seen.append(str(stmt.statement)[:40])
        return original(dialect, driver, stmt)

    monkeypatch.setattr(sync_module, "run_plain", counting)
    event.listen(saver.engine, "before_cursor_execute", lambda *a: seen.append(a[2][:40]))
    return seen


def test_delta_channel_history_is_one_statement(
    saver: SQLAlchemySaver, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = delta_graph().compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "d"}}
    for _ in range(8):
        graph.invoke({"log": []}, cfg)
    history = list(saver.list(cfg))
    seen = _count_statements(saver, monkeypatch)
    for config in [cfg, *(t.config for t in history)]:
        seen.clear()
        ours = saver.get_delta_channel_history(config=config, channels=["log", "missing"])
        assert len(seen) == 1, seen
        monkeypatch.undo()
        generic = BaseCheckpointSaver.get_delta_channel_history(
            saver, config=config, channels=["log", "missing"]
        )
        assert ours == generic
        seen = _count_statements(saver, monkeypatch)


async def test_async_saver_lists_and_delta(db_url: str) -> None:
    async with AsyncSQLAlchemySaver.from_conn_string(db_url, snapshot_every=4) as saver:
        await saver.setup()
        builder = StateGraph(MessagesState)
        builder.add_node("echo", lambda s: {"messages": [AIMessage(f"re {len(s['messages'])}")]})
        builder.add_edge(START, "echo")
        graph = builder.compile(checkpointer=saver)
        cfg = {"configurable": {"thread_id": "a"}}
        # More new items than one PostgreSQL put statement carries (write_queries.PUT_INLINE_ITEMS).
        seed = [
            HumanMessage(f"seed {i}", id=f"s{i}") for i in range(write_queries.PUT_INLINE_ITEMS + 4)
        ]
        await graph.ainvoke({"messages": seed}, cfg)
        await graph.aupdate_state(cfg, {"messages": [RemoveMessage(id=m.id) for m in seed]})
        await graph.aupdate_state(cfg, {"messages": [RemoveMessage(id="__remove_all__")]})
        for i in range(12):
            await graph.ainvoke({"messages": [HumanMessage(f"q{i}", id=f"q{i}")]}, cfg)
        await graph.aupdate_state(cfg, {"messages": [RemoveMessage(id="q3")]})
        state = await graph.aget_state(cfg)
        assert [m.content for m in state.values["messages"]][:6] == [
            "q0",
            "re 1",
            "q1",
            "re 3",
            "q2",
            "re 5",
        ]
        assert "q3" not in [m.id for m in state.values["messages"]]
        history = [s async for s in graph.aget_state_history(cfg)]
        assert history[-2].values["messages"] == seed
