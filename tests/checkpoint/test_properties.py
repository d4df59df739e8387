"""Property tests (hypothesis): random histories of appends, removals, edits, replacements,
forks (``update_state`` on an old checkpoint), graph runs, prunes and copies, on a real
``MessagesState`` graph. Every ``put``/``put_writes`` also goes to LangGraph's plain
``InMemorySaver`` (same checkpoint ids); every checkpoint the saver still has must read back
equal to the plain saver's reading, bit for bit after serde, and a copied thread must read
like its source did."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


class TeeSaver(BaseCheckpointSaver[str]):
    """Reads from ``ours``; writes to ``ours`` and to the plain ``reference``."""

    def __init__(self, ours: SQLAlchemySaver, reference: InMemorySaver) -> None:
        super().__init__(serde=ours.serde)
        self.ours, self.reference = ours, reference

    def get_next_version(self, current: Any, channel: Any) -> Any:
        return self.ours.get_next_version(current, channel)

    def get_tuple(self, config: Any) -> CheckpointTuple | None:
        return self.ours.get_tuple(config)

    def list(self, config: Any, **kwargs: Any) -> Iterator[CheckpointTuple]:
        return self.ours.list(config, **kwargs)

    # LangGraph calls the checkpointer from a background thread while the graph may still set
    # message ids in place (add_messages), so both savers get one frozen copy of the input.
    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        checkpoint = copy.deepcopy(checkpoint)
        self.reference.put(config, checkpoint, metadata, new_versions)
        return self.ours.put(config, checkpoint, metadata, new_versions)

    def put_writes(
        self, config: Any, writes: Sequence[Any], task_id: str, task_path: str = ""
    ) -> None:
        writes = copy.deepcopy(list(writes))
        self.reference.put_writes(config, writes, task_id, task_path)
        self.ours.put_writes(config, writes, task_id, task_path)


def _graph(saver: BaseCheckpointSaver) -> Any:
    def echo(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(f"echo {len(state['messages'])}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("echo", echo)
    builder.add_edge(START, "echo")
    return builder.compile(checkpointer=saver)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("run"), st.integers(0, 0)),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("edit"), st.integers(0, 50)),
        st.tuples(st.just("replace"), st.integers(0, 50)),
        st.tuples(st.just("fork"), st.integers(0, 50)),
        st.tuples(st.just("prune"), st.integers(0, 0)),
        st.tuples(st.just("copy"), st.integers(0, 0)),
    ),
    min_size=1,
    max_size=20,
)


def _same(saver: SQLAlchemySaver, ours: CheckpointTuple, ref: CheckpointTuple) -> None:
    dump = saver.serde.dumps_typed
    a, b = ours.checkpoint, ref.checkpoint
    assert a["channel_versions"] == b["channel_versions"]
    assert set(a["channel_values"]) == set(b["channel_values"])
    for channel, value in b["channel_values"].items():
        assert dump(a["channel_values"][channel]) == dump(value), channel
    assert ours.metadata == ref.metadata
    assert [w[:2] for w in ours.pending_writes or []] == [w[:2] for w in ref.pending_writes or []]
    for x, y in zip(ours.pending_writes or [], ref.pending_writes or [], strict=True):
        assert dump(x[2]) == dump(y[2])


def _check(saver: SQLAlchemySaver, reference: InMemorySaver, thread_id: str) -> None:
    for found in saver.list({"configurable": {"thread_id": thread_id}}):
        ref = reference.get_tuple(found.config)
        assert ref is not None
        _same(saver, found, ref)


@pytest.mark.parametrize("snapshot_every", [3, 100])
def test_random_histories_read_back_like_a_plain_saver(db_url: str, snapshot_every: int) -> None:
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=snapshot_every) as saver:
        saver.setup()
        counter = iter(range(10**9))

        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(ops=OPS)
        def run(ops: list[tuple[str, int]]) -> None:
            n = next(counter)
            thread_id = f"p{n}"
            reference = InMemorySaver(serde=saver.serde)
            graph = _graph(TeeSaver(saver, reference))
            cfg = {"configurable": {"thread_id": thread_id}}
            copies: list[str] = []
            made = iter(range(10**6))
            for op, arg in ops:
                state = graph.get_state(cfg)
                messages = state.values.get("messages", []) if state.values else []
                if op == "append" or (not messages and op in ("remove", "edit", "replace")):
                    new = [
                        HumanMessage(f"m{next(made)}", id=f"{n}-{next(made)}")
                        for _ in range(max(arg, 1))
                    ]
                    graph.update_state(cfg, {"messages": new})
                elif op == "run":
                    graph.invoke({"messages": [HumanMessage(f"q{next(made)}")]}, cfg)
                elif op == "remove":
                    graph.update_state(
                        cfg, {"messages": [RemoveMessage(id=messages[arg % len(messages)].id)]}
                    )
                elif op == "edit":
                    old = messages[arg % len(messages)]
                    graph.update_state(
                        cfg, {"messages": [HumanMessage(f"edited {next(made)}", id=old.id)]}
                    )
                elif op == "replace":  # a reducer-free rewrite: reversed order
                    keep = list(reversed(messages))
                    graph.update_state(
                        cfg, {"messages": [RemoveMessage(id="__remove_all__"), *keep]}
                    )
                elif op == "fork":
                    history = list(graph.get_state_history(cfg))
                    if history:
                        old_cfg = history[arg % len(history)].config
                        new = HumanMessage(f"fork {next(made)}", id=f"{n}-{next(made)}")
                        graph.update_state(old_cfg, {"messages": [new]})
                elif op == "prune":
                    saver.prune([thread_id])
                else:
                    target = f"{thread_id}-copy{len(copies)}"
                    saver.copy_thread(thread_id, target)
                    copies.append(target)
                    for found in saver.list({"configurable": {"thread_id": target}}):
                        source = {
                            "configurable": {**found.config["configurable"], "thread_id": thread_id}
                        }
                        ref = reference.get_tuple(source)
                        assert ref is not None
                        _same(saver, found, ref)
                _check(saver, reference, thread_id)
            # A saver that remembers nothing reads the same.
            with SQLAlchemySaver.from_conn_string(saver.engine.url) as fresh:
                _check(fresh, reference, thread_id)

        run()
