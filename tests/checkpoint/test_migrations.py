"""Upgrading a database: what a release before the seventh migration wrote reads back equal
after ``setup()`` migrates it, a thread continues across the upgrade, and the KV session
tables exist only where a saver with ``kv_server`` needs them.

The "old" database is made by this release's savers with ``MIGRATIONS`` cut to the first six
(what the previous release ran; the rows it writes are the rows this one writes)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from sqlalchemy import create_engine, inspect, text

from langgraph_kvcache.checkpoint import base as saver_base
from langgraph_kvcache.checkpoint.kv_sessions import KVSessionOptions
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

SESSION_TABLES = {"checkpoint_kv_sessions", "checkpoint_kv_outbox"}
PREVIOUS = 6
"""Migrations the release before this layout ran."""


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
        patch.setattr(saver_base, "MIGRATIONS", MIGRATIONS[:PREVIOUS])
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


def test_upgrade_reads_everything_back(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with _previous_release(monkeypatch), SQLAlchemySaver.from_conn_string(db_url) as old:
        old.setup()
        _write_threads(old)
        before = {t: _history(old, t) for t in ("a", "b")}
        latest = old.get_tuple({"configurable": {"thread_id": "b"}})
        history = old.get_delta_channel_history(
            config={"configurable": {"thread_id": "b"}}, channels=["messages"]
        )
    assert _tables(db_url) >= SESSION_TABLES  # the fourth migration made them
    with SQLAlchemySaver.from_conn_string(db_url) as new:
        new.setup()
        assert {t: _history(new, t) for t in ("a", "b")} == before
        assert new.get_tuple({"configurable": {"thread_id": "b"}}) == latest
        assert (
            new.get_delta_channel_history(
                config={"configurable": {"thread_id": "b"}}, channels=["messages"]
            )
            == history
        )
        # The thread continues across the upgrade; its old checkpoints stay readable.
        graph = _graph(new)
        config = {"configurable": {"thread_id": "b"}}
        for i in range(3):
            graph.invoke({"messages": [HumanMessage(f"after upgrade {i}")]}, config)
        grown = _history(new, "b")
        assert len(grown) > len(before["b"]) and grown[-len(before["b"]) :] == before["b"]
        messages = graph.get_state(config).values["messages"]
        assert len(messages) == 2 * 9 and messages[-2].content == "after upgrade 2"
        # Maintenance across rows written before and after the upgrade.
        new.copy_thread("b", "b2")
        assert _history(new, "b2") == [
            t._replace(
                config={"configurable": {**t.config["configurable"], "thread_id": "b2"}},
                parent_config=t.parent_config
                and {"configurable": {**t.parent_config["configurable"], "thread_id": "b2"}},
            )
            for t in grown
        ]
        new.prune(["b"], strategy="keep_latest")
        assert _history(new, "b") == [grown[0]._replace(parent_config=None)]
        new.delete_thread("a")
        assert _history(new, "a") == []
    with SQLAlchemySaver.from_conn_string(db_url) as cold:
        assert cold.get_tuple(config).checkpoint == grown[0].checkpoint
        assert cold.get_tuple({"configurable": {"thread_id": "b2"}}).checkpoint == (
            grown[0].checkpoint
        )
    assert not _tables(db_url) & SESSION_TABLES  # empty: dropped by the seventh migration


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
