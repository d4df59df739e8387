"""Upgrading a database: what a release before the seventh migration wrote reads back equal
after ``setup()`` migrates it, a thread continues across the upgrade, and the KV session
tables exist only where a saver with ``kv_server`` needs them.

The old database is set up with ``MIGRATIONS`` cut to the first six (what the previous release
ran) and holds rows that release wrote, frozen in ``data/layout6.json`` (:mod:`old_layout`)."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypedDict

import old_layout
import pytest
from checkpoint_graphs import approval_graph
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command
from sqlalchemy import create_engine, inspect, text

from langgraph_kvcache.checkpoint import base as saver_base
from langgraph_kvcache.checkpoint.kv_sessions import KVSessionOptions
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

SESSION_TABLES = {"checkpoint_kv_sessions", "checkpoint_kv_outbox"}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def _reply(state: State) -> dict[str, Any]:
    return {"messages": [AIMessage(f"reply {len(state['messages'])} " + "word " * 30)]}


def _graph(saver: SQLAlchemySaver) -> Any:
    builder = StateGraph(State)
    builder.add_node("reply", _reply)
    builder.add_edge(START, "reply")
    return builder.compile(checkpointer=saver)


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _dead_url() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def _previous_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``setup()`` runs only the migrations the previous release had."""
    with monkeypatch.context() as patch:
        patch.setattr(saver_base, "MIGRATIONS", MIGRATIONS[: old_layout.PREVIOUS])
        yield


def _history(saver: SQLAlchemySaver, thread_id: str) -> list[Any]:
    return list(saver.list({"configurable": {"thread_id": thread_id}}))


def _write_threads(saver: SQLAlchemySaver) -> None:
    graph = _graph(saver)
    for thread_id in ("a", "b"):
        config = {"configurable": {"thread_id": thread_id}}
        for i in range(6):
            graph.invoke({"messages": [HumanMessage(f"turn {i} of {thread_id}")]}, config)
    # A fork: update_state on an older checkpoint of "a" (a snapshot, not an append).
    old = _history(saver, "a")[4].config
    graph.update_state(old, {"messages": [HumanMessage("forked")]})


def test_plain_setup_has_no_session_tables(db_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        saver.setup()  # idempotent
        _write_threads(saver)
    tables = _tables(db_url)
    assert not tables & SESSION_TABLES
    assert {"checkpoints", "checkpoint_blobs", "checkpoint_writes"} <= tables


def test_kv_server_setup_creates_session_tables(db_url: str) -> None:
    options = KVSessionOptions(_dead_url(), call_timeout_s=0.5)
    with SQLAlchemySaver.from_conn_string(db_url) as plain:
        plain.setup()  # another process set the database up without kv_server
    assert not _tables(db_url) & SESSION_TABLES
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        saver.setup()
        assert _tables(db_url) >= SESSION_TABLES
        _write_threads(saver)  # the dead server is tolerated; the session rows are written
        saver.copy_thread("a", "c")
        saver.delete_thread("b")
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT thread_id FROM checkpoint_kv_sessions")).all()
    finally:
        engine.dispose()
    assert {r[0] for r in rows} >= {"a", "c"}
    # A plain saver's setup later keeps the (non-empty) tables.
    with SQLAlchemySaver.from_conn_string(db_url) as plain:
        plain.setup()
    assert _tables(db_url) >= SESSION_TABLES


def _old_database(url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Set ``url`` up with the first six migrations and load the frozen rows into it
    (:mod:`old_layout`); returns the fixture."""
    fixture = json.loads(old_layout.FIXTURE.read_text())
    with _previous_release(monkeypatch), SQLAlchemySaver.from_conn_string(url) as old:
        old.setup()
        with old.engine.begin() as conn:
            old_layout.insert_rows(conn, old.dialect, fixture["rows"])
    return fixture


def _renamed(found: Any, thread_id: str) -> Any:
    """``found`` as ``copy_thread`` makes it in ``thread_id``."""

    def move(config: Any) -> Any:
        return config and {"configurable": {**config["configurable"], "thread_id": thread_id}}

    return found._replace(config=move(found.config), parent_config=move(found.parent_config))


def test_upgrade_reads_everything_back(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fixture = _old_database(db_url, monkeypatch)
    assert _tables(db_url) >= SESSION_TABLES  # the fourth migration made them
    with SQLAlchemySaver.from_conn_string(db_url) as new:
        new.setup()
        for thread_id, expected in fixture["expected"].items():
            found = [old_layout.tuple_value(t) for t in _history(new, thread_id)]
            assert found == [old_layout.load_value(v) for v in expected], thread_id
            latest = new.get_tuple({"configurable": {"thread_id": thread_id}})
            assert old_layout.tuple_value(latest) == old_layout.load_value(expected[0])
        history = new.get_delta_channel_history(
            config={"configurable": {"thread_id": "delta"}}, channels=[old_layout.DELTA_CHANNEL]
        )
        expected_history = old_layout.load_value(fixture["delta_history"])
        assert old_layout.normalized(dict(history)) == expected_history
    assert not _tables(db_url) & SESSION_TABLES  # empty: dropped by the seventh migration


def test_upgraded_thread_continues(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fixture = _old_database(db_url, monkeypatch)
    config = {"configurable": {"thread_id": "chat"}}
    with SQLAlchemySaver.from_conn_string(db_url) as new:
        new.setup()
        before = _history(new, "chat")
        chat = approval_graph().compile(checkpointer=new)
        start = chat.get_state(config).values["messages"]
        run_id = str(uuid.uuid4())
        run = {**config, "metadata": {"run_id": run_id}}
        chat.invoke({"messages": [HumanMessage("after the upgrade")]}, run)
        chat.invoke(Command(resume="still here"), run)
        grown = _history(new, "chat")
        assert len(grown) > len(before) and grown[-len(before) :] == before
        messages = chat.get_state(config).values["messages"]
        assert messages[: len(start)] == start
        assert [m.content for m in messages[len(start) :]] == [
            "after the upgrade",
            "echo after the upgrade",
            "approved: still here",
        ]
        # Maintenance across rows written before and after the upgrade.
        new.copy_thread("chat", "copy")
        assert _history(new, "copy") == [_renamed(t, "copy") for t in grown]
        assert grown[0].metadata["run_id"] == run_id
        new.delete_for_runs([run_id])
        assert _history(new, "chat") == before  # the old rows stay, written before the run
        assert _history(new, "copy") == [_renamed(t, "copy") for t in before]  # the copies too
        new.prune(["copy"], strategy="keep_latest")
        assert [t.checkpoint for t in _history(new, "copy")] == [before[0].checkpoint]
        new.delete_thread("sub")
        assert _history(new, "sub") == []
    with SQLAlchemySaver.from_conn_string(db_url) as cold:
        assert cold.get_tuple({"configurable": {"thread_id": "copy"}}).checkpoint == (
            before[0].checkpoint
        )
        for t in _history(cold, "chat"):
            assert cold.get_tuple(t.config) == t
        assert _history(cold, "chat") == before
        found = [old_layout.tuple_value(t) for t in _history(cold, "delta")]
        assert found == [old_layout.load_value(v) for v in fixture["expected"]["delta"]]


def test_upgrade_keeps_session_tables_in_use(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options = KVSessionOptions(_dead_url(), call_timeout_s=0.5)
    with (
        _previous_release(monkeypatch),
        SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as old,
    ):
        old.setup()
        _write_threads(old)
    with SQLAlchemySaver.from_conn_string(db_url) as new:
        new.setup()
        assert len(_history(new, "a")) == 3 * 6 + 1
    assert _tables(db_url) >= SESSION_TABLES
