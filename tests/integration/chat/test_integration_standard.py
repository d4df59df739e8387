"""ChatKVCache and the session client against the real bundled server.

``kv_server_url`` (tests/integration/chat/conftest.py) is the integration suite's shared server
(``server_url``): one model with the session KV connector on and no API key.

The model is whatever the server serves (read from ``/v1/models``); the skips below are what a
135M-parameter model cannot be relied on to do, not what the server or ChatKVCache lacks.
"""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any, TypedDict

import httpx
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, AnyMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from openai import LengthFinishReasonError
from pydantic import ValidationError

from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.client import SessionNotFoundError

pytestmark = pytest.mark.vllm

RANDOM_WEIGHT_MODELS = frozenset({"tiny-llama"})
"""Served names of random-weight test models (tests/integration/conftest.py's shared server)."""
BLOCK_TOKENS = 128  # vLLM's KV block size on CPU; only whole blocks are cached
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
        return {
            "base_url": f"{self._url}/v1",
            "model": self._model_name,
            "http_async_client": httpx.AsyncClient(timeout=120.0),
        }

    @property
    def supports_model_override(self) -> bool:
        return False  # the server serves one model

    @property
    def has_tool_calling(self) -> bool:
        # ChatKVCache passes tools through (tests/chat/test_chat_model.py checks the wire
        # format), but the standard checks need a model that calls magic_function(3) with
        # {"input": 3}; SmolLM2-135M answers in text ("auto") or, forced by "required", with
        # made-up arguments (seen: {'type': 'integer', 'required': ['input', 'integer']}).
        return False

    @property
    def has_structured_output(self) -> bool:
        # json_schema (the default method) is grammar-constrained by vLLM, and SmolLM2 ends the
        # JSON; the suite's random-weight model fills the grammar's whitespace until the length
        # limit (LengthFinishReasonError after ~2000 tokens), so the checks are skipped for it.
        return self._model_name not in RANDOM_WEIGHT_MODELS

    @property
    def supports_json_mode(self) -> bool:
        # json_object output has no schema to end it: a 135M model keeps writing keys until
        # the token limit cuts the JSON short (LengthFinishReasonError).
        return False

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @pytest.mark.xfail(
        reason="pydantic v1 schemas go through function calling; a 135M model makes no call "
        "(result None) or fills the arguments with a JSON string, not an object (seen: 'Feline')",
        raises=(ValidationError, OutputParserException, AssertionError),
        strict=False,  # fails on any other error; a better model may pass
    )
    def test_structured_output_pydantic_2_v1(self, model: Any) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(
        reason="a 135M model keeps writing inside the schema's strings past the standard "
        "100-token limit, so the JSON is cut short (LengthFinishReasonError)",
        raises=LengthFinishReasonError,
        strict=False,  # fails on any other error; a better model may pass
    )
    def test_structured_output_optional_param(self, model: Any) -> None:
        super().test_structured_output_optional_param(model)

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
