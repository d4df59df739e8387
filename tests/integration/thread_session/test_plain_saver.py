"""Without ``kv_server`` the saver is a plain SQL checkpointer: no session table is ever queried.

Every SQL statement the SQLite driver runs is traced (``sqlite3`` trace callback, so the saver's
direct DBAPI fast paths are seen too). No server is needed: the kv-enabled contrast points at
a dead port, which the saver tolerates.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from sqlalchemy import create_engine, event

from langgraph_kvcache.checkpoint import SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def _echo(state: State) -> dict[str, Any]:
    return {"messages": [AIMessage(f"echo {len(state['messages'])}")]}


def _traced_saver(path: Path, **kwargs: Any) -> tuple[SQLAlchemySaver, list[str]]:
    statements: list[str] = []
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _trace(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.set_trace_callback(statements.append)

    return SQLAlchemySaver(engine, **kwargs), statements


def _exercise(saver: SQLAlchemySaver) -> None:
    builder = StateGraph(State)
    builder.add_node("echo", _echo)
    builder.add_edge(START, "echo")
    graph = builder.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "t1"}}
    for text in ("one", "two"):
        graph.invoke({"messages": [HumanMessage(text)]}, config)
    graph.get_state(config)
    saver.copy_thread("t1", "t2")
    saver.prune(["t2"], strategy="keep_latest")
    saver.delete_for_runs(["no-such-run"])
    saver.delete_thread("t1")


def _dead_url() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_no_kv_server_means_no_session_queries(tmp_path: Path) -> None:
    saver, statements = _traced_saver(tmp_path / "plain.db")
    assert saver.kv_sessions is None and saver.lifecycle is saver
    saver.setup()
    statements.clear()
    _exercise(saver)
    assert statements, "the trace sees the saver's statements"
    assert not [s for s in statements if "checkpoint_kv" in s]
    assert saver.sweep_expired() == []


def test_kv_server_records_threads_in_the_session_table(tmp_path: Path) -> None:
    options = KVSessionOptions(_dead_url(), call_timeout_s=0.5)
    saver, statements = _traced_saver(tmp_path / "kv.db", kv_server=options)
    try:
        saver.setup()
        statements.clear()
        _exercise(saver)
        assert [s for s in statements if "checkpoint_kv_sessions" in s]
    finally:
        assert saver.kv_sessions is not None
        saver.kv_sessions.close()


def test_ttl_needs_a_server() -> None:
    engine = create_engine("sqlite://")
    with pytest.raises(ValueError, match="need kv_server"):
        SQLAlchemySaver(engine, ttl_seconds=60)


def test_session_options_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="ttl_seconds must be > 0"):
        KVSessionOptions("http://127.0.0.1:1", ttl_seconds=0)
    with pytest.raises(ValueError, match="call_timeout_s must be >= 0"):
        KVSessionOptions("http://127.0.0.1:1", call_timeout_s=-1)
    with pytest.raises(ValueError, match="inside KVSessionOptions"):
        SQLAlchemySaver(
            create_engine("sqlite://"),
            kv_server=KVSessionOptions("http://127.0.0.1:1"),
            ttl_seconds=5,
        )
