"""Stepped trimming keeps the server's KV reusable where plain trimming loses it (SmolLM2).

Two agents (LangChain 1.x ``create_agent`` on ``ChatKVCache``, a checkpointer, one thread each)
hold the same conversation on the default model; each model call sees the history trimmed to
the same budget, one by LangChain's ``trim_messages(strategy="last")`` (a ``wrap_model_call``
middleware, as a user writes it), one by :class:`SteppedTrimMiddleware`. Over the turns after
trimming begins, the share of each prompt read from the cache: plain trimming moves the cut
every turn (the issue measured 0.00-0.32), stepped trimming keeps the prefix until the history
has grown by a step (goal >= 0.8). The agents' state keeps every message either way.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, SystemMessage, trim_messages
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_kvcache import ChatKVCache
from langgraph_kvcache.middleware import SteppedTrimMiddleware
from langgraph_kvcache.trim import count_with

pytestmark = pytest.mark.vllm

TOPICS = ["rivers", "bread", "comets", "violins", "glaciers", "owls", "clocks", "tides",
          "maps", "bees", "lanterns", "copper", "ferns", "harbors"]  # fmt: skip
SYSTEM = "You are a patient tutor. Answer in two short sentences. " * 6
BUDGET = 400


@wrap_model_call
def plain_trim(request: Any, handler: Any) -> Any:
    """What a user writes with LangChain's own ``trim_messages``, same budget."""
    budget = BUDGET - count_with("approximate")([request.system_message])
    kept = trim_messages(request.messages, max_tokens=budget, token_counter="approximate",
                         start_on="human")  # fmt: skip
    return handler(request.override(messages=kept))


def _run(model: ChatKVCache, middleware: Any, thread: str) -> list[tuple[int, int, bool]]:
    """(cached tokens, prompt tokens, trimmed) of each turn."""
    agent = create_agent(model, tools=[], system_prompt=SYSTEM, middleware=[middleware],
                         checkpointer=InMemorySaver())  # fmt: skip
    cfg = {"configurable": {"thread_id": thread}}
    out = []
    for topic in TOPICS:
        ask = f"Tell me one surprising fact about {topic}, and why."
        state = agent.invoke({"messages": [("user", ask)]}, cfg)
        answer = state["messages"][-1]
        assert isinstance(answer, AIMessage)
        usage = answer.usage_metadata or {}
        cached = int((usage.get("input_token_details") or {}).get("cache_read", 0) or 0)
        history = state["messages"][:-1]  # the state keeps every message
        trimmed = count_with("approximate")([SystemMessage(SYSTEM), *history]) > BUDGET
        out.append((cached, int(usage.get("input_tokens", 0)), trimmed))
    assert len(state["messages"]) == 2 * len(TOPICS)
    return out


def test_stepped_trimming_keeps_the_prompt_cached(kv_server_url: str) -> None:
    model = ChatKVCache(base_url=f"{kv_server_url}/v1", max_tokens=24, timeout=120)
    run = uuid.uuid4().hex[:8]
    stepped = SteppedTrimMiddleware(max_tokens=BUDGET)
    shares = {}
    for name, middleware in (("plain", plain_trim), ("stepped", stepped)):
        turns = _run(model, middleware, f"trim-{name}-{run}")
        after = [c / p for c, p, trimmed in turns[1:] if trimmed]
        assert len(after) >= 5, turns  # the conversation outgrew the budget early
        shares[name] = sum(after) / len(after)
        print(f"\n  {name} trimming: cached share of the prompt after trimming began "
              f"{shares[name]:.2f} over {len(after)} turns")  # fmt: skip
    assert shares["stepped"] >= 0.7, shares  # measured 0.82 (plain 0.18) before the middleware
    assert shares["plain"] < 0.5, shares


def test_the_middleware_keeps_the_budget_and_the_system_prompt() -> None:
    """Unit-level: the trimmed request holds at most ``max_tokens`` with its system prompt, never
    starts on a tool result, and is the same request when nothing needs cutting."""
    from langchain.agents.middleware import ModelRequest
    from langchain_core.messages import HumanMessage, ToolMessage

    count = count_with("approximate")
    messages: list[Any] = []
    for i in range(30):
        messages.append(HumanMessage(f"Question {i} about something long enough to count."))
        messages.append(AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": f"c{i}"}]))
        messages.append(ToolMessage(f"result {i} " * 5, tool_call_id=f"c{i}"))
    system = SystemMessage("You answer briefly.")
    request = ModelRequest(model=None, messages=messages, system_message=system)  # type: ignore[arg-type]
    trim = SteppedTrimMiddleware(max_tokens=300)
    kept = trim.trimmed(request).messages
    assert count([system, *kept]) <= 300 and len(kept) < len(messages)
    assert not isinstance(kept[0], ToolMessage)
    assert kept == messages[-len(kept) :]
    short = ModelRequest(model=None, messages=messages[:3], system_message=system)  # type: ignore[arg-type]
    assert trim.trimmed(short) is short
    with pytest.raises(ValueError, match="system prompt alone"):
        SteppedTrimMiddleware(max_tokens=3).trimmed(request)
