"""A ReAct tool loop keeps its KV: LangChain's ``create_agent``, real tools, the real server.

Four threads run the agent over the Wikipedia tools (agent_tools.py): three forced tool calls
and a text answer each, four LLM calls per thread, each thread's system prompt opening with its
question (under ``make test-long``: six tool calls, seven LLM calls, one shared system prompt).
The threads are interleaved one LLM call at a time (``interrupt_before=["tools"]``, then resumed
in turn), and the server's resident KV cache holds fewer tokens than the four contexts, so each
thread comes back to find its KV pushed out of vLLM's cache and loads it from the RAM tier.

Checks: every call after the first reads from the cache every whole 32-token block of the
previous call's prompt plus answer (the answer's last token has no KV yet); the greedy outputs
(tool calls and answers) equal those of a cache-off run (a fresh ``cache_salt`` per call, so
nothing can match). The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import httpx
import pytest
from agent_tools import Call, calls_of, react_agent
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_kvcache import ChatKVCache
from tests.sizes import LONG, size

pytestmark = pytest.mark.vllm

TOOL_CALLS = size(3, 6)  # forced tool calls per thread; one text answer follows
QUESTIONS = (
    "What do the articles say about Astronomy and the Earth?",
    "Tell me about Chemistry and the Atom.",
    "How are Climate and Agriculture related?",
    "What is a Computer, and how is it used in Business?",
)
BLOCK_TOKENS = 32
"""``smollm2_server``'s KV block size: each call must read every whole block of the previous
context from the cache."""


def hit_blocks(base_url: str) -> float:
    """``lgkv_hit_blocks_total`` of the server: KV blocks loaded from a tier, not recomputed."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("lgkv_hit_blocks_total")
    )


def run_interleaved(agent: Any, tag: str) -> tuple[dict[str, list[Call]], float]:
    """Run :data:`QUESTIONS` as one thread each, one LLM call per thread in turn, to the end.

    Returns each thread's calls (in question order) and the wall time of the whole run.
    """
    threads = {q: f"react-{tag}-{i}-{uuid.uuid4().hex[:6]}" for i, q in enumerate(QUESTIONS)}
    open_threads = list(QUESTIONS)
    started = time.perf_counter()
    first = True
    while open_threads:
        for question in list(open_threads):
            cfg = {"configurable": {"thread_id": threads[question]}, "recursion_limit": 40}
            agent.invoke({"messages": [HumanMessage(question)]} if first else None, cfg)
            if not agent.get_state(cfg).next:
                open_threads.remove(question)
        first = False
    elapsed = time.perf_counter() - started
    calls = {}
    for question, thread in threads.items():
        state = agent.get_state({"configurable": {"thread_id": thread}})
        calls[question] = calls_of(state.values["messages"])
    return calls, elapsed


def test_react_loop_hits_its_own_kv_and_answers_like_cache_off(
    agent_model: ChatKVCache, smollm2_server: Any
) -> None:
    def agent(cache_off: bool) -> Any:
        return react_agent(
            agent_model,
            tool_calls=TOOL_CALLS,
            cache_off=cache_off,
            own_prompt=not LONG,  # short threads: no shared prompt, or the four fit in vLLM's cache
            checkpointer=InMemorySaver(),
            interrupt_before=["tools"],
        )

    hits_before = hit_blocks(smollm2_server.base_url)
    cached_run, cached_s = run_interleaved(agent(cache_off=False), "on")
    tier_hits = hit_blocks(smollm2_server.base_url) - hits_before
    plain_run, plain_s = run_interleaved(agent(cache_off=True), "off")

    print(
        f"\n  cache on {cached_s:.1f}s, cache off {plain_s:.1f}s; {tier_hits:.0f} blocks from tiers"
    )
    worst = 1.0
    for i, question in enumerate(QUESTIONS):
        calls = cached_run[question]
        print(f"  thread {i}: prompt/answer/cached per call (share of the previous context)")
        for n, call in enumerate(calls):
            share = call.cached / calls[n - 1].context if n else 0.0
            if n:
                worst = min(worst, share)
            usage = f"{call.prompt}/{call.completion}/{call.cached}"
            print(f"    {n}: {usage} ({share:.3f}) {call.output}")
    print(f"  worst share {worst:.3f}")

    for question in QUESTIONS:
        calls, plain = cached_run[question], plain_run[question]
        assert len(calls) == TOOL_CALLS + 1, [c.output for c in calls]
        assert [c.output for c in calls] == [c.output for c in plain], question
        assert all(c.cached == 0 for c in plain), "the cache-off run read from the cache"
    for question in QUESTIONS:
        calls = cached_run[question]
        # Every call, the second included: the server writes grammar-forced words (the tool's
        # name, a key, the closing "}}") in whole tokens (server/forced_text.py), so the tool
        # call renders back to the tokens it was generated in.
        for prev, call in itertools.pairwise(calls):
            whole_blocks = (prev.context - 1) // BLOCK_TOKENS * BLOCK_TOKENS
            assert call.cached >= whole_blocks, (question, prev, call)
    assert tier_hits > 0, "every hit came from vLLM's own cache: the threads did not interleave"
