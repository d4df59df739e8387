"""``lgkv_hermes``: vLLM's hermes tool parser, arguments as generated, calls ended by their JSON.

Two things decide whether an agent's next call reuses the KV of its previous tool call: the
text the model generated, and the text the chat template renders from the call on the next
request. vLLM parses an earlier call's ``arguments`` into a dict before rendering, so the
template (``templates/chatml_tools.jinja``) writes them back in one spelling, the one SmolLM2
uses: ``tojson(indent=4)``. This parser returns each call's argument text exactly as generated
(vLLM's ``hermes`` re-spaces it with ``json.dumps``), so clients see what the model wrote, and
finds a call's end by parsing its JSON, so an argument that contains ``</tool_call>`` stays
inside its call.

Importing the module registers the parser (``--tool-call-parser lgkv_hermes``, the server's
default). vLLM is imported here, so only the server imports this module.
"""

from __future__ import annotations

import json

from vllm.entrypoints.generate.base.protocol import (
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

PARSER_NAME = "lgkv_hermes"


@ToolParserManager.register_module(PARSER_NAME)
class VerbatimHermesToolParser(Hermes2ProToolParser):
    """Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls, arguments kept
    byte for byte (see the module doc). A call whose text is not valid JSON falls back to vLLM's
    own handling (logged, returned as content)."""

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        """The calls in ``model_output`` with their generated argument text; the text before the
        first call is the content (``None`` when empty)."""
        if self.tool_call_start_token not in model_output:
            return super().extract_tool_calls(model_output, request)
        calls: list[ToolCall] = []
        for text, complete in self._calls_json_aware(model_output):
            name = self._extract_tool_name(text)
            args = self._extract_tool_args(text, True) if complete else None
            if not complete or name is None or args is None or not _is_object(text, args):
                return super().extract_tool_calls(model_output, request)
            calls.append(
                ToolCall(type="function", function=FunctionCall(name=name, arguments=args))
            )
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=calls, content=content or None
        )

    def _calls_json_aware(self, text: str) -> list[tuple[str, bool]]:
        """``(call JSON, complete)`` per ``<tool_call>`` region, each call's end found by parsing
        its JSON: an argument string may itself contain ``</tool_call>`` (the grammar allows any
        string), which vLLM's search for the end token would cut the call at. Regions that do
        not parse are split vLLM's way."""
        start_token, end_token = self.tool_call_start_token, self.tool_call_end_token
        decoder, out, pos = json.JSONDecoder(), [], 0
        while (start := text.find(start_token, pos)) != -1:
            body = _past_space(text, start + len(start_token))
            try:
                _, end = decoder.raw_decode(text, body)
            except ValueError:
                return out + self._extract_tool_call_jsons(text[start:])
            after = _past_space(text, end)
            if not text.startswith(end_token, after):
                return out + self._extract_tool_call_jsons(text[start:])
            out.append((text[body:end], True))
            pos = after + len(end_token)
        return out


def _past_space(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that ``str.strip`` would keep."""
    return len(text) - len(text[i:].lstrip())


def _is_object(call_text: str, args: str) -> bool:
    """``call_text`` is one JSON object whose ``arguments`` value is exactly ``args``."""
    try:
        call, parsed = json.loads(call_text), json.loads(args)
    except ValueError:
        return False
    return isinstance(call, dict) and call.get("arguments") == parsed
