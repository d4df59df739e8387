"""A summary call that continues the conversation reads it from the cache (SmolLM2).

Two agents (LangChain 1.x ``create_agent`` on ``ChatKVCache`` with one tool, a checkpointer, one
thread each) hold the same conversation and summarise at the same points: one with LangChain's
``SummarizationMiddleware`` (its summary call pastes the messages as text into a fresh prompt:
nothing of it was ever computed), one with :class:`CachedSummarizationMiddleware` (its summary
call is the agent's own prompt up to the cut, then an instruction, in the thread's session).
The share of each summary call's prompt read from the server's cache tells them apart; both
agents' states then hold the summary and the kept messages.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, SummarizationMiddleware
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from benchmarks.context_edits import SummaryCalls
from langgraph_kvcache import ChatKVCache
from langgraph_kvcache.middleware import CachedSummarizationMiddleware

pytestmark = pytest.mark.vllm

TOPICS = ["rivers", "bread", "comets", "violins", "glaciers", "owls", "clocks", "tides",
          "maps", "bees", "lanterns", "copper"]  # fmt: skip
SYSTEM = "You are a patient tutor. Answer in two short sentences. " * 4


@tool
def lookup(title: str) -> str:
    """Look up an encyclopedia article by its title."""
    return f"An article about {title}."


class AnswerInText(AgentMiddleware):  # type: ignore[type-arg]
    """SmolLM2 does not choose tools itself: every agent call answers in text."""

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        return handler(request.override(tool_choice="none"))

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        return await handler(request.override(tool_choice="none"))


def _run(model: ChatKVCache, middleware: Any, thread: str, topics: list[str],
         asynchronous: bool) -> tuple[
    list[tuple[int, int]], list[Any]
]:  # fmt: skip
    agent = create_agent(model, tools=[lookup], system_prompt=SYSTEM,
                         middleware=[middleware, AnswerInText()],
                         checkpointer=InMemorySaver())  # fmt: skip
    calls = SummaryCalls()
    cfg: Any = {"configurable": {"thread_id": thread}, "callbacks": [calls]}
    asks = [{"messages": [("user", f"Tell me one surprising fact about {t}, and why.")]}
            for t in topics]  # fmt: skip

    async def all_turns() -> Any:
        for ask in asks:
            state = await agent.ainvoke(ask, cfg)
        return state

    if asynchronous:
        state = asyncio.run(all_turns())
    else:
        for ask in asks:
            state = agent.invoke(ask, cfg)
    return [(c, p) for c, p, _ in calls.usage], state["messages"]


def test_the_summary_call_reads_the_conversation_from_the_cache(kv_server_url: str) -> None:
    model = ChatKVCache(base_url=f"{kv_server_url}/v1", max_tokens=24, timeout=120)
    run = uuid.uuid4().hex[:8]
    options: dict[str, Any] = {"trigger": ("tokens", 200), "keep": ("messages", 4)}
    agents = {  # LangChain's own, then this one sync and async (on other topics)
        "plain": (SummarizationMiddleware(model.bind(max_tokens=48), **options), TOPICS[:6]),
        "cached": (CachedSummarizationMiddleware(model, max_summary_tokens=48, **options),
                   TOPICS[:6]),
        "cached async": (CachedSummarizationMiddleware(model, max_summary_tokens=48, **options),
                         TOPICS[6:]),
    }  # fmt: skip
    shares, recomputed = {}, {}
    for name, (middleware, topics) in agents.items():
        usage, messages = _run(model, middleware, f"summary-{name}-{run}", topics, "async" in name)
        assert len(usage) >= 1, (name, usage)  # the conversation outgrew the trigger
        shares[name] = sum(c for c, _ in usage) / sum(p for _, p in usage)
        recomputed[name] = [p - c for c, p in usage]
        print(f"\n  {name}: {len(usage)} summary calls, prompts {[p for _, p in usage]} tokens, "
              f"recomputed {recomputed[name]}, cached share {shares[name]:.2f}")  # fmt: skip
        # the state: the summary, the kept messages, the last turn's question and answer
        first = messages[0]
        assert isinstance(first, HumanMessage) and "summary of the conversation" in first.text
        assert isinstance(messages[-1], AIMessage) and messages[-1].text
        assert isinstance(messages[-2], HumanMessage) and topics[-1] in messages[-2].text
        assert len(messages) < 2 * len(topics)
        assert len({m.id for m in messages}) == len(messages)
    # the cached summary call recomputes only its instruction (and the tail it starts in): the
    # history comes from the thread's KV; LangChain's own pastes the history into a fresh prompt
    for name in ("cached", "cached async"):
        assert shares[name] >= 0.8 and max(recomputed[name]) <= 80, (shares, recomputed)
    assert sum(recomputed["plain"]) > 2 * sum(recomputed["cached"]), recomputed


def test_the_middleware_refuses_what_it_does_not_use() -> None:
    model = ChatKVCache(base_url="http://127.0.0.1:9/v1")
    for name in ("summary_prompt", "summarizer", "trim_tokens_to_summarize"):
        with pytest.raises(TypeError, match=name):
            CachedSummarizationMiddleware(model, trigger=("tokens", 100), **{name: None})
    with pytest.raises(ValueError, match="max_summary_tokens"):
        CachedSummarizationMiddleware(model, trigger=("tokens", 100), max_summary_tokens=0)
