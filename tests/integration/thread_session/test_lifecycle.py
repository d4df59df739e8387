"""The saver's session lifecycle around the agent: server down or slow (outbox), TTL, async.

The chat model always talks to the shared live server; the saver's ``kv_server`` points at a
dead port or a server that never answers where the test says so. SQL side on SQLite and
PostgreSQL.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from sqlalchemy import update
from thread_session_agent import BLOCK_TOKENS, build_agent, lookup_notes, system_prompt, turn_of

from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.checkpoint import AsyncSQLAlchemySaver, SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.store import kv_sessions, op_pending
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions
from langgraph_kvcache.client import SessionNotFoundError

pytestmark = pytest.mark.vllm


def _session_ids(kv: KVCacheClient) -> set[str]:
    return {s.id for s in kv.list_sessions(limit=1000)}


@contextmanager
def _silent_server() -> Iterator[str]:
    """A TCP port that accepts connections (kernel backlog) and never answers: a hung server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _dead_url() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _one_turn(graph: Any, thread: str, run_id: str) -> None:
    config = {"configurable": {"thread_id": thread}}
    graph.invoke({"messages": [system_prompt(run_id), HumanMessage("Item 3?")]}, config)


def test_server_down_or_slow_never_breaks_the_saver(
    lgkv_server: Any,
    db_url: str,
    kv_model: ChatKVCache,
    run_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    down, slow = f"ts-{run_id}-down", f"ts-{run_id}-slow"
    kv = KVCacheClient(lgkv_server.base_url)

    # Down: the saver cannot reach its server; the graph and the SQL state do not care.
    dead = KVSessionOptions(_dead_url(), call_timeout_s=1.0)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=dead) as saver:
        saver.setup()
        graph = build_agent(kv_model, [lookup_notes], saver)
        _one_turn(graph, down, run_id)
        _one_turn(graph, slow, run_id)
        assert {down, slow} <= _session_ids(kv)  # the chat model made them on the live server
        with caplog.at_level(logging.WARNING, "langgraph_kvcache"):
            saver.delete_thread(down)
        assert "KV-cache server unavailable" in caplog.text
        assert saver.get_tuple({"configurable": {"thread_id": down}}) is None
        assert [p.call.op for p in saver._run(op_pending(10))][-1] == "delete"

    # Slow: every call times out; delete_thread still returns and queues behind the others.
    with (
        _silent_server() as hung,
        SQLAlchemySaver.from_conn_string(
            db_url, kv_server=KVSessionOptions(hung, call_timeout_s=0.5)
        ) as saver,
    ):
        saver.delete_thread(slow)
        assert saver.get_tuple({"configurable": {"thread_id": slow}}) is None
        pending = [(p.call.op, p.call.session_id) for p in saver._run(op_pending(10))]
        assert pending[-2:] == [("delete", down), ("delete", slow)]
    assert {down, slow} <= _session_ids(kv)

    # Live again: the next lifecycle operation drains the outbox, in order.
    live = KVSessionOptions(lgkv_server.base_url)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=live) as saver:
        saver.delete_thread(f"ts-{run_id}-never-existed")
        assert saver._run(op_pending(10)) == []
    assert not {down, slow} & _session_ids(kv)
    kv.close()


def test_ttl_expires_threads_and_sessions_together(
    lgkv_server: Any, db_url: str, kv_model: ChatKVCache, run_id: str
) -> None:
    idle, active = f"ts-{run_id}-idle", f"ts-{run_id}-active"
    kv = KVCacheClient(lgkv_server.base_url)
    options = KVSessionOptions(lgkv_server.base_url, ttl_seconds=600)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        saver.setup()
        graph = build_agent(kv_model, [lookup_notes], saver)
        _one_turn(graph, idle, run_id)
        _one_turn(graph, active, run_id)
        assert kv.get_session(idle).ttl_seconds == 600
        assert saver.sweep_expired() == []

        # Twenty minutes pass for the idle thread (only its recorded last use moves).
        with saver.engine.begin() as conn:
            c = kv_sessions.c
            conn.execute(
                update(kv_sessions)
                .where(c.thread_id == idle)
                .values(last_used_at=c.last_used_at - 1200)
            )
        assert saver.sweep_expired() == [idle]
        assert list(saver.list({"configurable": {"thread_id": idle}})) == []
        assert list(saver.list({"configurable": {"thread_id": active}}))
        with pytest.raises(SessionNotFoundError):
            kv.get_session(idle)
        assert kv.get_session(active).num_blocks > 0
        saver.delete_thread(active)
        assert graph.get_state({"configurable": {"thread_id": idle}}).values == {}
    with pytest.raises(SessionNotFoundError):  # reading the swept thread brought nothing back
        kv.get_session(idle)
    kv.close()


def test_reads_never_create_sessions(
    lgkv_server: Any, db_url: str, kv_model: ChatKVCache, run_id: str
) -> None:
    """``get_state`` of a deleted or unknown thread sent POST /v1/sessions (201) and left a
    session (and a session row) behind; now only a stored checkpoint registers a session."""
    gone, unknown = f"ts-{run_id}-gone", f"ts-{run_id}-unknown"
    kv = KVCacheClient(lgkv_server.base_url)
    options = KVSessionOptions(lgkv_server.base_url, ttl_seconds=600, prefetch_interval_s=0)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        saver.setup()
        graph = build_agent(kv_model, [lookup_notes], saver)
        _one_turn(graph, gone, run_id)
        saver.kv_sessions.drain()  # type: ignore[union-attr]
        assert kv.get_session(gone).ttl_seconds == 600  # registered at its first checkpoint
        saver.delete_thread(gone)
        for thread in (gone, unknown, gone):
            config = {"configurable": {"thread_id": thread}}
            assert graph.get_state(config).values == {}
            assert saver.get_tuple(config) is None
        saver.kv_sessions.drain()  # type: ignore[union-attr]
        with saver.engine.connect() as conn:
            rows = conn.execute(kv_sessions.select()).fetchall()
        assert not {gone, unknown} & {r.thread_id for r in rows}
    for _ in range(2):  # a fresh saver (another process) reads them too
        with SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
            assert saver.get_tuple({"configurable": {"thread_id": gone}}) is None
            assert saver.get_tuple({"configurable": {"thread_id": unknown}}) is None
    assert not {gone, unknown} & _session_ids(kv)  # background calls ended with the savers
    kv.close()


async def test_async_saver_keeps_sessions_in_step(
    lgkv_server: Any, db_url: str, kv_model: ChatKVCache, run_id: str
) -> None:
    a, b = f"ts-{run_id}-aa", f"ts-{run_id}-ab"
    kv = KVCacheClient(lgkv_server.base_url)
    options = KVSessionOptions(lgkv_server.base_url, ttl_seconds=900, prefetch_interval_s=0)
    async with AsyncSQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        await saver.setup()
        graph = build_agent(kv_model, [lookup_notes], saver)
        config = {"configurable": {"thread_id": a}}
        first = turn_of(
            await graph.ainvoke(
                {"messages": [system_prompt(run_id), HumanMessage("Item 3?")]}, config
            )
        )
        second = turn_of(await graph.ainvoke({"messages": [HumanMessage("Item 4?")]}, config))
        print(f"\n  async saver, second turn covers {second.cover(first):.1%} of the first")
        # Every full block but the one holding the first prompt's last token: rendered again
        # with the answer after it, that token ("assistant\n") can merge with the answer's
        # first one (a "\n" answer makes "\n\n"), which changes that block's hash.
        assert second.cached >= (first.prompt - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        assert kv.get_session(a).ttl_seconds == 900

        await saver.acopy_thread(a, b)
        assert kv.get_session(b).num_blocks == kv.get_session(a).num_blocks
        await saver.adelete_thread(a)
        await saver.adelete_thread(b)
        assert not {a, b} & _session_ids(kv)
        assert await saver.aget_tuple({"configurable": {"thread_id": b}}) is None
    kv.close()
