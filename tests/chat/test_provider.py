"""One provider name on ChatKVCache's answers and in its LangSmith parameters.

LangChain's ``SummarizationMiddleware`` trusts the token usage an answer reports only when the
answer's ``response_metadata["model_provider"]`` matches the ``ls_provider`` of the model it
summarises with. ChatKVCache inherited ``"openai"`` on its answers while naming itself
``"langgraph-kvcache"`` to LangSmith, so a ``("tokens", N)`` trigger never fired on the usage
the server reported (only on LangChain's approximate count). The answers also went through
OpenAI's content-block translator, which drops vLLM's ``reasoning_content``.
"""

from __future__ import annotations

from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import SummarizationMiddleware
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_kvcache import ChatKVCache
from tests.chat.conftest import RecordingServer


def _model(recorder: RecordingServer, **kwargs: Any) -> ChatKVCache:
    return ChatKVCache(base_url=f"{recorder.url}/v1", model="m", max_retries=0, **kwargs)


def test_answers_name_the_provider_langsmith_sees(recorder: RecordingServer) -> None:
    model = _model(recorder)
    provider = model._get_ls_params()["ls_provider"]
    recorder.queue_chat(content="one")
    recorder.queue_chat(content="two")
    answer = model.invoke("hi")
    chunks = list(model.stream("hi"))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed = streamed + chunk
    assert answer.response_metadata["model_provider"] == provider == "langgraph-kvcache"
    assert isinstance(streamed, AIMessageChunk)
    assert streamed.response_metadata["model_provider"] == provider
    assert [b["type"] for b in answer.content_blocks] == ["text"]


def test_content_blocks_keep_vllms_reasoning(recorder: RecordingServer) -> None:
    recorder.queue_chat(content="Rivers bend.", reasoning="water")
    message = _model(recorder, preserve_reasoning=True).invoke("Why?")
    assert message.content_blocks == [
        {"type": "reasoning", "reasoning": "water"},
        {"type": "text", "text": "Rivers bend."},
    ]


def test_summarization_triggers_on_the_usage_the_server_reported(
    recorder: RecordingServer,
) -> None:
    model = _model(recorder)
    summarize = SummarizationMiddleware(model, trigger=("tokens", 1000), keep=("messages", 2))
    agent = create_agent(model, middleware=[summarize], checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "t"}}
    # Short messages (a few tokens by LangChain's count) but a long context reported by the
    # server: 1,500 prompt tokens, as after a large retrieved document.
    recorder.queue_chat(content="first answer", prompt_tokens=1500)
    agent.invoke({"messages": [HumanMessage("question one")]}, config)
    recorder.queue_chat(content="the summary")
    recorder.queue_chat(content="second answer")
    agent.invoke({"messages": [HumanMessage("question two")]}, config)
    bodies = recorder.chat_bodies()
    assert len(bodies) == 3, [b["messages"] for b in bodies]  # the answer, a summary, the answer
    messages = agent.get_state(config).values["messages"]
    assert "the summary" in str(messages[0].content)
    assert isinstance(messages[-1], AIMessage) and messages[-1].content == "second answer"
