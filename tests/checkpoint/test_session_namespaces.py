"""Which server sessions a thread's copy and delete owe: one per namespace the thread has.

A namespace's row (``checkpoint_kv_sessions``) is recorded by a background job after the
checkpoint committed, or by another process, so a copy or a delete made right after a run may
find no row for a subgraph yet. The saver then reads the namespaces of the thread's stored
checkpoints too (a CI run copied a thread before its subgraph's row was recorded: the copy
missed the subgraph's session). And a registration job that runs after its thread was deleted
records nothing and owes nothing. The server is down here, so every owed call stays in the
outbox, where the test reads it.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import wait
from typing import Any

from checkpoint_graphs import subgraph_graph
from langchain_core.messages import HumanMessage
from sqlalchemy import select

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.base import Stmt
from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions
from langgraph_kvcache.checkpoint.sessions.store import kv_sessions, op_pending
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver
from langgraph_kvcache.sessions import session_id_for


def _dead_options() -> KVSessionOptions:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    return KVSessionOptions(url, call_timeout_s=0.2, run_pins=False)


def _run(saver: SQLAlchemySaver, thread: str) -> None:
    graph = subgraph_graph().compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": thread}}
    graph.invoke({"messages": [HumanMessage("hi")], "turns": 0}, config)
    assert graph.get_state(config, subgraphs=True).tasks[0].state is not None  # child stored


def _owed(saver: SQLAlchemySaver) -> list[tuple[str, str, str | None]]:
    rows = saver._run(op_pending(100))
    return [(p.call.op, p.call.session_id, p.call.target_id) for p in rows]


def test_copy_and_delete_find_a_subgraph_session_whose_row_is_not_recorded(db_url: str) -> None:
    t, u = "ns-t", "ns-u"
    with SQLAlchemySaver.from_conn_string(db_url) as plain:  # another process ran the graph
        plain.setup()
        _run(plain, t)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=_dead_options()) as saver:
        saver.copy_thread(t, u)
        assert _owed(saver) == [
            ("copy", session_id_for(t), session_id_for(u)),
            ("copy", session_id_for(t, "child"), session_id_for(u, "child")),
        ]
        recorded = saver._run(_rows())
        assert recorded == {(u, ""), (u, "child")}
        saver.delete_thread(t)
        saver.delete_thread(u)
        deletes = [(op, sid) for op, sid, _ in _owed(saver)[2:]]
        assert deletes == [
            ("delete", session_id_for(t)),
            ("delete", session_id_for(t, "child")),
            ("delete", session_id_for(u)),
            ("delete", session_id_for(u, "child")),
        ]
        assert saver._run(_rows()) == set()


def test_a_registration_that_runs_after_its_thread_was_deleted_records_nothing(
    db_url: str,
) -> None:
    w = "ns-w"
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=_dead_options()) as saver:
        saver.setup()
        assert saver.kv_sessions is not None
        held = threading.Event()
        saver.kv_sessions._background.submit(held.wait, 30)  # the job thread is busy
        _run(saver, w)  # its checkpoints queue registrations behind that job
        saver.delete_thread(w)  # commits before they run
        held.set()
        wait(list(saver.kv_sessions._jobs), timeout=30)
        assert saver._run(_rows()) == set()
        owed = _owed(saver)
        assert ("delete", session_id_for(w, "child"), None) in owed
        assert not [call for call in owed if call[0] == "register"]


def _rows() -> Any:
    c = kv_sessions.c
    rows = yield Stmt(select(c.thread_id, c.checkpoint_ns), fetch=True)
    return {(r["thread_id"], r["checkpoint_ns"]) for r in rows}


async def test_the_async_saver_owes_them_too(db_url: str) -> None:
    t, u = "ans-t", "ans-u"
    with SQLAlchemySaver.from_conn_string(db_url) as plain:
        plain.setup()
        _run(plain, t)
    options = _dead_options()
    async with AsyncSQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        await saver.acopy_thread(t, u)
        await saver.adelete_thread(t)
        rows = await saver._run(op_pending(100))
    assert [(p.call.op, p.call.session_id, p.call.target_id) for p in rows] == [
        ("copy", session_id_for(t), session_id_for(u)),
        ("copy", session_id_for(t, "child"), session_id_for(u, "child")),
        ("delete", session_id_for(t), None),
        ("delete", session_id_for(t, "child"), None),
    ]
