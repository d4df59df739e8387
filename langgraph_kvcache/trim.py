"""Trim a conversation so that the server can still reuse its KV: cut in steps, not every turn.

LangChain's ``trim_messages(strategy="last")`` keeps the newest messages that fit the budget.
Once a conversation passes the budget, every new turn moves the cut: the prompt then starts
with another message each turn, no earlier prompt is a prefix of it, and the server reuses
nothing but the system prompt (measured with SmolLM2 and ``max_tokens=200``: the cached share
of the prompt fell from 0.81-0.92 per turn to 0.00 once trimming began).

:func:`trim_messages_stepped` cuts in steps instead. The kept history starts at the first
message at or after a cut position that moves only in whole steps of ``step_tokens``: when the
history passes ``max_tokens`` it is cut back by at least one step (to the low-water mark
``max_tokens - step_tokens`` or below), and that start stays where it is, turn after turn,
while the history grows back to ``max_tokens``. So most turns extend the previous prompt token
for token, and the server reads all of it from the cache; a turn that moves the cut recomputes.
No state is kept: the cut follows from the messages alone, so every process, every rerun and
every thread computes the same prompt.

The budget is the same as ``trim_messages``': the result never holds more than ``max_tokens``
by ``token_counter``. ::

    from langgraph_kvcache import ChatKVCache, trim_messages_stepped

    model = ChatKVCache()

    def chat(state: MessagesState) -> dict:
        prompt = trim_messages_stepped(state["messages"], max_tokens=2000)
        return {"messages": [model.invoke(prompt)]}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from langchain_core.language_models import BaseLanguageModel
from langchain_core.messages import (
    BaseMessage,
    HumanMessage,
    SystemMessage,
    convert_to_messages,
)
from langchain_core.messages.utils import MessageLikeRepresentation, count_tokens_approximately

__all__ = ["TokenCounter", "count_with", "trim_messages_stepped"]

TokenCounter = Callable[[list[BaseMessage]], int] | BaseLanguageModel[Any] | Literal["approximate"]


def trim_messages_stepped(
    messages: Iterable[MessageLikeRepresentation],
    *,
    max_tokens: int,
    step_tokens: int | None = None,
    token_counter: TokenCounter = "approximate",
    include_system: bool = True,
    start_on: type[BaseMessage] | Sequence[type[BaseMessage]] | None = HumanMessage,
) -> list[BaseMessage]:
    """The newest messages within ``max_tokens``, cut in steps so that the prompt prefix stays
    the same from turn to turn (see the module doc).

    Args:
        messages: the conversation, oldest first.
        max_tokens: the most tokens the result may hold (by ``token_counter``).
        step_tokens: how far the cut moves at once (default: half the budget left after the
            system message). Larger steps move the cut less often (more turns read the whole
            prompt from the cache) and keep less history right after a cut.
        token_counter: a function counting the tokens of a list of messages, a chat model
            (its ``get_num_tokens_from_messages``), or ``"approximate"`` (LangChain's
            ``count_tokens_approximately``, no tokenizer needed).
        include_system: keep a leading system message (it counts in the budget).
        start_on: message type(s) the kept history must start with (default
            ``HumanMessage``, so a tool result is never kept without the call before it);
            ``None`` for any.

    Raises:
        ValueError: ``max_tokens`` or ``step_tokens`` is not positive, or the system message
            alone is over ``max_tokens``.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if step_tokens is not None and step_tokens <= 0:
        raise ValueError(f"step_tokens must be > 0, got {step_tokens}")
    count = count_with(token_counter)
    msgs = convert_to_messages(messages)
    head: list[BaseMessage] = []
    if include_system and msgs and isinstance(msgs[0], SystemMessage):
        head, msgs = msgs[:1], msgs[1:]
    budget = max_tokens - (count(head) if head else 0)
    if budget < 0:
        raise ValueError(
            f"the system message alone holds more than max_tokens={max_tokens} tokens; "
            "raise max_tokens or shorten it"
        )
    sizes = [count([m]) for m in msgs]
    total = sum(sizes)
    if total <= budget and count(head + msgs) <= max_tokens:
        return head + msgs
    step = min(step_tokens or max(1, budget // 2), max(1, budget))
    cut = math.ceil(max(0, total - budget) / step) * step  # moves in whole steps only
    start, position = len(msgs), 0
    for i, size in enumerate(sizes):
        if position >= cut:
            start = i
            break
        position += size
    kinds = _kinds(start_on)
    while start < len(msgs) and kinds and not isinstance(msgs[start], kinds):
        start += 1
    kept = msgs[start:]
    while kept and count(head + kept) > max_tokens:  # a counter that is not additive
        kept = kept[1:]
        while kept and kinds and not isinstance(kept[0], kinds):
            kept = kept[1:]
    return head + kept


def count_with(token_counter: TokenCounter) -> Callable[[list[BaseMessage]], int]:
    """The message-list counting function ``token_counter`` names (see
    :func:`trim_messages_stepped`); ``TypeError`` for anything else."""
    if token_counter == "approximate":
        return count_tokens_approximately
    if isinstance(token_counter, BaseLanguageModel):
        return token_counter.get_num_tokens_from_messages
    if callable(token_counter):
        return token_counter
    raise TypeError(
        "token_counter must be a function of a list of messages, a chat model or "
        f"'approximate', not {token_counter!r}"
    )


def _kinds(
    start_on: type[BaseMessage] | Sequence[type[BaseMessage]] | None,
) -> tuple[type[BaseMessage], ...]:
    if start_on is None:
        return ()
    if isinstance(start_on, type):
        return (start_on,)
    return tuple(start_on)
