"""Run-scoped pins on the real server: a run's session is pinned while the run is on.

One server (``pins_server``) with a resident cache and a RAM tier that hold a few threads'
contexts only (``examples.sleeping_tool.SERVER_FLAGS``). Checks:

- the proof: an agent's tool sleeps while ten other threads pass their KV through the server;
  with run pins the agent's session stays in RAM and its next call loads nothing from disk;
  with ``run_pins=False`` its KV moved to disk and the next call loads it from there;
- a run's pin is released when the run ends (sync and async savers), when a node raises,
  and kept with the interrupt lease when a node calls ``interrupt()`` (released when the
  resumed run ends);
- a client that never releases (its run stopped by ``interrupt_before``, nothing resumes it)
  leaves a lease that lapses on the server by itself.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from examples.sleeping_tool import SERVER_FLAGS, AgentState, notes, sleeping_tool_run
from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.checkpoint import AsyncSQLAlchemySaver, SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.vllm

RUN_PIN_S = 120.0
INTERRUPT_PIN_S = 900.0


@pytest.fixture(scope="module")
def pins_server(start_server: Any) -> Any:
    """A tiny-model server whose resident cache and RAM tier hold a few contexts only."""
    return start_server(engine_args=SERVER_FLAGS)


@pytest.fixture
def model(pins_server: Any) -> ChatKVCache:
    return ChatKVCache(base_url=f"{pins_server.base_url}/v1", model=pins_server.model, timeout=120)


def _options(server: Any, **kw: Any) -> KVSessionOptions:
    kw.setdefault("run_pin_s", RUN_PIN_S)
    kw.setdefault("interrupt_pin_s", INTERRUPT_PIN_S)
    return KVSessionOptions(server.base_url, ttl_seconds=600, **kw)


def _tag(name: str) -> str:
    return f"pins-{name}-{uuid.uuid4().hex[:8]}"


def test_a_sleeping_tool_keeps_its_kv_in_ram_only_with_run_pins(
    pins_server: Any, model: ChatKVCache, sqlite_url: str
) -> None:
    figures = {}
    for pins in (True, False):
        with SQLAlchemySaver.from_conn_string(
            sqlite_url, kv_server=_options(pins_server, run_pins=pins)
        ) as saver:
            saver.setup()
            figures[pins] = sleeping_tool_run(
                saver, model, pins_server.base_url, _tag("sleep"), pins=pins
            )
    on, off = figures[True], figures[False]
    print(f"\n  {on.line()}\n  {off.line()}")
    for figure in (on, off):
        assert figure.num_blocks >= 3, "the agent's context must span several blocks"
        assert figure.cached_tokens >= figure.first_prompt_tokens - 128, figure
    assert on.pinned_in_tool and not off.pinned_in_tool
    # Pinned: nothing the session had in RAM left it while the others ran, and the next call
    # loads from RAM. (A fresh session does not always have its whole first turn in RAM when
    # the pin lands, and its last block may reach RAM after the count before the tool: what
    # pins promise is that nothing leaves RAM while they hold.)
    assert on.ram_blocks >= on.ram_blocks_before >= on.num_blocks - 1, on
    assert on.hits.get("ram", 0) > 0, on
    assert on.hits.get("disk", 0) <= on.num_blocks - on.ram_blocks, on
    # Unpinned: the others pushed it out of RAM, and the next call loads it from disk.
    assert off.ram_blocks < off.ram_blocks_before, off
    assert off.ram_blocks == 0 and off.hits.get("disk", 0) > 0, off


def _graph(
    model: ChatKVCache, middle: Callable[[AgentState], dict[str, Any]], saver: Any, **kw: Any
) -> Any:
    """model -> middle -> END."""

    def agent(state: AgentState) -> dict[str, Any]:
        answer = model.invoke(state["messages"], max_tokens=2)
        return {"messages": [AIMessage(str(answer.content))], "calls": 1}

    builder = StateGraph(AgentState)
    builder.add_node("agent", agent)
    builder.add_node("middle", middle)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", "middle")
    builder.add_edge("middle", END)
    return builder.compile(checkpointer=saver, **kw)


def _start(tag: str) -> dict[str, Any]:
    return {"messages": [HumanMessage(notes(tag, items=10))], "calls": 0}


def test_a_run_is_pinned_while_on_and_released_at_its_end(
    pins_server: Any, model: ChatKVCache, sqlite_url: str
) -> None:
    kv = KVCacheClient(pins_server.base_url)
    tag, seen = _tag("run"), {}

    def middle(state: AgentState) -> dict[str, Any]:
        wait_until(lambda: kv.get_session(tag).pinned, "the run's pin")
        seen["session"] = kv.get_session(tag)
        seen["now"] = time.time()
        return {}

    with SQLAlchemySaver.from_conn_string(sqlite_url, kv_server=_options(pins_server)) as saver:
        saver.setup()
        _graph(model, middle, saver).invoke(_start(tag), {"configurable": {"thread_id": tag}})
        lease_end = seen["session"].pin_expires_at
        assert lease_end is not None and lease_end <= seen["now"] + RUN_PIN_S
        assert lease_end > seen["now"] + RUN_PIN_S / 2
        wait_until(lambda: not kv.get_session(tag).pinned, "the release at the run's end")
        assert kv.get_session(tag).pin_expires_at is None

    off = _tag("off")  # run_pins=False: never pinned
    with SQLAlchemySaver.from_conn_string(
        sqlite_url, kv_server=_options(pins_server, run_pins=False)
    ) as saver:

        def unpinned(state: AgentState) -> dict[str, Any]:
            seen["off"] = kv.get_session(off).pinned
            return {}

        _graph(model, unpinned, saver).invoke(_start(off), {"configurable": {"thread_id": off}})
        assert seen["off"] is False
    kv.close()


def test_the_async_saver_pins_and_releases(
    pins_server: Any, model: ChatKVCache, sqlite_url: str
) -> None:
    kv = KVCacheClient(pins_server.base_url)
    tag, seen = _tag("async"), {}

    def middle(state: AgentState) -> dict[str, Any]:  # runs in a worker thread of ainvoke
        wait_until(lambda: kv.get_session(tag).pinned, "the run's pin")
        seen["pinned"] = True
        return {}

    async def main() -> None:
        options = _options(pins_server)
        async with AsyncSQLAlchemySaver.from_conn_string(sqlite_url, kv_server=options) as saver:
            await saver.setup()
            graph = _graph(model, middle, saver)
            await graph.ainvoke(_start(tag), {"configurable": {"thread_id": tag}})

    asyncio.run(main())
    assert seen["pinned"]
    wait_until(lambda: not kv.get_session(tag).pinned, "the release at the run's end")
    kv.close()


def test_an_error_releases_and_an_interrupt_keeps_the_interrupt_lease(
    pins_server: Any, model: ChatKVCache, sqlite_url: str
) -> None:
    kv = KVCacheClient(pins_server.base_url)
    failing, asking = _tag("error"), _tag("interrupt")

    def boom(state: AgentState) -> dict[str, Any]:
        wait_until(lambda: kv.get_session(failing).pinned, "the run's pin")
        raise RuntimeError("the tool failed")

    def ask(state: AgentState) -> dict[str, Any]:
        return {"messages": [HumanMessage(str(interrupt("approve?")))]}

    with SQLAlchemySaver.from_conn_string(sqlite_url, kv_server=_options(pins_server)) as saver:
        saver.setup()
        with pytest.raises(RuntimeError, match="the tool failed"):
            _graph(model, boom, saver).invoke(
                _start(failing), {"configurable": {"thread_id": failing}}
            )
        wait_until(lambda: not kv.get_session(failing).pinned, "the release after the error")

        graph = _graph(model, ask, saver)
        config = {"configurable": {"thread_id": asking}}
        before = time.time()
        graph.invoke(_start(asking), config)
        assert graph.get_state(config).next == ("middle",)

        def interrupt_lease() -> bool:
            session = kv.get_session(asking)
            end = session.pin_expires_at
            return session.pinned and end is not None and end > before + RUN_PIN_S + 60

        wait_until(interrupt_lease, "the interrupt lease")
        assert kv.get_session(asking).pin_expires_at <= time.time() + INTERRUPT_PIN_S
    # Another saver (another web request or worker: the human-in-the-loop case) resumes the
    # thread; the pin it never made is released when the resumed run ends all the same.
    with SQLAlchemySaver.from_conn_string(sqlite_url, kv_server=_options(pins_server)) as fresh:
        graph = _graph(model, ask, fresh)
        graph.invoke(Command(resume="yes"), config)
        assert not graph.get_state(config).next
        wait_until(
            lambda: not kv.get_session(asking).pinned, "the release when the resumed run ends"
        )
    kv.close()


def test_a_lease_nobody_releases_lapses_on_the_server(
    pins_server: Any, model: ChatKVCache, sqlite_url: str
) -> None:
    kv = KVCacheClient(pins_server.base_url)
    tag = _tag("lapse")
    options = _options(pins_server, run_pin_s=2.0)
    with SQLAlchemySaver.from_conn_string(sqlite_url, kv_server=options) as saver:
        saver.setup()
        graph = _graph(model, lambda state: {}, saver, interrupt_before=["middle"])
        graph.invoke(_start(tag), {"configurable": {"thread_id": tag}})
        # The run stopped before "middle" on a checkpoint with a pending task: pinned with
        # the 2 s run lease, and no later checkpoint of this client will release it.
        wait_until(lambda: kv.get_session(tag).pinned, "the run's pin")
    wait_until(lambda: not kv.get_session(tag).pinned, "the lease to lapse")
    assert kv.get_session(tag).pin_expires_at is None
    kv.close()
