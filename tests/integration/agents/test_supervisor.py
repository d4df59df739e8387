"""A supervisor graph with two sub-agents keeps one KV session per agent.

The sub-agents (a researcher and a writer) are subgraphs with their own message lists, compiled
with ``checkpointer=True`` so each keeps its history across the parent's runs. ``ChatKVCache``
names each agent's session ``"<thread>|<agent>"`` from the running subgraph's namespace, so each
agent's second call hits on its own earlier context, whatever the other agent did in between.
The saver (``kv_server=``) forks and deletes the sessions of every namespace with the thread.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from agent_tools import articles, lookup
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.checkpoint import SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions
from langgraph_kvcache.sessions import session_id_for

pytestmark = pytest.mark.vllm

COVER = 0.9
AGENTS = ("researcher", "writer")
TASKS = ("Find what the encyclopedia says about the Atom.", "Now do the same for Astronomy.")


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class TeamState(TypedDict):
    task: str
    reports: Annotated[list[str], operator.add]


def agent_graph(model: ChatKVCache, role: str) -> Any:
    """A one-node sub-agent that answers from its own message list (kept across runs)."""
    prompt = SystemMessage(
        f"You are the team's {role}. Be brief. Articles you may cite: " + "; ".join(articles())
    )

    def work(state: AgentState) -> dict[str, Any]:
        history = state["messages"]
        return {"messages": [model.invoke([prompt, *history])]}

    builder = StateGraph(AgentState)
    builder.add_node("work", work)
    builder.add_edge(START, "work")
    return builder.compile(checkpointer=True)


def team_graph(model: ChatKVCache, answers: dict[str, list[AIMessage]]) -> StateGraph:
    """supervisor -> researcher -> writer: each sub-agent is invoked with its own input; each
    answer is appended to ``answers[agent]``."""
    researcher, writer = agent_graph(model, "researcher"), agent_graph(model, "writer")

    def supervisor(state: TeamState) -> dict[str, Any]:
        return {"reports": [f"supervisor: assigned {state['task']!r}"]}

    def research(state: TeamState) -> dict[str, Any]:
        notes = lookup.invoke({"title": state["task"]})
        ask = HumanMessage(f"Task: {state['task']}\nNotes: {notes}\nSummarise the notes.")
        out = researcher.invoke({"messages": [ask]})
        answers["researcher"].append(out["messages"][-1])
        return {"reports": [f"researcher: {out['messages'][-1].content}"]}

    def write(state: TeamState) -> dict[str, Any]:
        ask = HumanMessage(f"Write one sentence for a reader about: {state['reports'][-1]}")
        out = writer.invoke({"messages": [ask]})
        answers["writer"].append(out["messages"][-1])
        return {"reports": [f"writer: {out['messages'][-1].content}"]}

    builder = StateGraph(TeamState)
    builder.add_node("supervisor", supervisor)
    builder.add_node("researcher", research)
    builder.add_node("writer", write)
    builder.add_edge(START, "supervisor")
    builder.add_edge("supervisor", "researcher")
    builder.add_edge("researcher", "writer")
    builder.add_edge("writer", END)
    return builder


def test_each_agent_hits_its_own_history(
    agent_model: ChatKVCache, smollm2_server: Any, tmp_path: Path, run_id: str
) -> None:
    thread, fork = f"team-{run_id}", f"team-{run_id}-fork"
    options = KVSessionOptions(smollm2_server.base_url)
    kv = KVCacheClient(smollm2_server.base_url)
    answers: dict[str, list[AIMessage]] = {a: [] for a in AGENTS}
    db = f"sqlite:///{tmp_path / 'team.db'}"
    with SQLAlchemySaver.from_conn_string(db, kv_server=options) as saver:
        saver.setup()
        graph = team_graph(agent_model, answers).compile(checkpointer=saver)
        config = {"configurable": {"thread_id": thread}}
        for task in TASKS:
            graph.invoke({"task": task}, config)

        sessions = {s.id: s for s in kv.list_sessions(limit=1000)}
        ids = {agent: session_id_for(thread, agent) for agent in AGENTS}
        for agent, calls in answers.items():
            assert len(calls) == len(TASKS), (agent, [c.content for c in calls])
            first, second = calls[0].usage_metadata, calls[1].usage_metadata
            assert first and second
            context = first["input_tokens"] + first["output_tokens"]
            cached = second["input_token_details"]["cache_read"]
            print(
                f"  {agent}: first call {context} tokens, second call cached {cached} "
                f"({cached / context:.3f}) of it; session {ids[agent]}"
            )
            assert second["input_tokens"] > context, "the agent lost its own history"
            assert cached >= COVER * context, (agent, context, cached)
            assert ids[agent] in sessions and sessions[ids[agent]].turns >= len(TASKS)

        saver.copy_thread(thread, fork)
        forked = {s.id: s for s in kv.list_sessions(limit=1000)}
        for agent in AGENTS:
            copy = forked[session_id_for(fork, agent)]
            assert copy.num_blocks == forked[ids[agent]].num_blocks > 0
        saver.delete_thread(thread)
        saver.delete_thread(fork)
        left = {s.id for s in kv.list_sessions(limit=1000)}
        gone = {session_id_for(t, a) for t in (thread, fork) for a in ("", *AGENTS)}
        assert not gone & left, gone & left
    kv.close()
