"""Small real LangGraph graphs for the checkpointer tests (no LLM: nodes echo and interrupt)."""

from __future__ import annotations

import operator
from typing import Annotated, Any

from langchain_core.messages import AIMessage, AnyMessage
from langgraph.channels import DeltaChannel
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import interrupt
from typing_extensions import TypedDict


class ChatState(TypedDict):
    """Messages (``add_messages``) plus a counter with a plain ``operator.add`` reducer."""

    messages: Annotated[list[AnyMessage], add_messages]
    turns: Annotated[int, operator.add]


def reply(state: ChatState) -> dict[str, Any]:
    """Echo the last message."""
    return {"messages": [AIMessage(f"echo {state['messages'][-1].content}")], "turns": 1}


def approve(state: ChatState) -> dict[str, Any]:
    """Ask a human (``interrupt``) and record the answer."""
    answer = interrupt({"question": "approve?"})
    return {"messages": [AIMessage(f"approved: {answer}")]}


def approval_graph() -> StateGraph:
    """START -> reply -> approve (interrupts) -> END."""
    builder = StateGraph(ChatState)
    builder.add_node("reply", reply)
    builder.add_node("approve", approve)
    builder.add_edge(START, "reply")
    builder.add_edge("reply", "approve")
    builder.add_edge("approve", END)
    return builder


def subgraph_graph() -> StateGraph:
    """START -> reply -> child (a compiled subgraph whose node interrupts) -> END."""
    child = approval_graph().compile()
    builder = StateGraph(ChatState)
    builder.add_node("reply", reply)
    builder.add_node("child", child)
    builder.add_edge(START, "reply")
    builder.add_edge("reply", "child")
    builder.add_edge("child", END)
    return builder


def _concat(state: list[str], batches: list[list[str]]) -> list[str]:
    return state + [item for batch in batches for item in batch]


class DeltaState(TypedDict):
    """A log kept in a ``DeltaChannel`` (rebuilt from ancestor writes)."""

    log: Annotated[list[str], DeltaChannel(_concat, snapshot_frequency=3)]


def delta_graph() -> StateGraph:
    """One node appending to a DeltaChannel log each turn."""

    def append(state: DeltaState) -> dict[str, Any]:
        return {"log": [f"turn {len(state.get('log') or [])}"]}

    builder = StateGraph(DeltaState)
    builder.add_node("append", append)
    builder.add_edge(START, "append")
    builder.add_edge("append", END)
    return builder
