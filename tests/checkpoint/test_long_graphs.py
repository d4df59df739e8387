"""Real graphs on the append-aware storage: a 1000-checkpoint ``MessagesState`` thread, a
ReAct-style agent with tool calls and tool messages (``ToolNode``), and a subgraph that
interrupts and resumes, sync and async, each compared with LangGraph's ``InMemorySaver``
running the same graph, and read back by a saver that remembers nothing."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, interrupt
from sqlalchemy import func, select

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.list_rows import ITEMS_TYPE, split_digests
from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, items
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


def _shape(messages: list[BaseMessage]) -> list[tuple[str, Any, Any]]:
    """What two runs of a graph must agree on (ids are random per run)."""
    return [(m.type, m.content, getattr(m, "tool_calls", None)) for m in messages]


def echo_graph() -> StateGraph:
    def echo(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(f"echo {state['messages'][-1].content}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("echo", echo)
    builder.add_edge(START, "echo")
    return builder


def test_thousand_checkpoint_thread(db_url: str) -> None:
    turns = 334  # three checkpoints per turn (input, start, echo): 1002; two messages per turn
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        graph = echo_graph().compile(checkpointer=saver)
        cfg = {"configurable": {"thread_id": "long"}}
        for i in range(turns):
            graph.invoke({"messages": [HumanMessage(f"q{i} " + "word " * 60)]}, cfg)
        history = list(graph.get_state_history(cfg, limit=6))
        assert [len(s.values["messages"]) for s in history] == [668, 667, 666, 666, 665, 664]
        with saver.engine.connect() as conn:
            n_checkpoints = conn.execute(select(func.count()).select_from(checkpoints)).scalar_one()
            n_items = conn.execute(select(func.count()).select_from(items)).scalar_one()
            digest_bytes = conn.execute(
                select(func.sum(func.length(blobs.c.blob))).where(blobs.c.type == ITEMS_TYPE)
            ).scalar_one()
            chains = conn.execute(select(blobs.c.blob).where(blobs.c.type == ITEMS_TYPE)).all()
        listed = {d for (blob,) in chains for d in split_digests(bytes(blob))}
        assert n_checkpoints == 3 * turns
        assert len(listed) == 2 * turns  # each message of the list once
        # The nodes' writes are stored as item references too; their messages are other items
        # here (add_messages gives them ids after the write), so at most one more each.
        assert len(listed) <= n_items <= 4 * turns
        # Whole lists per version would be ~330k digests (5 MB); chains keep it linear.
        assert digest_bytes < 16 * n_checkpoints * 40
        final = history[0].values["messages"]
        oldest = list(saver.list(cfg))[-1].config
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:
        graph = echo_graph().compile(checkpointer=fresh)
        assert graph.get_state(cfg).values["messages"] == final
        middle = [s for s in graph.get_state_history(cfg, limit=505)][-1]
        assert middle.values["messages"] == final[: len(middle.values["messages"])]
        assert graph.get_state(oldest).values["messages"] == []


@tool
def lookup(city: str) -> str:
    """The weather in ``city``."""
    return f"sunny in {city}"


def react_graph() -> StateGraph:
    """model -> tools (ToolNode) -> model ... until the model answers without tool calls."""

    def model(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        turn = len(state["messages"])
        if isinstance(last, HumanMessage):
            call = {"name": "lookup", "args": {"city": last.content}, "id": f"call-{turn}"}
            return {"messages": [AIMessage("", tool_calls=[call])]}
        assert isinstance(last, ToolMessage)
        return {"messages": [AIMessage(f"answer: {last.content}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder


def _run_react(saver: Any, cities: list[str]) -> tuple[Any, list[Any]]:
    graph = react_graph().compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "agent"}}
    for city in cities:
        graph.invoke({"messages": [HumanMessage(city)]}, cfg)
    return graph.get_state(cfg), list(graph.get_state_history(cfg))


def test_react_agent_with_tool_messages(db_url: str) -> None:
    cities = [f"city {i}" for i in range(30)]
    plain_state, plain_history = _run_react(InMemorySaver(), cities)
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=7) as saver:
        saver.setup()
        state, history = _run_react(saver, cities)
    assert _shape(state.values["messages"]) == _shape(plain_state.values["messages"])
    assert len(state.values["messages"]) == 4 * len(cities)
    assert [_shape(s.values.get("messages", [])) for s in history] == [
        _shape(s.values.get("messages", [])) for s in plain_history
    ]
    assert [s.next for s in history] == [s.next for s in plain_history]
    with SQLAlchemySaver.from_conn_string(db_url) as fresh:
        graph = react_graph().compile(checkpointer=fresh)
        for old in history:
            assert graph.get_state(old.config).values == old.values


def subgraph_agent() -> StateGraph:
    """reply -> child (a MessagesState subgraph that asks a human, then answers) -> END."""

    def ask(state: MessagesState) -> dict[str, Any]:
        answer = interrupt({"question": f"ok after {len(state['messages'])}?"})
        return {"messages": [AIMessage(f"human said {answer}")]}

    child = StateGraph(MessagesState)
    child.add_node("ask", ask)
    child.add_edge(START, "ask")
    child.add_edge("ask", END)

    def reply(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(f"reply {len(state['messages'])}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("reply", reply)
    builder.add_node("child", child.compile())
    builder.add_edge(START, "reply")
    builder.add_edge("reply", "child")
    builder.add_edge("child", END)
    return builder


async def test_subgraph_interrupts_and_resumes_async(db_url: str) -> None:
    async def run(saver: Any) -> tuple[list[Any], list[Any]]:
        graph = subgraph_agent().compile(checkpointer=saver)
        cfg = {"configurable": {"thread_id": "sub"}}
        for i in range(12):
            out = await graph.ainvoke({"messages": [HumanMessage(f"turn {i}")]}, cfg)
            assert out["__interrupt__"][0].value == {"question": f"ok after {3 * i + 2}?"}
            paused = await graph.aget_state(cfg, subgraphs=True)
            assert paused.tasks[0].state.values["messages"][-1].content == f"reply {3 * i + 1}"
            await graph.ainvoke(Command(resume=f"yes {i}"), cfg)
        final = (await graph.aget_state(cfg)).values["messages"]
        history = [s async for s in graph.aget_state_history(cfg)]
        return final, history

    plain_final, plain_history = await run(InMemorySaver())
    async with AsyncSQLAlchemySaver.from_conn_string(db_url, snapshot_every=5) as saver:
        await saver.setup()
        final, history = await run(saver)
    assert _shape(final) == _shape(plain_final)
    assert final[-1].content == "human said yes 11"
    assert [_shape(s.values.get("messages", [])) for s in history] == [
        _shape(s.values.get("messages", [])) for s in plain_history
    ]
