"""What a cut answer holds: whether a tool call forced with ``tool_choice`` came back whole.

:class:`ChatKVCache` raises :class:`~langgraph_kvcache.errors.ToolCallCutError` when a forced
call was cut at ``max_tokens`` before its arguments were complete; these helpers tell a whole
call from a cut one, for a ChatResult and for a stream (kept in O(1) per chunk).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import AIMessageChunk
from langchain_core.outputs import ChatGenerationChunk, ChatResult

from langgraph_kvcache.errors import ToolCallCutError


class StreamedCall:
    """What a stream said, kept in O(1) per chunk: its text, its tool calls' pieces by index
    and the last generation info (merging each chunk into all the previous ones, as
    ``chunk + chunk`` does, costs quadratic time)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.info: dict[str, Any] | None = None

    def add(self, chunk: ChatGenerationChunk) -> None:
        message = chunk.message
        if isinstance(message.content, str):
            self.text.append(message.content)
        for piece in getattr(message, "tool_call_chunks", None) or []:
            call = self.calls.setdefault(piece.get("index") or 0, {"args": []})
            for key in ("name", "id"):
                call[key] = call.get(key) or piece.get(key)
            call["args"].append(piece.get("args") or "")
        if chunk.generation_info:
            self.info = {**(self.info or {}), **chunk.generation_info}

    @property
    def merged(self) -> AIMessageChunk:
        """The streamed message as one chunk."""
        pieces = [
            {"name": c.get("name"), "args": "".join(c["args"]), "id": c.get("id"), "index": i}
            for i, c in self.calls.items()
        ]
        return AIMessageChunk(content="".join(self.text), tool_call_chunks=pieces)  # type: ignore[arg-type]


def has_whole_call(result: object, kwargs: Mapping[str, Any]) -> bool:
    """Whether a cut answer holds a whole tool call: any parsed call of a ChatResult (the
    server's parser returns whole calls only), or a streamed call whose arguments are complete
    JSON naming every required parameter of its tool (from the request's ``tools``)."""
    if isinstance(result, ChatResult):
        return bool(getattr(result.generations[-1].message, "tool_calls", None))
    if not isinstance(result, StreamedCall):
        return False
    required = {
        tool["function"]["name"]: set(tool["function"].get("parameters", {}).get("required", []))
        for tool in kwargs.get("tools") or []
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
    }
    for call in result.calls.values():
        try:
            args = json.loads("".join(call["args"]))
        except ValueError:
            continue
        if isinstance(args, dict) and required.get(call.get("name"), set()) <= args.keys():
            return True
    return False


def check_forced_call(
    kwargs: Mapping[str, Any],
    info: Mapping[str, Any] | None,
    result: object,
    max_tokens: int | None,
) -> None:
    """Raise :class:`ToolCallCutError` when a forced tool call (``kwargs["tool_choice"]``)
    ended at ``max_tokens`` (the model's; a call's own wins) without a whole call. A whole call
    and a second one cut after it is a call: the server's parser returns only whole calls, and
    a stream's are checked here (a cut streamed call reads as ``{}`` or, parsed leniently by
    LangChain, ``{"title": "At"}`` for ``{"title": "At``)."""
    if kwargs.get("tool_choice") in (None, "auto", "none") or not info:
        return
    if info.get("finish_reason") != "length" or has_whole_call(result, kwargs):
        return
    limit = kwargs.get("max_tokens", kwargs.get("max_completion_tokens", max_tokens))
    raise ToolCallCutError(
        f"the forced tool call (tool_choice={kwargs['tool_choice']!r}) was cut at "
        f"max_tokens={limit} before its arguments were complete (finish_reason 'length'); "
        "an agent loop would take the partial call for a text answer. Raise max_tokens for "
        "this call (ChatKVCache(max_tokens=...) or .bind(max_tokens=...))",
        result.merged if isinstance(result, StreamedCall) else result,
    )
