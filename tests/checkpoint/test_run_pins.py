"""Run pins, the checkpointer's side: which checkpoints end a run, and which calls a run owes.

:func:`has_pending_tasks` judges from a stored checkpoint alone whether its graph has tasks to
run; here every checkpoint real graphs store (linear, a tool loop, ``Send`` fan-out, a join
of two branches, ``interrupt()`` and resume, ``interrupt_before``, a subgraph) is checked
against LangGraph's own answer for it (``get_state``: ``next`` for the latest checkpoint, the
tasks of each older one). :class:`RunPins` then owes a pin at a run's first checkpoint, no
call for most later ones, an unpin at its last, an interrupt lease for ``interrupt()``.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

import pytest
from checkpoint_graphs import approval_graph, subgraph_graph
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send
from sqlalchemy import create_engine
from typing_extensions import TypedDict

from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions
from langgraph_kvcache.checkpoint.sessions.pins import PinCall, RunPins, has_pending_tasks
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


class Recording(SQLAlchemySaver):
    """A plain saver that keeps each checkpoint it stored, with the config naming it."""

    def __init__(self, url: str) -> None:
        super().__init__(create_engine(url))
        self.stored: list[tuple[RunnableConfig, Checkpoint]] = []

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        saved = super().put(config, checkpoint, metadata, new_versions)
        self.stored.append((saved, checkpoint))
        return saved


class Counter(TypedDict):
    n: Annotated[list[int], operator.add]


def _add(value: int) -> Any:
    return lambda state: {"n": [value]}


def _loop() -> StateGraph:
    """model -> tools -> model ... three times, then END (a ReAct-shaped loop)."""
    g = StateGraph(Counter)
    g.add_node("model", _add(1))
    g.add_node("tools", _add(2))
    g.add_edge(START, "model")
    g.add_conditional_edges("model", lambda s: "tools" if len(s["n"]) < 6 else END)
    g.add_edge("tools", "model")
    return g


def _fan_out_and_join() -> StateGraph:
    """a fans out to b twice (Send), a and b join into c."""
    g = StateGraph(Counter)
    g.add_node("a", _add(1))
    g.add_node("b", _add(2))
    g.add_node("c", _add(3))
    g.add_edge(START, "a")
    g.add_conditional_edges("a", lambda s: [Send("b", {"n": [7]}), Send("b", {"n": [8]})], ["b"])
    g.add_edge(["a", "b"], "c")
    g.add_edge("c", END)
    return g


def _check_every_checkpoint(graph: Any, saver: Recording, thread: dict[str, Any]) -> int:
    """Compare :func:`has_pending_tasks` with LangGraph on each checkpoint stored so far."""
    latest = graph.get_state(thread)
    assert saver.stored, "the graph stored no checkpoint"
    for config, checkpoint in saver.stored:
        if config["configurable"]["checkpoint_ns"]:
            continue  # a subgraph's checkpoints: checked through its parent's snapshot
        snapshot = graph.get_state(config)
        is_latest = (
            snapshot.config["configurable"]["checkpoint_id"]
            == (latest.config["configurable"]["checkpoint_id"])
        )
        expected = bool(latest.next) if is_latest else bool(snapshot.tasks)
        assert has_pending_tasks(checkpoint) == expected, (snapshot.metadata, snapshot.next)
    return len(saver.stored)


@pytest.mark.parametrize(
    ("name", "build", "compile_kw", "inputs"),
    [
        ("loop", _loop, {}, [{"n": []}]),
        ("fan-out and join", _fan_out_and_join, {}, [{"n": []}]),
        ("interrupt", approval_graph, {}, ["hi", Command(resume="yes")]),
        ("interrupt_before", approval_graph, {"interrupt_before": ["approve"]}, ["hi"]),
        ("subgraph", subgraph_graph, {}, ["hi", Command(resume="ok")]),
    ],
)
def test_pending_tasks_match_langgraph(
    sqlite_url: str, name: str, build: Any, compile_kw: dict[str, Any], inputs: list[Any]
) -> None:
    saver = Recording(sqlite_url)
    saver.setup()
    graph = build().compile(checkpointer=saver, **compile_kw)
    thread = {"configurable": {"thread_id": f"t-{name}"}}
    for value in inputs:
        if isinstance(value, str):
            value = {"messages": [HumanMessage(value)], "turns": 0}
        graph.invoke(value, thread)
        assert _check_every_checkpoint(graph, saver, thread) >= 2
    saver.engine.dispose()


def _calls(pins: RunPins, saver: Recording, start: int) -> list[PinCall]:
    out = []
    for config, checkpoint in saver.stored[start:]:
        call = pins.on_checkpoint(config, checkpoint)
        if call is not None:
            out.append(call)
    return out


def test_a_run_owes_one_pin_and_one_unpin(sqlite_url: str) -> None:
    saver = Recording(sqlite_url)
    saver.setup()
    graph = _loop().compile(checkpointer=saver)
    thread = {"configurable": {"thread_id": "r"}}
    graph.invoke({"n": []}, thread)
    assert len(saver.stored) >= 7  # input plus a checkpoint per step
    pins = RunPins(run_pin_s=300, interrupt_pin_s=3600)
    calls = _calls(pins, saver, 0)
    assert [(c.session_id, c.lease_s) for c in calls] == [("r", 300), ("r", None)]
    graph.invoke({"n": []}, thread)  # a second run: ends at once (n has 6+), pin then unpin
    assert [c.lease_s for c in _calls(pins, saver, len(saver.stored) - 2)] == [300, None]
    saver.engine.dispose()


def test_interrupt_lease_outlasts_the_resumed_run_until_its_end(sqlite_url: str) -> None:
    saver = Recording(sqlite_url)
    saver.setup()
    graph = approval_graph().compile(checkpointer=saver)
    thread = {"configurable": {"thread_id": "h"}}
    pins = RunPins(run_pin_s=300, interrupt_pin_s=3600)
    graph.invoke({"messages": [HumanMessage("hi")], "turns": 0}, thread)
    assert [c.lease_s for c in _calls(pins, saver, 0)] == [300]  # the run is on at its end
    config = saver.stored[-1][0]
    assert pins.on_writes(config, [("messages", [])]) is None
    interrupted = pins.on_writes(config, [("__interrupt__", ())])
    assert interrupted is not None and interrupted.lease_s == 3600
    seen = len(saver.stored)
    graph.invoke(Command(resume="yes"), thread)
    assert [c.lease_s for c in _calls(pins, saver, seen)] == [None]  # only the release
    assert pins.on_writes(config, [("__error__", ValueError())]) is None  # nothing held now
    saver.engine.dispose()


def test_an_error_releases_and_a_failed_pin_is_asked_again(sqlite_url: str) -> None:
    pins = RunPins(run_pin_s=10, interrupt_pin_s=20)
    config: dict[str, Any] = {"configurable": {"thread_id": "e", "checkpoint_ns": "sub:task1"}}
    running = {"channel_values": {"branch:to:x": None}, "channel_versions": {"branch:to:x": 2}}
    first = pins.on_checkpoint(config, running)  # type: ignore[arg-type]
    assert first == PinCall(("e", "sub"), "e|sub", 10)
    assert pins.on_checkpoint(config, running) is None  # the lease is fresh: no call
    pins.failed(first)  # e.g. no session yet (the LLM has not been called)
    assert pins.on_checkpoint(config, running) == first
    released = pins.on_writes(config, [("__error__", ValueError("boom"))])
    assert released == PinCall(("e", "sub"), "e|sub", None)


def test_the_failed_steps_checkpoint_stored_after_the_error_asks_for_no_pin(
    sqlite_url: str,
) -> None:
    """LangGraph stores a step's checkpoint and a task's writes on different background
    threads, so the ``ERROR`` write of a failing node may be stored before the checkpoint it
    is written against (seen in the suite: the run's session stayed pinned for the run lease
    after the error). That late checkpoint asks for nothing; a retried run pins again."""
    saver = Recording(sqlite_url)
    saver.setup()
    fail = {"on": True}

    def flaky(state: Counter) -> dict[str, Any]:
        if fail["on"]:
            raise RuntimeError("the tool failed")
        return {"n": [2]}

    g = StateGraph(Counter)
    g.add_node("model", _add(1))
    g.add_node("tools", flaky)
    g.add_edge(START, "model")
    g.add_edge("model", "tools")
    g.add_edge("tools", END)
    graph = g.compile(checkpointer=saver)
    thread = {"configurable": {"thread_id": "f"}}
    with pytest.raises(RuntimeError):
        graph.invoke({"n": []}, thread)
    *earlier, (failing_config, failing_step) = saver.stored
    assert has_pending_tasks(failing_step)  # ``tools`` is still to run
    pins = RunPins(run_pin_s=300, interrupt_pin_s=3600)
    calls = [pins.on_checkpoint(c, cp) for c, cp in earlier]
    assert [c.lease_s for c in calls if c is not None] == [300]
    released = pins.on_writes(failing_config, [("__error__", RuntimeError("the tool failed"))])
    assert released is not None and released.lease_s is None
    assert pins.on_checkpoint(failing_config, failing_step) is None  # stored late: no pin
    fail["on"] = False
    seen = len(saver.stored)
    graph.invoke(None, thread)  # the retry runs ``tools`` and ends
    assert _calls(pins, saver, seen) == []  # it ends at its first checkpoint; nothing held
    seen = len(saver.stored)
    graph.invoke({"n": []}, thread)  # a new run pins and releases as usual
    assert [c.lease_s for c in _calls(pins, saver, seen)] == [300, None]
    saver.engine.dispose()


def test_options_validate_leases() -> None:
    assert KVSessionOptions("http://x").interrupt_lease_s == 3600
    assert KVSessionOptions("http://x", ttl_seconds=120).interrupt_lease_s == 120
    assert KVSessionOptions("http://x", interrupt_pin_s=9).interrupt_lease_s == 9
    for bad in ({"run_pin_s": 0}, {"interrupt_pin_s": -1}, {"run_pin_s": 1e12}):
        with pytest.raises(ValueError, match="between"):
            KVSessionOptions("http://x", **bad)
