"""Forced tool calls on the real server: a named or ``required`` ``tool_choice`` returns a call
whose arguments follow the tool's schema, and the tool turn re-renders to the cached tokens.

Before ``--tool-strict-level parameter`` (server/config.py) vLLM's structural tag constrained
only the call's envelope (``<tool_call>{"name": "lookup", "arguments": ``): SmolLM2 filled the
arguments with the tool's JSON schema itself (``{"type": "string", "descrip...``), and a cut
answer reached the hermes parser as broken JSON (a logged traceback, the raw text as content).
"""

from __future__ import annotations

from typing import Any

import pytest
from agent_tools import BLOCK_TOKENS, TOOLS, lookup, system_prompt
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from langgraph_kvcache import ChatKVCache
from langgraph_kvcache.errors import ToolCallCutError

pytestmark = pytest.mark.vllm

QUESTION = "What does the encyclopedia say about the Atom? Look it up."


def _answer(model: Any, messages: list[Any], *, stream: bool, **kwargs: Any) -> AIMessage:
    if not stream:
        return model.invoke(messages, **kwargs)
    merged: AIMessageChunk | None = None
    for chunk in model.stream(messages, **kwargs):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    return AIMessage(
        content=merged.content,
        tool_calls=merged.tool_calls,
        usage_metadata=merged.usage_metadata,
        response_metadata=merged.response_metadata,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("choice", ["lookup", "required", "any"])
def test_forced_tool_choice_returns_a_schema_valid_call(
    agent_model: ChatKVCache, choice: str, stream: bool
) -> None:
    model = agent_model.bind_tools(list(TOOLS), tool_choice=choice)
    answer = _answer(model, [HumanMessage(QUESTION)], stream=stream)
    assert answer.tool_calls, f"no tool call; content: {answer.content!r}"
    assert "<tool_call>" not in str(answer.content)
    for call in answer.tool_calls:
        if choice == "lookup":
            assert call["name"] == "lookup"
        tool = {t.name: t for t in TOOLS}[call["name"]]
        assert tool.args_schema is not None
        tool.args_schema.model_validate(call["args"])  # the tool's own schema, strictly
        assert set(call["args"]) == set(tool.args), call["args"]
        print(f"  {choice}/{'stream' if stream else 'invoke'}: {call['name']}({call['args']})")


@pytest.mark.parametrize(
    "cut_at", [6, 12, 16], ids=["in-the-name", "before-the-arguments", "in-the-arguments"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_a_cut_forced_call_says_so(agent_model: ChatKVCache, stream: bool, cut_at: int) -> None:
    """A forced call cut by ``max_tokens`` came back as a text answer (``'<tool_call>\n{"name'``,
    no tool calls, ``finish_reason="length"``) that an agent loop took for the final answer, and
    never as a made-up call. Now it raises :class:`ToolCallCutError`, which says to raise
    ``max_tokens`` and holds the partial message; the same call with room is a whole call.
    Streamed, a cut call could pass for a whole one: cut before its arguments it streamed as
    ``lookup({})``, and LangChain parses streamed arguments leniently (``{"title": "At`` reads
    as ``{"title": "At"}``)."""
    model = agent_model.bind_tools([lookup], tool_choice="lookup")
    with pytest.raises(ToolCallCutError, match=f"max_tokens={cut_at}") as cut:
        _answer(model.bind(max_tokens=cut_at), [HumanMessage(QUESTION)], stream=stream)
    assert cut.value.message is not None
    assert isinstance(cut.value, ValueError)
    whole = _answer(model.bind(max_tokens=64), [HumanMessage(QUESTION)], stream=stream)
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "lookup"
    free = agent_model.bind_tools([lookup]).bind(max_tokens=2)  # not forced: text, no error
    assert _answer(free, [HumanMessage("Say hi.")], stream=stream).response_metadata


def test_tool_turn_keeps_the_prefix(agent_model: ChatKVCache, run_id: str) -> None:
    """The call after a tool result hits on the whole prompt before the tool call and on the
    call itself: the chat template renders it back to the tokens it was generated in (arguments
    with indent 4, forced words in whole tokens: docs/agents.md)."""
    session = f"tool-turn-{run_id}"
    model = agent_model.bind_tools(list(TOOLS), tool_choice="required")
    history: list[Any] = [SystemMessage(system_prompt()), HumanMessage(QUESTION)]
    first = model.invoke(history, session_id=session)
    assert first.tool_calls and first.usage_metadata
    call = first.tool_calls[0]
    tool = {t.name: t for t in TOOLS}[call["name"]]
    history += [first, ToolMessage(tool.invoke(call["args"]), tool_call_id=call["id"])]
    second = model.invoke(history, session_id=session)
    assert second.usage_metadata
    prompt = first.usage_metadata["input_tokens"]
    context = prompt + first.usage_metadata["output_tokens"]
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    print(f"  first call: prompt {prompt}, prompt + call {context}; next call cached {cached}")
    assert cached >= prompt // BLOCK_TOKENS * BLOCK_TOKENS, (prompt, cached)
    # and the call itself: the template writes it back as generated (docs/agents.md)
    assert cached >= 0.95 * context, (context, cached)
