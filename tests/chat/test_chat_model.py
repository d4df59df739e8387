"""ChatKVCache against a real local HTTP peer: which session each request names, and usage."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessageChunk, AnyMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages

from langgraph_kvcache import ChatKVCache, session_id_for
from tests.chat.requests_sent import sent_sessions


# ----------------------------------------------------------------------------- defaults
def test_defaults_point_at_the_bundled_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LGKV_SERVER_URL", "LGKV_API_KEY", "OPENAI_API_KEY", "OPENAI_API_BASE"):
        monkeypatch.delenv(var, raising=False)
    model = ChatKVCache()
    assert model.openai_api_base == "http://127.0.0.1:8000/v1"
    assert model.openai_api_key is not None
    assert model.openai_api_key.get_secret_value() == "EMPTY"
    assert model.model_name == "SmolLM2-135M-Instruct"
    assert model.temperature == 0.0
    assert model.stream_usage is True
    assert model.session_id is None


def test_environment_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LGKV_SERVER_URL", "http://gpu-box:9000/")
    monkeypatch.setenv("LGKV_API_KEY", "sk-local")
    monkeypatch.setenv("OPENAI_API_BASE", "https://api.openai.com/v1")  # must not win
    model = ChatKVCache()
    assert model.openai_api_base == "http://gpu-box:9000/v1"
    assert model.openai_api_key is not None
    assert model.openai_api_key.get_secret_value() == "sk-local"


def test_bad_explicit_session_id_is_refused_early(recorder: Any) -> None:
    with pytest.raises(ValueError, match="session_id_for"):
        ChatKVCache(base_url=f"{recorder.url}/v1", session_id="has space")
    model = ChatKVCache(base_url=f"{recorder.url}/v1")
    with pytest.raises(ValueError, match=r"(?i)invalid session id"):
        model.invoke("hi", session_id="a/b")
    assert recorder.chat_bodies() == []


# ----------------------------------------------------------------------------- session choice
def test_no_thread_no_session(recorder: Any, model: ChatKVCache) -> None:
    model.invoke("hello")
    assert sent_sessions(recorder) == [None]


def test_thread_id_in_the_invoke_config(recorder: Any, model: ChatKVCache) -> None:
    reply = model.invoke("hello", config={"configurable": {"thread_id": "thread-7"}})
    assert reply.content == "Hello from the recording server."
    body = recorder.chat_bodies()[0]
    assert body["prompt_cache_key"] == "thread-7"
    assert body["model"] == "SmolLM2-135M-Instruct"
    assert body["temperature"] == 0.0
    assert "session_id" not in body


def test_explicit_session_beats_the_thread(recorder: Any) -> None:
    cfg = {"configurable": {"thread_id": "thread-7"}}
    fixed = ChatKVCache(base_url=f"{recorder.url}/v1", session_id="fixed", max_retries=0)
    fixed.invoke("a", config=cfg)
    fixed.invoke("b", config=cfg, session_id="per-call")
    fixed.bind(session_id="bound").invoke("c", config=cfg)
    fixed.invoke("d", config=cfg, prompt_cache_key="raw-key")
    kwargs_model = ChatKVCache(
        base_url=f"{recorder.url}/v1", model_kwargs={"prompt_cache_key": "mk"}, max_retries=0
    )
    kwargs_model.invoke("e", config=cfg)
    assert sent_sessions(recorder) == ["fixed", "per-call", "bound", "raw-key", "mk"]


def test_odd_thread_ids_are_mapped(recorder: Any, model: ChatKVCache) -> None:
    model.invoke("x", config={"configurable": {"thread_id": "user 1/chat"}})
    assert sent_sessions(recorder) == [session_id_for("user 1/chat")]


def test_batch_keeps_each_inputs_thread(recorder: Any, model: ChatKVCache) -> None:
    configs = [{"configurable": {"thread_id": f"t{i}"}} for i in range(3)]
    model.batch(["a", "b", "c"], config=configs)
    assert sorted(s or "" for s in sent_sessions(recorder)) == ["t0", "t1", "t2"]


@pytest.mark.asyncio(loop_scope="session")
async def test_async_invoke_and_batch(recorder: Any, model: ChatKVCache) -> None:
    await model.ainvoke("a", config={"configurable": {"thread_id": "async-1"}})
    await model.abatch(["b"], config={"configurable": {"thread_id": "async-2"}})
    assert sent_sessions(recorder) == ["async-1", "async-2"]


def test_generate_inside_a_runnable_context_uses_its_thread(
    recorder: Any, model: ChatKVCache
) -> None:
    from langchain_core.runnables import RunnableLambda

    def call(messages: list[AnyMessage]) -> str:
        # generate() bypasses invoke(); the session comes from the running config
        return model.generate([messages]).generations[0][0].text

    RunnableLambda(call).invoke([HumanMessage("hi")], config={"configurable": {"thread_id": "ctx"}})
    assert sent_sessions(recorder) == ["ctx"]


# ----------------------------------------------------------------------------- LangGraph
class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def _chat_graph(model: ChatKVCache) -> Any:
    def agent(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    inner = StateGraph(State)
    inner.add_node("summarize", agent)
    inner.add_edge(START, "summarize")

    outer = StateGraph(State)
    outer.add_node("agent", agent)
    outer.add_node("research", inner.compile())
    outer.add_edge(START, "agent")
    outer.add_edge("agent", "research")
    return outer.compile(checkpointer=InMemorySaver())


def test_graph_node_and_subgraph_sessions(recorder: Any, model: ChatKVCache) -> None:
    graph = _chat_graph(model)
    cfg = {"configurable": {"thread_id": "conv-1"}}
    graph.invoke({"messages": [HumanMessage("first")]}, cfg)
    graph.invoke({"messages": [HumanMessage("second")]}, cfg)
    # root node -> the thread's session; subgraph node -> one stable session per subgraph
    assert sent_sessions(recorder) == ["conv-1", "conv-1|research", "conv-1", "conv-1|research"]
    # the session's history grows turn by turn (what makes its KV reusable)
    root_bodies = [b for b in recorder.chat_bodies() if b["prompt_cache_key"] == "conv-1"]
    first, second = (b["messages"] for b in root_bodies)
    assert second[: len(first)] == first


@pytest.mark.asyncio(loop_scope="session")
async def test_graph_async_streaming_node(recorder: Any, model: ChatKVCache) -> None:
    async def agent(state: State) -> dict[str, Any]:
        chunks = [c async for c in model.astream(state["messages"])]
        message = chunks[0]
        for c in chunks[1:]:
            message = message + c
        return {"messages": [message]}

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    graph = builder.compile(checkpointer=InMemorySaver())
    recorder.queue_chat(content="streamed words here", prompt_tokens=300, cached_tokens=256)
    out = await graph.ainvoke(
        {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "s1"}}
    )
    assert sent_sessions(recorder) == ["s1"]
    assert recorder.chat_bodies()[0]["stream"] is True
    final = out["messages"][-1]
    assert final.content == "streamed words here"
    assert final.usage_metadata["input_token_details"]["cache_read"] == 256


def test_session_header_survives_extra_headers_and_retries(recorder: Any) -> None:
    """A failed request (here HTTP 502, as a router answers for a replica that died) is sent
    again by the OpenAI client with the same session header, so the router re-hashes it onto
    a live replica; headers the caller adds stay."""
    model = ChatKVCache(base_url=f"{recorder.url}/v1", max_retries=2)
    recorder.queue_chat(status=502)
    recorder.queue_chat(status=500)
    recorder.queue_chat(content="third time")
    reply = model.invoke(
        "hi", config={"configurable": {"thread_id": "retry-1"}}, extra_headers={"X-Trace": "7"}
    )
    assert reply.content == "third time"
    assert sent_sessions(recorder) == ["retry-1"] * 3
    assert [r.header("X-Trace") for r in recorder.chat_requests()] == ["7"] * 3


# ----------------------------------------------------------------------------- usage, streaming
def test_invoke_reports_cached_prompt_tokens(recorder: Any, model: ChatKVCache) -> None:
    recorder.queue_chat(prompt_tokens=400, cached_tokens=384, completion_tokens=7)
    reply = model.invoke("hi", session_id="u1")
    assert reply.usage_metadata is not None
    assert reply.usage_metadata["input_tokens"] == 400
    assert reply.usage_metadata["output_tokens"] == 7
    assert reply.usage_metadata["input_token_details"]["cache_read"] == 384


def test_stream_sends_session_and_reports_usage(recorder: Any, model: ChatKVCache) -> None:
    recorder.queue_chat(content="one two three", prompt_tokens=200, cached_tokens=128)
    chunks = list(model.stream("hi", config={"configurable": {"thread_id": "st"}}))
    assert len(chunks) > 3
    body = recorder.chat_bodies()[0]
    assert sent_sessions(recorder) == ["st"]
    assert body["stream_options"] == {"include_usage": True}
    total: AIMessageChunk = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == "one two three"
    assert total.usage_metadata is not None
    assert total.usage_metadata["input_token_details"]["cache_read"] == 128


# ----------------------------------------------------------------------------- tools, structure
def test_prebuilt_react_agent_loop_uses_the_thread(recorder: Any, model: ChatKVCache) -> None:
    import warnings

    from langgraph.prebuilt import create_react_agent

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    recorder.queue_chat(content="", tool_calls=[call])
    recorder.queue_chat(content="2 + 3 = 5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent's deprecation notice
        agent = create_react_agent(model, [add], checkpointer=InMemorySaver())
    out = agent.invoke(
        {"messages": [HumanMessage("what is 2+3?")]}, {"configurable": {"thread_id": "react-1"}}
    )
    assert out["messages"][-1].content == "2 + 3 = 5"
    bodies = recorder.chat_bodies()
    assert sent_sessions(recorder) == ["react-1", "react-1"]
    # the second call carries the tool result after the first call's history (a growing prefix)
    assert bodies[1]["messages"][: len(bodies[0]["messages"])] == bodies[0]["messages"]
    assert bodies[1]["messages"][-1] == {"role": "tool", "content": "5", "tool_call_id": "c1"}


def test_graph_token_streaming_uses_the_thread(recorder: Any, model: ChatKVCache) -> None:
    graph = _chat_graph(model)
    recorder.queue_chat(content="root answer here", prompt_tokens=260, cached_tokens=128)
    recorder.queue_chat(content="sub answer")
    cfg = {"configurable": {"thread_id": "tok-1"}}
    tokens = [
        chunk.content
        for chunk, _meta in graph.stream(
            {"messages": [HumanMessage("hi")]}, cfg, stream_mode="messages", subgraphs=False
        )
        if isinstance(chunk, AIMessageChunk) and chunk.content
    ]
    assert "".join(tokens) == "root answer here"  # subgraph tokens need subgraphs=True
    bodies = recorder.chat_bodies()
    assert [b["stream"] for b in bodies] == [True, True]  # LangGraph asks for token streaming
    assert sent_sessions(recorder) == ["tok-1", "tok-1|research"]


# ----------------------------------------------------------------------------- errors
def test_connection_errors_say_what_happened_and_where() -> None:
    """The OpenAI client's bare "Connection error." named no URL, and a timeout read like a
    refused connection; both now say which server and what to do, as the same types."""
    import socket

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    dead = ChatKVCache(base_url=dead_url, max_retries=0)
    for call in (lambda: dead.invoke("Hi"), lambda: list(dead.stream("Hi"))):
        with pytest.raises(openai.APIConnectionError) as info:
            call()
        assert not isinstance(info.value, openai.APITimeoutError)
        assert dead_url in str(info.value) and "LGKV_SERVER_URL" in str(info.value)
    with socket.socket() as hung:  # accepts connections (backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(4)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/v1"
        slow = ChatKVCache(base_url=url, timeout=0.3, max_retries=0)
        with pytest.raises(openai.APITimeoutError) as timed_out:
            slow.invoke("Hi")
    assert url in str(timed_out.value) and "timeout=0.3" in str(timed_out.value)
    assert "cannot reach" not in str(timed_out.value)


def test_a_cut_streamed_call_is_whole_only_with_complete_required_arguments() -> None:
    """A forced call cut at ``max_tokens`` raises unless a whole call came before the cut
    (the server-side checks are in tests/integration/agents/test_tool_choice.py)."""
    from langchain_core.outputs import ChatGenerationChunk

    from langgraph_kvcache.cut_calls import StreamedCall, has_whole_call

    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": schema}}]

    def streamed(*pieces: tuple[int, str]) -> StreamedCall:
        out = StreamedCall()
        for index, args in pieces:
            chunk = {"name": "lookup", "args": args, "id": f"c{index}", "index": index}
            out.add(
                ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[chunk]))
            )
        return out

    assert not has_whole_call(streamed((0, "{}")), {"tools": tools})  # title missing
    assert not has_whole_call(streamed((0, '{"title": "At')), {"tools": tools})
    assert has_whole_call(streamed((0, '{"title": "At'), (0, 'om"}')), {"tools": tools})
    whole_then_cut = streamed((0, '{"title": "Atom"}'), (1, '{"ti'))
    assert has_whole_call(whole_then_cut, {"tools": tools})
    assert not has_whole_call(StreamedCall(), {"tools": tools})
