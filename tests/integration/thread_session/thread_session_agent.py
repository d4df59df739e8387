"""The agent and the probes the thread <-> server session tests share.

The agent is a ReAct loop built from ``StateGraph`` + ``ToolNode``: on the user's turn it calls
the tool the run names (``configurable["tool"]``, default ``lookup_notes``) with the user's text,
since a 2-layer random model cannot write a tool call (under ``tool_choice="required"`` it
fills the arguments with whitespace until ``max_tokens``); after the tool result it answers
with the model, tools still bound (``tool_choice="none"``) so every prompt of the thread starts
with the same system turn and the KV of the history is reusable.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from benchmarks.agent_streams import Call
from langgraph_kvcache import ChatKVCache

BLOCK_TOKENS = 128
ANSWER_TOKENS = 8


# ----------------------------------------------------------------------------- the agent
class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def system_prompt(run: str) -> SystemMessage:
    """About 1200 tokens, unique to ``run`` so its KV blocks belong to this test alone.

    Long enough that a whole-block cache hit (128-token blocks) covers over 90% of a turn."""
    facts = " ".join(f"Fact {i}: item {i} weighs {i * 7 % 97} grams." for i in range(60))
    return SystemMessage(f"Run {run}. You are a terse assistant; answer in one line. {facts}")


@tool
def lookup_notes(query: str) -> str:
    """Look up the team's notes about a question."""
    words = query.split()
    return f"Notes on {' '.join(words[:6])}: item {len(words)} weighs {len(query) % 97} grams."


def make_search_tool(index: Any) -> BaseTool:
    """A retrieval tool over ``examples/rag.py``'s Wikipedia index (one passage, 60 words)."""

    @tool
    def search_wikipedia(query: str) -> str:
        """Search Wikipedia passages relevant to a question."""
        chunk = index.search(query, k=1)[0]
        return f"[{chunk.title}] {' '.join(chunk.text.split()[:60])}"

    return search_wikipedia


def build_agent(
    model: ChatKVCache, tools: list[BaseTool], checkpointer: BaseCheckpointSaver[Any]
) -> CompiledStateGraph:
    """The ReAct loop of the module docstring."""
    answerer = model.bind_tools(tools, tool_choice="none")

    def agent(state: AgentState, config: RunnableConfig) -> dict[str, Any]:
        messages = state["messages"]
        if isinstance(messages[-1], HumanMessage):
            name = config["configurable"].get("tool", "lookup_notes")
            call = {"name": name, "args": {"query": messages[-1].content}, "id": "call_0"}
            call["id"] = f"call_{len(messages)}"
            return {"messages": [AIMessage(content="", tool_calls=[call])]}
        return {"messages": [answerer.invoke(messages, max_tokens=ANSWER_TOKENS)]}

    builder = StateGraph(AgentState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


Turn = Call
"""Token counts of a turn's answering model call; ``cover(previous)``: the share of the previous
turn's context (prompt + completion) read from the cache."""


def turn_of(result: dict[str, Any]) -> Turn:
    """The usage of the last answer in a graph result."""
    answer = result["messages"][-1]
    assert isinstance(answer, AIMessage) and answer.usage_metadata, answer
    usage = answer.usage_metadata
    return Turn(
        prompt=usage["input_tokens"],
        completion=usage["output_tokens"],
        cached=usage.get("input_token_details", {}).get("cache_read", 0),
    )


# ----------------------------------------------------------------------------- KV on the server
def registry_keys(cache_dir: Path) -> dict[str, set[str]]:
    """Block keys of every session in the server's registry, by session id (read-only)."""
    uri = f"file:{cache_dir / 'sessions.sqlite3'}?mode=ro"
    with sqlite3.connect(uri, uri=True, timeout=30) as db:
        rows = db.execute("SELECT session_id, key FROM session_blocks").fetchall()
    out: dict[str, set[str]] = {}
    for sid, key in rows:
        out.setdefault(sid, set()).add(key)
    return out


def block_files(cache_dir: Path) -> dict[str, Path]:
    """Block key -> file of every block in the server's disk tier."""
    return {p.stem: p for p in (cache_dir / "blocks").rglob("*.kvb")}
