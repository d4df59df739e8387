"""``lgkv_hermes``: vLLM's hermes tool parser, returning each call's arguments as generated.

vLLM's ``hermes`` parser answers a non-streamed call with ``json.dumps(json.loads(arguments))``:
the keys and values the model wrote, re-spaced. The chat template (``templates/chatml_tools.jinja``)
puts a call's ``arguments`` string back verbatim, so on the next turn of an agent loop a
re-spaced call renders to other tokens than the ones generated, and the KV of everything after
that point is computed again. This parser returns the argument text exactly as generated (it is
valid JSON: the grammar or the check below makes sure), so the next request renders the tool turn
to the very tokens whose KV is cached. Streamed calls were already sent as generated (vLLM's
streaming path slices the same text); now both paths agree.

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
        for text, complete in self._extract_tool_call_jsons(model_output):
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


def _is_object(call_text: str, args: str) -> bool:
    """``call_text`` is one JSON object whose ``arguments`` value is exactly ``args``."""
    try:
        call, parsed = json.loads(call_text), json.loads(args)
    except ValueError:
        return False
    return isinstance(call, dict) and call.get("arguments") == parsed
