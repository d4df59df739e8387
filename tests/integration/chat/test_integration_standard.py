"""ChatKVCache and the session client against the real bundled server.

``kv_server_url`` (tests/integration/chat/conftest.py) is ``smollm2_server``: the default model
(SmolLM2-135M-Instruct) with the session KV connector on and no API key, shared with the agent
tests. Every standard feature the server serves is declared: tool calling and a forced tool
choice (vLLM constrains the call, arguments included, to the tool's schema), structured output
(JSON schema) and JSON mode (given a schema, ChatKVCache has the server hold the answer to it:
in plain JSON mode SmolLM2-135M nests ``{"setup":{"setup":...`` until the token limit). What
remains marked is what a 135M-parameter model cannot do, not what the server or ChatKVCache
lacks: each xfail says why; the one that writes to the token limit is not rerun (greedy
decoding makes the outcome fixed), the other fails on any other error.
"""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any, TypedDict

import httpx
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, AnyMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from openai import LengthFinishReasonError

from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.client import SessionNotFoundError

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 128  # at least this many prompt tokens come from the cache on a second turn
# Several KV blocks long, so a second request with the same history can reuse whole blocks.
LONG_SYSTEM = "You are a careful assistant. Answer briefly. " + " ".join(
    f"Fact {i}: the code word for {i} is {i * 7}." for i in range(60)
)


@functools.cache
def served_model(url: str) -> str:
    """The first model id the server lists (asked once per URL)."""
    r = httpx.get(f"{url}/v1/models", timeout=30.0)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def make_model(url: str, **kwargs: Any) -> ChatKVCache:
    params: dict[str, Any] = {"base_url": f"{url}/v1", "model": served_model(url), "timeout": 120}
    return ChatKVCache(**{**params, **kwargs})


def two_turns(model: ChatKVCache, session: str, *, stream: bool) -> AIMessage:
    """Ask twice with the same long history in one session; return the second answer."""
    history: list[AnyMessage] = [HumanMessage(f"{LONG_SYSTEM}\nWhat is the code word for 3?")]
    last: AIMessage | None = None
    for _ in range(2):
        if stream:
            chunks = list(model.stream(history, session_id=session, max_tokens=8))
            merged: AIMessageChunk = chunks[0]
            for c in chunks[1:]:
                merged = merged + c
            last = AIMessage(content=merged.content, usage_metadata=merged.usage_metadata)
        else:
            last = model.invoke(history, session_id=session, max_tokens=8)
    assert last is not None
    return last


@pytest.fixture(scope="session")
def kv_model_name(kv_server_url: str) -> str:
    """Asked once, outside any test (the standard VCR test replays HTTP and would refuse it)."""
    return served_model(kv_server_url)


class TestChatKVCacheIntegration(ChatModelIntegrationTests):
    """langchain-tests' standard integration suite on the real server."""

    @pytest.fixture(autouse=True)
    def _server(self, kv_server_url: str, kv_model_name: str) -> None:
        self._url = kv_server_url
        self._model_name = kv_model_name

    @property
    def chat_model_class(self) -> type[ChatKVCache]:
        return ChatKVCache

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # A fresh async HTTP client per model: each async standard test runs on its own event
        # loop, and langchain-openai's shared default client cannot outlive its first loop.
        # max_tokens: a 135M model left alone can ramble to the context limit (minutes a test
        # on CPU); 256 tokens hold every answer and structured output the tests check.
        return {
            "base_url": f"{self._url}/v1",
            "model": self._model_name,
            "max_tokens": 256,
            "http_async_client": httpx.AsyncClient(timeout=120.0),
        }

    @property
    def supports_model_override(self) -> bool:
        return False  # the server serves one model

    @property
    def has_tool_calling(self) -> bool:
        # The standard tool tests force the call (tool_choice="any", see has_tool_choice); the
        # server constrains a forced call to the tool's schema (--tool-strict-level parameter).
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        # json_schema (the default method) is grammar-constrained by vLLM (xgrammar, on CPU too).
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True  # with a schema, served as json_schema (ChatKVCache.with_structured_output)

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @pytest.mark.xfail(
        reason="a 135M model keeps writing inside the schema's strings past the standard "
        "100-token limit, so the JSON is cut short (LengthFinishReasonError; measured with "
        "greedy decoding, so not rerun: each run writes to the limit, minutes on a busy CPU)",
        raises=LengthFinishReasonError,
        run=False,
    )
    def test_structured_output_optional_param(self, model: Any) -> None:
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(
        reason="needs the model to decide by itself to call a tool (tool_choice auto): "
        "SmolLM2-135M answers the weather question in text, so there is no tool call",
        raises=AssertionError,
        strict=False,  # fails on any other error; a better model may pass
    )
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = make_model(self._url)
        return two_turns(model, f"std-cache-{uuid.uuid4().hex[:8]}", stream=stream)


# ----------------------------------------------------------------------------- beyond the standard
@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_second_turn_reads_the_sessions_cache(kv_server_url: str, stream: bool) -> None:
    model = make_model(kv_server_url)
    answer = two_turns(model, f"turns-{uuid.uuid4().hex[:8]}", stream=stream)
    usage = answer.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] > 2 * BLOCK_TOKENS
    assert usage["input_token_details"]["cache_read"] >= BLOCK_TOKENS


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def test_graph_thread_owns_a_server_session(kv_server_url: str) -> None:
    model = make_model(kv_server_url, max_tokens=8)

    def agent(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    thread = f"graph-{uuid.uuid4().hex[:8]}"
    cfg = {"configurable": {"thread_id": thread}}

    graph.invoke({"messages": [HumanMessage(f"{LONG_SYSTEM}\nCode word for 5?")]}, cfg)
    out = graph.invoke({"messages": [HumanMessage("And for 6?")]}, cfg)
    second = out["messages"][-1]
    assert second.usage_metadata["input_token_details"]["cache_read"] >= BLOCK_TOKENS

    with KVCacheClient(kv_server_url) as kv:
        session = kv.get_session(thread)
        assert session.turns >= 2
        assert session.num_tokens >= 2 * BLOCK_TOKENS
        assert kv.pin(thread).pinned
        fork = kv.copy_session(thread, f"{thread}-fork")
        assert fork.num_blocks == session.num_blocks
        assert kv.delete_session(f"{thread}-fork") >= 0
        assert not kv.unpin(thread).pinned
        kv.delete_session(thread)
        with pytest.raises(SessionNotFoundError):
            kv.get_session(thread)
