"""``preserve_reasoning``: vLLM's reasoning field kept on answers, streamed or not (no server:
the server half is tests/integration/chat/test_reasoning_reuse.py)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessageChunk

from langgraph_kvcache import ChatKVCache


def _response(reasoning: str | None) -> dict:
    message = {"role": "assistant", "content": "Rivers bend."}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip


def _chunk(content: str, reasoning: str | None) -> dict:
    delta = {"role": "assistant", "content": content}
    if reasoning is not None:
        delta["reasoning"] = reasoning
    return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip


def test_an_answer_keeps_its_reasoning_only_with_the_option() -> None:
    on = ChatKVCache(base_url="http://127.0.0.1:9/v1", preserve_reasoning=True)
    off = ChatKVCache(base_url="http://127.0.0.1:9/v1")
    kept = on._create_chat_result(_response("water erodes the bank"))
    assert kept.generations[0].message.additional_kwargs["reasoning_content"] == (
        "water erodes the bank"
    )
    assert (
        "reasoning_content"
        not in off._create_chat_result(_response("water erodes the bank"))
        .generations[0]
        .message.additional_kwargs
    )
    assert (
        "reasoning_content"
        not in on._create_chat_result(_response(None)).generations[0].message.additional_kwargs
    )


def test_streamed_reasoning_pieces_join_into_the_message() -> None:
    model = ChatKVCache(base_url="http://127.0.0.1:9/v1", preserve_reasoning=True)
    pieces = [("", "water "), ("", "erodes"), ("Rivers bend.", None)]
    chunks = [model._convert_chunk_to_generation_chunk(_chunk(c, r), AIMessageChunk, None)
              for c, r in pieces]  # fmt: skip
    total = chunks[0]
    for chunk in chunks[1:]:
        assert chunk is not None and total is not None
        total = total + chunk
    assert total is not None
    assert total.message.content == "Rivers bend."
    assert total.message.additional_kwargs["reasoning_content"] == "water erodes"


def test_the_callers_choice_of_preserve_thinking_stands() -> None:
    from langchain_core.messages import HumanMessage

    base = "http://127.0.0.1:9/v1"
    own = {"chat_template_kwargs": {"preserve_thinking": False}}
    model = ChatKVCache(base_url=base, preserve_reasoning=True, extra_body=own)
    for call in ({}, {"extra_body": {"cache_salt": "s"}}):  # a call's extra_body replaces own
        body = model._get_request_payload([HumanMessage("hi")], **call)
        assert body["extra_body"]["chat_template_kwargs"] == {"preserve_thinking": False}
    body = ChatKVCache(base_url=base, preserve_reasoning=True)._get_request_payload(
        [HumanMessage("hi")], extra_body={"cache_salt": "s"}
    )
    assert body["extra_body"] == {"cache_salt": "s",
                                  "chat_template_kwargs": {"preserve_thinking": True}}  # fmt: skip
    with pytest.raises(ValueError, match="Chat Completions only"):
        ChatKVCache(base_url=base, preserve_reasoning=True, use_responses_api=True)
