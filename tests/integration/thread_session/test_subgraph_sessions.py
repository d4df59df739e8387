"""A subgraph that calls the model has its own session (``"<thread>|<node>"``); the saver
copies and deletes it with its thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langgraph.graph import START, StateGraph
from thread_session_agent import AgentState, system_prompt

from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.checkpoint import SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions
from langgraph_kvcache.sessions import session_id_for

pytestmark = pytest.mark.vllm


def test_subgraph_sessions_follow_their_thread(
    lgkv_server: Any, tmp_path: Path, kv_model: ChatKVCache, run_id: str
) -> None:
    def think(state: AgentState) -> dict[str, Any]:
        return {"messages": [kv_model.invoke(state["messages"], max_tokens=4)]}

    sub = StateGraph(AgentState)
    sub.add_node("think", think)
    sub.add_edge(START, "think")
    parent = StateGraph(AgentState)
    parent.add_node("chat", think)
    parent.add_node("research", sub.compile())
    parent.add_edge(START, "chat")
    parent.add_edge("chat", "research")

    t, u = f"ts-{run_id}-t", f"ts-{run_id}-u"
    sessions = [session_id_for(t), session_id_for(t, "research"), session_id_for(u)]
    sessions.append(session_id_for(u, "research"))
    kv = KVCacheClient(lgkv_server.base_url)
    options = KVSessionOptions(lgkv_server.base_url)
    db = f"sqlite:///{tmp_path / 'sub.db'}"
    with SQLAlchemySaver.from_conn_string(db, kv_server=options) as saver:
        saver.setup()
        graph = parent.compile(checkpointer=saver)
        config = {"configurable": {"thread_id": t}}
        graph.invoke({"messages": [system_prompt(run_id), HumanMessage("Item 3?")]}, config)
        assert {s.id for s in kv.list_sessions(limit=1000)} >= set(sessions[:2])

        saver.copy_thread(t, u)
        copies = {s.id: s for s in kv.list_sessions(limit=1000)}
        for source, target in ((sessions[0], sessions[2]), (sessions[1], sessions[3])):
            assert copies[target].num_blocks == copies[source].num_blocks > 0

        saver.delete_thread(t)
        saver.delete_thread(u)
        assert not set(sessions) & {s.id for s in kv.list_sessions(limit=1000)}
    kv.close()
