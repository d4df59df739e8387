"""A reasoning model's template drops earlier reasoning; ``preserve_reasoning`` keeps it (SmolLM2).

The requests bring a ChatML template that behaves as Qwen3's do (templates/: earlier turns'
``<think>`` blocks dropped, all kept with ``preserve_thinking``; the generation prompt opens a
``<think>`` block) and a regex that makes SmolLM2 think, close the block and answer. Two
conversations of the same questions: without the option, each turn's prompt leaves out the
reasoning the server holds KV for, so only the previous prompt is read back; with it, the
prompt extends the previous prompt and everything generated after it.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from langgraph_kvcache import ChatKVCache

pytestmark = pytest.mark.vllm

TEMPLATE = (Path(__file__).parent / "templates" / "chatml_drop_thinking.jinja").read_text()
THINK_THEN_ANSWER = r"[a-z][a-z ]{30,80}\n</think>\n\n[A-Z][a-z ,]{10,60}\."
QUESTIONS = ["Why do rivers bend?", "Why are comets bright?", "Why do owls hoot?",
             "Why do bees dance?"]  # fmt: skip


def _model(url: str, preserve: bool, **kw: Any) -> ChatKVCache:
    body = {"chat_template": TEMPLATE, "structured_outputs": {"regex": THINK_THEN_ANSWER}}
    return ChatKVCache(base_url=f"{url}/v1", max_tokens=64, timeout=120, extra_body=body,
                       preserve_reasoning=preserve, **kw)  # fmt: skip


def _usage(message: Any) -> tuple[int, int, int]:
    usage = message.usage_metadata or {}
    cached = int((usage.get("input_token_details") or {}).get("cache_read", 0) or 0)
    return cached, int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))


def _conversation(url: str, preserve: bool) -> list[tuple[int, int, int]]:
    model = _model(url, preserve, session_id=f"reasoning-{preserve}-{uuid.uuid4().hex[:8]}")
    history: list[Any] = [SystemMessage("You are a careful tutor. Think, then answer briefly.")]
    out = []
    for question in QUESTIONS:
        history.append(HumanMessage(question))
        answer = model.invoke(history)
        assert "</think>" in answer.text  # thought, closed the block, answered
        history.append(answer)
        out.append(_usage(answer))
    return out


def test_preserved_reasoning_is_read_back_from_the_cache(kv_server_url: str) -> None:
    shares = {}
    for preserve in (False, True):
        turns = _conversation(kv_server_url, preserve)
        # what the server held after each turn: its prompt and its generated tokens
        held = [p + o for _, p, o in turns[:-1]]
        read = [c for c, _, _ in turns[1:]]
        shares[preserve] = sum(read) / sum(held)
        print(f"\n  preserve_reasoning={preserve}: (cached, prompt, generated) per turn {turns}; "
              f"read back {shares[preserve]:.2f} of what the previous turn held")  # fmt: skip
        if preserve:  # the prompt holds every earlier turn's generated tokens
            assert all(p >= h for (_, p, _), h in zip(turns[1:], held, strict=True)), turns
    # dropped reasoning: only the previous prompt (less its <think> opener) comes back; kept:
    # the prompt and what was generated, but for the 32-token block the seam falls in
    assert shares[True] >= 0.9, shares
    assert shares[False] <= 0.8, shares


def test_reasoning_travels_in_its_own_field(kv_server_url: str) -> None:
    """An AI message's reasoning (``additional_kwargs["reasoning_content"]``, where a reasoning
    parser puts it) goes back as ``reasoning``: the template renders it with the option only."""
    earlier = AIMessage("Rivers bend.", additional_kwargs={
        "reasoning_content": "water erodes the outer bank of each curve " * 4})  # fmt: skip
    history = [HumanMessage("Why do rivers bend?"), earlier, HumanMessage("And lakes?")]
    prompts = {}
    for preserve in (False, True):
        model = ChatKVCache(base_url=f"{kv_server_url}/v1", max_tokens=1, timeout=120,
                            extra_body={"chat_template": TEMPLATE},
                            preserve_reasoning=preserve)  # fmt: skip
        prompts[preserve] = _usage(model.invoke(history))[1]
    assert prompts[True] >= prompts[False] + 30, prompts  # the reasoning's ~40 tokens
    payload = _model(kv_server_url, True)._get_request_payload(history)
    assert payload["messages"][1]["reasoning"].startswith("water erodes")
    assert payload["extra_body"]["chat_template_kwargs"] == {"preserve_thinking": True}
    kept = _model(kv_server_url, True)._get_request_payload(
        history, extra_body={"chat_template_kwargs": {"preserve_thinking": False}}
    )
    assert kept["extra_body"]["chat_template_kwargs"] == {"preserve_thinking": False}
