"""CachedSummarizationMiddleware's state handling, on LangChain's real agent (no server: a
ChatKVCache that answers locally and records each request body; what the server reads back is
tests/integration/chat/test_summary_reuse.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import BaseModel

from langgraph_kvcache import ChatKVCache
from langgraph_kvcache.middleware import SUMMARY_INSTRUCTION, CachedSummarizationMiddleware


class LocalModel(ChatKVCache):
    """Answers without a server: ``summary`` to a summary request, ``answer N`` otherwise."""

    bodies: list[dict[str, Any]] = []
    summary: str = "SUMMARY"

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:  # fmt: skip
        body = self._get_request_payload(messages, stop=stop, **kwargs)
        self.bodies.append(body)
        last = str(body["messages"][-1].get("content"))
        text = self.summary if "ummar" in last else f"answer {len(self.bodies)}"
        return ChatResult(generations=[ChatGeneration(message=AIMessage(text))])


@tool
def lookup(title: str) -> str:
    """Look up an article."""
    return "notes"


def _history(n: int) -> list[Any]:
    out: list[Any] = []
    for i in range(n):
        out += [HumanMessage(f"question {i}", id=f"h{i}"), AIMessage(f"reply {i}", id=f"a{i}")]
    return out


def _run(middleware: list[Any], model: LocalModel | None = None, **agent: Any) -> list[Any]:
    model = model or LocalModel(base_url="http://127.0.0.1:9/v1", bodies=[])
    summarize = CachedSummarizationMiddleware(model, trigger=("messages", 5), keep=("messages", 3))
    graph = create_agent(model, tools=[lookup], system_prompt="SYS",
                         middleware=[*middleware, summarize], checkpointer=InMemorySaver(),
                         **agent)  # fmt: skip
    assert not any("Summarization" in node for node in graph.get_graph().nodes)  # no own node
    cfg: Any = {"configurable": {"thread_id": "t"}}
    graph.invoke({"messages": [*_history(4), HumanMessage("question 4", id="h4")]}, cfg)
    return [m.content for m in graph.get_state(cfg).values["messages"]]


def test_the_summary_call_continues_the_prompt_and_replaces_the_summarised_messages() -> None:
    model = LocalModel(base_url="http://127.0.0.1:9/v1", bodies=[])
    state = _run([], model)
    summary_call, answer_call = model.bodies
    assert summary_call["tool_choice"] == "none" and summary_call["tools"] == answer_call["tools"]
    sent = [m["content"] for m in summary_call["messages"]]
    assert sent == ["SYS", "question 0", "reply 0", "question 1", "reply 1", "question 2",
                    "reply 2", SUMMARY_INSTRUCTION]  # fmt: skip
    assert summary_call.get("max_completion_tokens", summary_call.get("max_tokens")) == 512
    assert state[0].endswith("SUMMARY") and state[1:] == ["question 3", "reply 3", "question 4",
                                                          "answer 2"]  # fmt: skip
    assert [m["content"] for m in answer_call["messages"]][1:] == state[:-1]


def test_changes_made_by_other_middleware_stay_theirs() -> None:
    @wrap_model_call
    def last_seven(request: Any, handler: Any) -> Any:  # a call-only view of the history
        return handler(request.override(messages=request.messages[-7:]))

    state = _run([last_seven])  # h0 and a0 were never in the view: kept, not summarised
    assert state[:2] == ["question 0", "reply 0"] and state[2].endswith("SUMMARY")
    assert state[3:] == ["question 3", "reply 3", "question 4", "answer 2"]

    @wrap_model_call
    def redact(request: Any, handler: Any) -> Any:
        response = handler(request)
        response.result = [AIMessage("[redacted]", id=response.result[0].id)]
        return response

    assert _run([redact])[-1] == "[redacted]"


def test_an_empty_summary_keeps_the_history(caplog: pytest.LogCaptureFixture) -> None:
    model = LocalModel(base_url="http://127.0.0.1:9/v1", bodies=[], summary="")
    with caplog.at_level(logging.WARNING):
        state = _run([], model)
    assert state[:9] == [m.content for m in _history(4)] + ["question 4"]
    assert "no text" in caplog.text


def test_with_a_response_format_it_falls_back_to_langchains_summary_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Answer(BaseModel):
        text: str

    model = LocalModel(base_url="http://127.0.0.1:9/v1", bodies=[])
    with caplog.at_level(logging.WARNING):
        state = _run([], model, response_format=Answer)
    assert state[0].endswith("SUMMARY")
    assert len(model.bodies[0]["messages"]) == 1  # LangChain's summary prompt, one message
    assert "response_format" in caplog.text
