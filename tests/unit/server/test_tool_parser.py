"""``lgkv_hermes`` returns a call's arguments as generated (vLLM's ``hermes`` re-spaces them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SPACED = '<tool_call>\n{"name": "lookup", "arguments": {\n    "title":  "Atom"\n}}\n</tool_call>'


@pytest.fixture(scope="module")
def parser(tiny_model_dir: Path) -> object:
    from transformers import AutoTokenizer
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    import server.tool_parser

    cls = ToolParserManager.get_tool_parser(server.tool_parser.PARSER_NAME)
    assert cls is server.tool_parser.VerbatimHermesToolParser
    return cls(AutoTokenizer.from_pretrained(tiny_model_dir))


def _request() -> object:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Atom?"}])


def test_arguments_come_back_as_generated(parser: object) -> None:
    out = parser.extract_tool_calls("Let me look. " + SPACED, _request())  # type: ignore[attr-defined]
    assert out.tools_called and out.content == "Let me look. "
    (call,) = out.tool_calls
    assert call.function.name == "lookup"
    assert call.function.arguments == '{\n    "title":  "Atom"\n}'  # not re-spaced
    assert json.loads(call.function.arguments) == {"title": "Atom"}


def test_two_calls_and_no_content(parser: object) -> None:
    second = SPACED.replace("lookup", "search").replace('"title"', '"query"')
    out = parser.extract_tool_calls(SPACED + second, _request())  # type: ignore[attr-defined]
    assert out.content is None
    assert [c.function.name for c in out.tool_calls] == ["lookup", "search"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "lookup", "arguments": {"title": "At',  # cut by max_tokens
        '<tool_call>\n{"name": "lookup", "arguments": {"title": }}\n</tool_call>',  # not JSON
    ],
    ids=["cut", "broken"],
)
def test_a_call_that_is_not_json_is_not_a_call(parser: object, text: str) -> None:
    out = parser.extract_tool_calls(text, _request())  # type: ignore[attr-defined]
    assert not out.tools_called and out.tool_calls == []
    assert out.content == text


def test_plain_text_is_content(parser: object) -> None:
    out = parser.extract_tool_calls("The atom is small.", _request())  # type: ignore[attr-defined]
    assert not out.tools_called and out.content == "The atom is small."


def test_an_argument_that_contains_the_end_tag_stays_in_its_call(parser: object) -> None:
    """The grammar lets a string argument hold ``</tool_call>``; the call ends where its JSON
    does (SmolLM2 wrote this under ``tool_choice="required"``)."""
    text = (
        '<tool_call>\n{"name": "search", "arguments": {"query": "atomic theory?</tool_call>"}}'
        "\n</tool_call>"
    )
    out = parser.extract_tool_calls(text + SPACED, _request())  # type: ignore[attr-defined]
    assert [c.function.name for c in out.tool_calls] == ["search", "lookup"]
    assert json.loads(out.tool_calls[0].function.arguments) == {
        "query": "atomic theory?</tool_call>"
    }
