"""A tool that sleeps while other threads push the agent's KV out of the server's RAM tier.

The workload of run-scoped pins (docs/agents.md), shared by ``benchmarks/pins.py`` and the
suite (tests/integration/thread_session/test_run_pins_server.py). One agent thread runs
``model -> tool -> model``; its tool "sleeps" for as long as it takes other threads (other
clients, each a managed session) to pass enough KV through the server to fill its RAM tier
several times over: the tool waits while their turns run. The agent's second model call then
finds its KV in RAM (pinned for the run) or not (``run_pins=False``: moved to disk by the
eviction policy), and :class:`SleepFigure` says which, with the call's cached tokens and
time to first token.

:data:`SERVER_FLAGS` size the server for the tiny test model (``tiny-llama-h32``: 128-token
blocks of 128 KiB): vLLM's resident cache and the RAM tier hold a few threads' contexts only.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from typing_extensions import TypedDict

from langgraph_kvcache import ChatKVCache, KVCacheClient

BLOCK_BYTES = 128 * 1024
"""One KV block of ``tiny-llama-h32`` (128 tokens, float32)."""
SMOLLM2_BLOCK_BYTES = 5_898_240
"""One KV block of SmolLM2-135M (128 tokens, float32)."""


def server_flags(block_bytes: int = BLOCK_BYTES) -> tuple[str, ...]:
    """Server flags for a model whose 128-token KV block takes ``block_bytes``: vLLM's
    resident cache holds 20 blocks (one 2,048-token context and a little), the RAM tier 16,
    so the agent (3 to 4 blocks) and a few other threads fit, ten do not. The RAM tier leaves
    room for the saves in flight beside a pinned session: when pinned and in-flight blocks
    fill it, a pinned block moves to disk too (docs/agents.md, "What pins cost")."""
    return (
        "--kv-cache-memory-bytes", str(20 * block_bytes),
        "--max-model-len", "2048",
        "--max-num-seqs", "4",
        "--enforce-eager",
        "--distributed-executor-backend", "uni",
        "--kv-ram-bytes", str(16 * block_bytes),
        "--kv-disk-bytes", "1GiB",
    )  # fmt: skip


SERVER_FLAGS = server_flags()
"""The flags for ``tiny-llama-h32``."""
OTHER_THREADS = 10
"""Threads whose turns run while the tool sleeps (each 3 to 4 blocks: 30 or more in all)."""
ANSWER_TOKENS = 4


def tiny_model() -> Path:
    """The tiny random-weight Llama :data:`SERVER_FLAGS` are sized for (built if missing)."""
    from server.model import build_default_model, build_tiny_model, default_cache_dir

    return build_tiny_model(
        default_cache_dir() / "models" / "tiny-llama-h32", build_default_model()
    )


def notes(name: str, items: int = 20) -> str:
    """A text of about ``20 * items`` tokens, unique to ``name`` from its first token (so two
    threads share no KV block)."""
    facts = " ".join(f"{name} note {i}: value {i * 7 % 97}." for i in range(items))
    return f"{name} asks. {facts} Summarize."


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    calls: Annotated[int, operator.add]


@dataclass
class SleepFigure:
    """What the agent's second model call found after the tool slept."""

    pins: bool
    """Whether the saver pinned runs."""
    num_blocks: int = 0
    """The agent's session blocks when the tool ended."""
    ram_blocks_before: int = 0
    """Of those, in the RAM tier when the tool started (pinned by then, with pins)."""
    ram_blocks: int = 0
    """Of those, in the RAM tier when the tool ended."""
    pinned_in_tool: bool = False
    """The session was pinned while the tool ran."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens of the second call read from a cache (any tier) rather than computed."""
    first_prompt_tokens: int = 0
    ttft_s: float = 0.0
    """Wall time of the second call (a 1-token answer: prefill plus one token)."""
    hits: dict[str, float] = field(default_factory=dict)
    """Blocks the second call loaded per tier (``lgkv_hit_blocks_total`` deltas)."""

    def line(self) -> str:
        """One printable line."""
        return (
            f"pins {'on ' if self.pins else 'off'}: blocks in RAM when the tool started "
            f"{self.ram_blocks_before}/{self.num_blocks}, ended {self.ram_blocks}/"
            f"{self.num_blocks} (pinned: {self.pinned_in_tool}); next call "
            f"cached {self.cached_tokens}/{self.prompt_tokens} tokens, loaded from RAM "
            f"{self.hits.get('ram', 0):.0f} / disk {self.hits.get('disk', 0):.0f} blocks, "
            f"TTFT {self.ttft_s:.3f} s"
        )


def hit_blocks(base_url: str) -> dict[str, float]:
    """``lgkv_hit_blocks_total`` per tier (read after a session call: its barrier publishes
    the engine's counters)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("lgkv_hit_blocks_total{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = float(line.rsplit(" ", 1)[1])
    return out


def push_others(
    model: ChatKVCache, kv: KVCacheClient, tag: str, count: int = OTHER_THREADS
) -> None:
    """``count`` other threads' first turns (managed sessions, as a checkpointer's are)."""
    for i in range(count):
        sid = f"{tag}-other-{i}"
        kv.create_session(sid, ttl_seconds=600)
        model.invoke([HumanMessage(notes(sid))], session_id=sid, max_tokens=1)


def _wait(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _ram_blocks(kv: KVCacheClient, session_id: str) -> int:
    return kv.get_session(session_id).tiers["ram"].blocks


def sleeping_tool_run(
    saver: BaseCheckpointSaver[Any], model: ChatKVCache, base_url: str, tag: str, *, pins: bool
) -> SleepFigure:
    """Run the agent thread ``tag`` once (see the module doc) and measure its second call.

    With ``pins``, the tool first waits (up to 30 s) for the saver's background pin to reach
    the server, as any tool slower than one HTTP call does.
    """
    kv = KVCacheClient(base_url, timeout=60)
    figure = SleepFigure(pins)

    def agent(state: AgentState) -> dict[str, Any]:
        first = state["calls"] == 0
        started = time.perf_counter()
        answer = model.invoke(state["messages"], max_tokens=ANSWER_TOKENS if first else 1)
        elapsed = time.perf_counter() - started
        usage = answer.usage_metadata or {}
        if first:
            figure.first_prompt_tokens = usage.get("input_tokens", 0)
        else:
            figure.ttft_s = elapsed
            figure.prompt_tokens = usage.get("input_tokens", 0)
            figure.cached_tokens = usage.get("input_token_details", {}).get("cache_read", 0)
        return {"messages": [AIMessage(str(answer.content))], "calls": 1}

    def tool(state: AgentState) -> dict[str, Any]:
        if pins:
            _wait(lambda: kv.get_session(tag).pinned, 30)
        # A session's tier counts show the engine's block locations within one publish
        # (--kv-stats-flush, 1 s) of the turn: wait up to three for the first turn's, and after
        # the others ran, for their evictions of this session's blocks, if any.
        _wait(lambda: _ram_blocks(kv, tag) >= kv.get_session(tag).num_blocks - 1, 3)
        figure.ram_blocks_before = _ram_blocks(kv, tag)
        push_others(model, kv, tag)
        _wait(lambda: _ram_blocks(kv, tag) < figure.ram_blocks_before, 3)
        session = kv.get_session(tag)
        figure.num_blocks, figure.ram_blocks = session.num_blocks, session.tiers["ram"].blocks
        figure.pinned_in_tool = session.pinned
        figure.hits = hit_blocks(base_url)
        return {"messages": [HumanMessage("The tool found nothing new. Answer in one word.")]}

    builder = StateGraph(AgentState)
    builder.add_node("agent", agent)
    builder.add_node("tool", tool)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", lambda s: "tool" if s["calls"] < 2 else END)
    builder.add_edge("tool", "agent")
    graph = builder.compile(checkpointer=saver)
    graph.invoke(
        {"messages": [HumanMessage(notes(tag))], "calls": 0}, {"configurable": {"thread_id": tag}}
    )
    kv.get_session(tag)  # publish the counters of the second call
    after = hit_blocks(base_url)
    figure.hits = {t: after.get(t, 0.0) - figure.hits.get(t, 0.0) for t in after}
    kv.close()
    return figure
