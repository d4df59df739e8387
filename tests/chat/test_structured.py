"""ChatKVCache's tools and structured output against a real local HTTP peer: what is sent, what
comes back, and that the thread's session travels with every call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from pydantic import BaseModel

from langgraph_kvcache import ChatKVCache
from tests.chat.requests_sent import sent_sessions


class Answer(BaseModel):
    """The answer to a question."""

    answer: str


def test_bind_tools_round_trip(recorder: Any, model: ChatKVCache) -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    recorder.queue_chat(content="", tool_calls=[call])
    recorder.queue_chat(content="", tool_calls=[call])
    bound = model.bind_tools([add], tool_choice="any")
    cfg = {"configurable": {"thread_id": "tools"}}
    reply = bound.invoke("what is 2+3?", config=cfg)
    streamed = list(bound.stream("what is 2+3?", config=cfg))
    assert isinstance(reply, AIMessage)
    assert reply.tool_calls[0]["name"] == "add"
    assert reply.tool_calls[0]["args"] == {"a": 2, "b": 3}
    merged = streamed[0]
    for c in streamed[1:]:
        merged = merged + c
    assert merged.tool_calls[0]["args"] == {"a": 2, "b": 3}
    bodies = recorder.chat_bodies()
    assert sent_sessions(recorder) == ["tools", "tools"]
    assert bodies[0]["tools"][0]["function"]["name"] == "add"
    assert bodies[0]["tool_choice"] == "required"


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(recorder: Any, model: ChatKVCache, method: str) -> None:
    if method == "function_calling":
        args = json.dumps({"answer": "4"})
        call = {"id": "c1", "type": "function", "function": {"name": "Answer", "arguments": args}}
        recorder.queue_chat(content="", tool_calls=[call])
    else:
        recorder.queue_chat(content='{"answer": "4"}')
    structured = model.with_structured_output(Answer, method=method)
    result = structured.invoke("2+2? answer in JSON", config={"configurable": {"thread_id": "so"}})
    assert result == Answer(answer="4")
    assert sent_sessions(recorder) == ["so"]
    fmt = recorder.chat_bodies()[0].get("response_format") or {}
    if method == "function_calling":
        assert fmt == {}
    else:  # JSON mode with a schema is held to the schema, like json_schema
        assert fmt["type"] == "json_schema", fmt
        assert fmt["json_schema"]["schema"]["properties"] == {
            "answer": {"title": "Answer", "type": "string"}
        }


def test_json_mode_without_a_schema_is_any_json_object(recorder: Any, model: ChatKVCache) -> None:
    recorder.queue_chat(content='{"answer": "4"}')
    result = model.with_structured_output(method="json_mode").invoke("2+2? answer in JSON")
    assert result == {"answer": "4"}
    assert recorder.chat_bodies()[0]["response_format"] == {"type": "json_object"}


def test_structured_output_streaming_keeps_the_session(recorder: Any, model: ChatKVCache) -> None:
    recorder.queue_chat(content='{"answer": "4"}')
    structured = model.with_structured_output(Answer, method="json_schema")
    parts = list(structured.stream("2+2?", config={"configurable": {"thread_id": "so-stream"}}))
    assert parts[-1] == Answer(answer="4")
    assert sent_sessions(recorder) == ["so-stream"]
