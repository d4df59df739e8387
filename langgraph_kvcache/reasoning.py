"""Reasoning kept across turns, so the next prompt extends what the model generated.

Reasoning models' chat templates (Qwen3, DeepSeek-R1, gpt-oss, Gemma) drop the reasoning of
earlier turns from the prompt. The server then holds a turn's KV for its prompt, its reasoning
and its answer, and the next turn's prompt leaves the old reasoning out: it shares only the old
prompt with the KV, and the answer after the cut is recomputed. Templates that offer it (Qwen
3.6 and later, Gemma 4, and others: ``preserve_thinking``) keep every turn's reasoning when
asked; the model's card for Qwen 3.6 recommends it for agents, also for KV cache use.

Two halves are needed, as the reasoning travels apart from the content: vLLM returns it in the
message's ``reasoning`` field when a reasoning parser is on, and a client that sends back only
``content`` loses it. With ``ChatKVCache(preserve_reasoning=True)``:

- an answer's reasoning is kept in ``AIMessage.additional_kwargs["reasoning_content"]`` (as
  LangChain's DeepSeek and Qwen chat models keep it), streamed or not;
- every AI message that holds reasoning sends it back (``reasoning``, which vLLM hands to the
  chat template as ``reasoning_content``), and the request asks the template to keep it
  (``chat_template_kwargs: {"preserve_thinking": true}``, unless the call sets it).

Reasoning written inside the content (no reasoning parser: ``<think>...</think>`` in the text)
needs only the second: such templates split it out of the content themselves.

The prompt grows by the reasoning of every turn, and the model sees its old reasoning, which it
may not have been trained with (a template without the switch ignores it): measure both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult

REASONING_KEY = "reasoning_content"
"""Where an AI message keeps its reasoning (``additional_kwargs``)."""
TEMPLATE_SWITCH = "preserve_thinking"
"""The chat template keyword that keeps every turn's reasoning."""


def reasoning_of(message: Mapping[str, Any] | None) -> str | None:
    """The reasoning vLLM returned beside a message or a stream delta: ``reasoning``, or
    ``reasoning_content`` (its name before vLLM 0.11); None when there is none."""
    if not message:
        return None
    for key in ("reasoning", REASONING_KEY):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def send_reasoning(
    payload: dict[str, Any],
    messages: Sequence[BaseMessage],
    defaults: Sequence[Mapping[str, Any] | None] = (),
) -> dict[str, Any]:
    """The request body with each AI message's reasoning sent back and the template asked to
    keep it, unless the call, or else one of ``defaults`` (the model's own ``extra_body``
    values, which a call's ``extra_body`` replaces whole), sets ``preserve_thinking``.
    ``payload["messages"]`` are ``messages`` converted one for one (LangChain's Chat
    Completions body)."""
    sent = payload.get("messages")
    if isinstance(sent, list) and len(sent) == len(messages):
        for body, message in zip(sent, messages, strict=True):
            reasoning = message.additional_kwargs.get(REASONING_KEY)
            if isinstance(message, AIMessage) and isinstance(reasoning, str) and reasoning:
                body["reasoning"] = reasoning
    extra = dict(payload.get("extra_body") or {})
    template_kwargs = dict(extra.get("chat_template_kwargs") or {})
    if TEMPLATE_SWITCH not in template_kwargs:
        chosen = [
            d["chat_template_kwargs"][TEMPLATE_SWITCH]
            for d in defaults
            if d and TEMPLATE_SWITCH in (d.get("chat_template_kwargs") or {})
        ]
        template_kwargs[TEMPLATE_SWITCH] = chosen[0] if chosen else True
    payload["extra_body"] = {**extra, "chat_template_kwargs": template_kwargs}
    return payload


def keep_reasoning(result: ChatResult, response: Any) -> ChatResult:
    """``result`` with each choice's reasoning in its message's ``additional_kwargs``."""
    body = response if isinstance(response, Mapping) else response.model_dump()
    for generation, choice in zip(result.generations, body.get("choices") or [], strict=False):
        reasoning = reasoning_of(choice.get("message"))
        if reasoning is not None:
            generation.message.additional_kwargs[REASONING_KEY] = reasoning
    return result


def keep_streamed_reasoning(
    chunk: ChatGenerationChunk | None, raw: Mapping[str, Any]
) -> ChatGenerationChunk | None:
    """``chunk`` with the reasoning piece of its stream delta (LangChain joins the pieces of
    ``additional_kwargs`` strings when it adds the chunks)."""
    choices = raw.get("choices") or []
    piece = reasoning_of(choices[0].get("delta")) if choices else None
    if chunk is not None and piece is not None:
        chunk.message.additional_kwargs[REASONING_KEY] = piece
    return chunk
