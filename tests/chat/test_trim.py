"""trim_messages_stepped: the budget of trim_messages, and a prefix that moves in steps."""

from __future__ import annotations

import itertools

import pytest
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    trim_messages,
)

from langgraph_kvcache import trim_messages_stepped


def _words(messages: list[BaseMessage]) -> int:
    return sum(len(str(m.content).split()) for m in messages)


def _conversation(turns: int) -> list[BaseMessage]:
    out: list[BaseMessage] = [SystemMessage("sys " * 10)]
    for i in range(turns):
        out += [HumanMessage(f"q{i} " * (5 + i % 7)), AIMessage(f"a{i} " * (8 + i % 5))]
    return out


def test_the_budget_holds_and_the_prefix_moves_in_steps() -> None:
    history = _conversation(60)
    kept_starts, cuts = [], 0
    previous: list[BaseMessage] | None = None
    for n in range(3, len(history) + 1, 2):  # after each answer, as an agent loop sees it
        trimmed = trim_messages_stepped(history[:n], max_tokens=120, token_counter=_words)
        assert _words(trimmed) <= 120
        assert trimmed[0] == history[0] and isinstance(trimmed[1], HumanMessage)
        assert trimmed[1:] == history[n - len(trimmed) + 1 : n]  # the newest messages
        if previous is not None and trimmed[: len(previous)] != previous:
            cuts += 1  # the prompt does not extend the previous one
        previous = trimmed
        kept_starts.append(history.index(trimmed[1]))
    plain = [
        trim_messages(
            history[:n],
            max_tokens=120,
            token_counter=_words,
            include_system=True,
            start_on="human",
        )
        for n in range(3, len(history) + 1, 2)
    ]
    plain_cuts = sum(b[: len(a)] != a for a, b in itertools.pairwise(plain))
    assert kept_starts == sorted(kept_starts)
    assert cuts <= len(kept_starts) // 3, (cuts, len(kept_starts))
    assert plain_cuts > 2 * cuts  # plain trimming moves the cut at nearly every turn


def test_small_histories_and_bad_arguments() -> None:
    history = _conversation(2)
    assert trim_messages_stepped(history, max_tokens=10_000) == history
    with pytest.raises(ValueError, match="max_tokens"):
        trim_messages_stepped(history, max_tokens=0)
    with pytest.raises(ValueError, match="system message alone"):
        trim_messages_stepped(history, max_tokens=5, token_counter=_words)
    with pytest.raises(TypeError, match="token_counter"):
        trim_messages_stepped(history, max_tokens=50, token_counter=42)  # type: ignore[arg-type]


def test_a_tool_result_is_never_kept_without_its_call() -> None:
    call = AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "c1"}])
    history: list[BaseMessage] = [SystemMessage("s"), HumanMessage("old " * 50), call,
                                  ToolMessage("r " * 5, tool_call_id="c1"), AIMessage("done"),
                                  HumanMessage("new")]  # fmt: skip
    trimmed = trim_messages_stepped(history, max_tokens=20, token_counter=_words)
    assert trimmed == [history[0], history[-1]]
