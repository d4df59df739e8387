"""Real LangGraph graphs on both savers and both databases.

Interrupt and resume (``interrupt()`` + ``Command(resume=...)``), replay from an older
checkpoint, an ``update_state`` fork, a subgraph (checkpoint namespaces), state history, and a
``DeltaChannel`` thread, sync (``SQLAlchemySaver`` + ``invoke``) and async
(``AsyncSQLAlchemySaver`` + ``ainvoke``).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from checkpoint_graphs import approval_graph, delta_graph, subgraph_graph
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.types import Command

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


def _contents(state: dict[str, Any]) -> list[str]:
    return [m.content for m in state["messages"]]


def _ancestors(saver: SQLAlchemySaver, config: dict[str, Any]) -> list[str]:
    """Checkpoint ids on the parent chain of ``config`` (following ``parent_config``)."""
    ids = []
    found = saver.get_tuple(config)
    while found is not None and found.parent_config is not None:
        ids.append(found.parent_config["configurable"]["checkpoint_id"])
        found = saver.get_tuple(found.parent_config)
    return ids


def _cfg(thread_id: str, **extra: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id, **extra}}


def test_interrupt_replay_fork_history_sync(db_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        graph = approval_graph().compile(checkpointer=saver)
        cfg = _cfg("t1")

        out = graph.invoke({"messages": [HumanMessage("hi")]}, cfg)
        assert out["__interrupt__"][0].value == {"question": "approve?"}
        paused = graph.get_state(cfg)
        assert paused.next == ("approve",)
        assert paused.tasks[0].interrupts[0].value == {"question": "approve?"}

        out = graph.invoke(Command(resume="yes"), cfg)
        assert _contents(out) == ["hi", "echo hi", "approved: yes"]
        assert out["turns"] == 1

        history = list(graph.get_state_history(cfg))
        assert [s.metadata["step"] for s in history] == [2, 1, 0, -1]
        assert history[0].values == out
        for newer, older in itertools.pairwise(history):
            assert (
                newer.parent_config["configurable"]["checkpoint_id"]
                == (older.config["configurable"]["checkpoint_id"])
            )

        # Replay from the checkpoint taken before "reply" ran: re-runs it and interrupts again.
        before_reply = next(s for s in history if s.next == ("reply",))
        out = graph.invoke(None, before_reply.config)
        assert out["__interrupt__"]
        replayed = graph.get_state(cfg)
        assert _contents(replayed.values) == ["hi", "echo hi"]
        assert before_reply.config["configurable"]["checkpoint_id"] in _ancestors(
            saver, replayed.config
        )

        # Fork: edit the state at the paused checkpoint, then resume the fork.
        paused_cfg = next(s for s in history if s.next == ("approve",)).config
        fork_cfg = graph.update_state(paused_cfg, {"messages": [HumanMessage("edited")]})
        fork = graph.get_state(fork_cfg)
        assert (
            fork.parent_config["configurable"]["checkpoint_id"]
            == (paused_cfg["configurable"]["checkpoint_id"])
        )
        out = graph.invoke(Command(resume="ok"), fork_cfg)
        assert _contents(out) == ["hi", "echo hi", "edited", "approved: ok"]
        # The original branch is untouched.
        assert _contents(graph.get_state(history[0].config).values) == [
            "hi",
            "echo hi",
            "approved: yes",
        ]
        assert len(list(graph.get_state_history(cfg))) > len(history)


async def test_interrupt_replay_fork_history_async(db_url: str) -> None:
    async with AsyncSQLAlchemySaver.from_conn_string(db_url) as saver:
        await saver.setup()
        graph = approval_graph().compile(checkpointer=saver)
        cfg = _cfg("t1")

        out = await graph.ainvoke({"messages": [HumanMessage("hi")]}, cfg)
        assert out["__interrupt__"][0].value == {"question": "approve?"}
        assert (await graph.aget_state(cfg)).next == ("approve",)
        out = await graph.ainvoke(Command(resume="yes"), cfg)
        assert _contents(out) == ["hi", "echo hi", "approved: yes"]

        history = [s async for s in graph.aget_state_history(cfg)]
        assert [s.metadata["step"] for s in history] == [2, 1, 0, -1]
        limited = [s async for s in graph.aget_state_history(cfg, limit=2)]
        assert [s.config for s in limited] == [s.config for s in history[:2]]
        inputs = [s async for s in graph.aget_state_history(cfg, filter={"source": "input"})]
        assert [s.metadata["step"] for s in inputs] == [-1]

        before_reply = next(s for s in history if s.next == ("reply",))
        out = await graph.ainvoke(None, before_reply.config)
        assert out["__interrupt__"]

        paused_cfg = next(s for s in history if s.next == ("approve",)).config
        fork_cfg = await graph.aupdate_state(paused_cfg, {"messages": [HumanMessage("edited")]})
        out = await graph.ainvoke(Command(resume="ok"), fork_cfg)
        assert _contents(out) == ["hi", "echo hi", "edited", "approved: ok"]


def _check_subgraph_state(saver: Any, state: Any, cfg: dict[str, Any]) -> str:
    """The paused parent has one task whose subgraph state lives in a child namespace."""
    assert state.next == ("child",)
    child = state.tasks[0].state
    ns = child.config["configurable"]["checkpoint_ns"]
    assert ns.startswith("child:")
    assert child.next == ("approve",)
    assert _contents(child.values) == ["hi", "echo hi", "echo echo hi"]
    return ns


def test_subgraph_namespaces_sync(db_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        graph = subgraph_graph().compile(checkpointer=saver)
        cfg = _cfg("sub")
        out = graph.invoke({"messages": [HumanMessage("hi")]}, cfg)
        assert out["__interrupt__"]
        ns = _check_subgraph_state(saver, graph.get_state(cfg, subgraphs=True), cfg)
        child_rows = list(saver.list(_cfg("sub", checkpoint_ns=ns)))
        assert child_rows and all(
            t.config["configurable"]["checkpoint_ns"] == ns for t in child_rows
        )
        root_rows = list(saver.list(_cfg("sub", checkpoint_ns="")))
        assert len(list(saver.list(_cfg("sub")))) == len(child_rows) + len(root_rows)

        out = graph.invoke(Command(resume="sub-yes"), cfg)
        assert _contents(out)[-1] == "approved: sub-yes"
        saver.delete_thread("sub")
        assert list(saver.list(_cfg("sub"))) == []


async def test_subgraph_namespaces_async(db_url: str) -> None:
    async with AsyncSQLAlchemySaver.from_conn_string(db_url) as saver:
        await saver.setup()
        graph = subgraph_graph().compile(checkpointer=saver)
        cfg = _cfg("sub")
        await graph.ainvoke({"messages": [HumanMessage("hi")]}, cfg)
        ns = _check_subgraph_state(saver, await graph.aget_state(cfg, subgraphs=True), cfg)
        assert [t async for t in saver.alist(_cfg("sub", checkpoint_ns=ns))]
        out = await graph.ainvoke(Command(resume="sub-yes"), cfg)
        assert _contents(out)[-1] == "approved: sub-yes"


def test_delta_channel_thread_sync(db_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        graph = delta_graph().compile(checkpointer=saver)
        cfg = _cfg("delta")
        for _ in range(7):
            graph.invoke({"log": []}, cfg)
    # A new saver on the same database rebuilds the log from stored writes and snapshots.
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        graph = delta_graph().compile(checkpointer=saver)
        log = graph.get_state(cfg).values["log"]
        assert log == [f"turn {i}" for i in range(7)]
        # The one-connection override returns what the base class's generic walk returns.
        ours = saver.get_delta_channel_history(config=cfg, channels=["log", "missing"])
        generic = BaseCheckpointSaver.get_delta_channel_history(
            saver, config=cfg, channels=["log", "missing"]
        )
        assert ours == generic
        assert ours["missing"] == {"writes": []}
        assert ours["log"]["writes"] or "seed" in ours["log"]
        with pytest.raises(NotImplementedError, match="DeltaChannel"):
            saver.prune(["delta"], strategy="keep_latest")


async def test_delta_channel_thread_async(db_url: str) -> None:
    cfg = _cfg("delta")
    async with AsyncSQLAlchemySaver.from_conn_string(db_url) as saver:
        await saver.setup()
        graph = delta_graph().compile(checkpointer=saver)
        for _ in range(5):
            await graph.ainvoke({"log": []}, cfg)
        state = await graph.aget_state(cfg)
        assert state.values["log"] == [f"turn {i}" for i in range(5)]
        ours = await saver.aget_delta_channel_history(config=cfg, channels=["log"])
        generic = await BaseCheckpointSaver.aget_delta_channel_history(
            saver, config=cfg, channels=["log"]
        )
        assert ours == generic


async def test_sync_saver_under_ainvoke(sqlite_url: str) -> None:
    """The sync saver's async methods (worker threads) serve ``ainvoke``."""
    with SQLAlchemySaver.from_conn_string(sqlite_url) as saver:
        saver.setup()
        graph = approval_graph().compile(checkpointer=saver)
        await graph.ainvoke({"messages": [HumanMessage("hi")]}, _cfg("x"))
        out = await graph.ainvoke(Command(resume="y"), _cfg("x"))
        assert _contents(out) == ["hi", "echo hi", "approved: y"]


async def test_async_saver_sync_methods_from_threads(sqlite_url: str) -> None:
    """The async saver's sync methods work from another thread, not from the loop's."""
    import asyncio

    async with AsyncSQLAlchemySaver.from_conn_string(sqlite_url) as saver:
        await saver.setup()
        graph = approval_graph().compile(checkpointer=saver)
        await graph.ainvoke({"messages": [HumanMessage("hi")]}, _cfg("x"))
        state = await asyncio.to_thread(graph.get_state, _cfg("x"))
        assert state.next == ("approve",)
        with pytest.raises(asyncio.InvalidStateError, match="async interface"):
            saver.get_tuple(_cfg("x"))
