"""Decoded list items handed out as copies (langgraph_kvcache/checkpoint/item_objects.py): what
is remembered, that no caller shares an object with the cache or another caller, and that a
saver's reads stay equal, byte for byte after serde, to a plain saver's reading."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from pydantic import BaseModel

from langgraph_kvcache.checkpoint.item_objects import ItemObjects
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

SERDE = JsonPlusSerializer()


class Parsed(BaseModel):
    answer: str


def rich_ai(i: int) -> AIMessage:
    return AIMessage(
        content=[{"type": "text", "text": f"answer {i}", "annotations": [{"n": i}]}],
        id=f"ai-{i}",
        additional_kwargs={"nested": {"deep": [1, 2, {"x": "y"}]}},
        response_metadata={"model_name": "m", "logprobs": [0.5, -1.0]},
        tool_calls=[{"name": "search", "args": {"q": f"q{i}", "k": [1, 2]}, "id": f"c{i}"}],
        usage_metadata={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        custom_extra={"a": [1]},
    )


def messages(n: int) -> list[Any]:
    out: list[Any] = []
    for i in range(n):
        if i % 3 == 0:
            out.append(HumanMessage(f"question {i}", id=f"h-{i}"))
        elif i % 3 == 1:
            out.append(rich_ai(i))
        else:
            out.append(ToolMessage(f"result {i}", tool_call_id=f"c{i - 1}", artifact={"r": [i]}))
    return out


def mutate(message: Any) -> None:
    """Change every mutable part a caller could reach."""
    if isinstance(message.content, list):
        message.content[0]["text"] = "changed"
        message.content[0]["annotations"].append({"n": -1})
    else:
        message.content = "changed"
    message.additional_kwargs["added"] = True
    message.additional_kwargs.get("nested", {}).setdefault("deep", []).append("more")
    message.response_metadata["added"] = 1
    if isinstance(message, AIMessage):
        message.tool_calls[0]["args"]["k"].append(3)
        message.tool_calls.append({"name": "x", "args": {}, "id": "new"})
        assert message.usage_metadata is not None
        message.usage_metadata["input_tokens"] = 99
        message.custom_extra["a"].append(2)  # type: ignore[attr-defined]
    if isinstance(message, ToolMessage):
        message.artifact["r"].append(-1)


def test_copies_are_equal_and_share_nothing() -> None:
    cache = ItemObjects()
    original = rich_ai(1)
    once = SERDE.loads_typed(SERDE.dumps_typed(original))
    assert cache.keep(b"d" * 16, once, 100) is once  # a first decode is only noted
    assert len(cache) == 0 and cache.copies([b"d" * 16]) == ([None], [0])
    decoded = SERDE.loads_typed(SERDE.dumps_typed(original))
    handed = cache.keep(b"d" * 16, decoded, 100)  # the second is remembered
    assert handed is not decoded and handed == decoded and len(cache) == 1
    (first, second), missing = cache.copies([b"d" * 16, b"d" * 16])
    assert missing == []
    assert first is not second and first == second == original
    assert SERDE.dumps_typed(first) == SERDE.dumps_typed(original)
    assert first.model_fields_set == decoded.model_fields_set
    mutate(first)
    mutate(handed)
    (again,), _ = cache.copies([b"d" * 16])
    assert again == original and SERDE.dumps_typed(again) == SERDE.dumps_typed(original)


@pytest.mark.parametrize(
    "value",
    [
        AIMessage("x", additional_kwargs={"parsed": Parsed(answer="a")}),  # an object inside
        AIMessage("x", additional_kwargs={"t": (1, 2)}),  # a tuple
        AIMessage("x", additional_kwargs={1: "int key"}),  # a non-str key
        {"role": "user", "content": "a plain dict item"},  # not a message
        "a string item",
    ],
)
def test_only_messages_of_plain_data_are_remembered(value: Any) -> None:
    cache = ItemObjects()
    assert cache.keep(b"e" * 16, value, 10) is value
    assert cache.keep(b"e" * 16, value, 10) is value
    assert len(cache) == 0
    assert cache.copies([b"e" * 16]) == ([None], [0])


def test_bound_evicts_the_oldest_and_zero_remembers_nothing() -> None:
    cache = ItemObjects(max_bytes=3 * (4 * 100 + 1024))
    for i in range(5):
        for _decode in range(2):
            cache.keep(bytes([i]) * 16, HumanMessage(f"m{i}"), 100)
    assert len(cache) == 3
    _, missing = cache.copies([bytes([i]) * 16 for i in range(5)])
    assert missing == [0, 1]
    off = ItemObjects(max_bytes=0)
    message = HumanMessage("m")
    for _decode in range(2):
        assert off.keep(b"f" * 16, message, 10) is message
    assert len(off) == 0


def put_thread(saver: Any, values: list[list[Any]]) -> list[Any]:
    config: Any = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    version = None
    configs = []
    for i, value in enumerate(values):
        version = saver.get_next_version(version, None)
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"messages": value}
        checkpoint["channel_versions"] = {"messages": version}
        config = saver.put(config, checkpoint, {"step": i}, {"messages": version})
        saver.put_writes(config, [("messages", [value[-1]])], f"task-{i}", "~0")
        configs.append(config)
    return configs


def test_saver_reads_equal_a_plain_saver_and_callers_share_nothing(
    db_url: str, tmp_path: Any
) -> None:
    all_messages = messages(30)
    values = [all_messages[: i + 1] for i in range(30)]
    values.append([*all_messages[:10], all_messages[20]])  # not an append: a snapshot
    with (
        SQLAlchemySaver.from_conn_string(db_url, snapshot_every=9) as ours,
        sqlite3.connect(tmp_path / "peer.db", check_same_thread=False) as conn,
    ):
        ours.setup()
        peer = SqliteSaver(conn)
        peer.setup()
        configs = put_thread(ours, values)
        peer_configs = put_thread(peer, values)
        with SQLAlchemySaver.from_conn_string(db_url) as reader:
            for _round in range(3):  # decoded, decoded and remembered, then copies
                for config, peer_config in zip(configs, peer_configs, strict=True):
                    got, want = reader.get_tuple(config), peer.get_tuple(peer_config)
                    assert got is not None and want is not None
                    mine = got.checkpoint["channel_values"]["messages"]
                    theirs = want.checkpoint["channel_values"]["messages"]
                    assert SERDE.dumps_typed(mine) == SERDE.dumps_typed(theirs)
                    assert [m.model_fields_set for m in mine] == [
                        m.model_fields_set for m in theirs
                    ]
                    assert [w[2] for w in got.pending_writes] == [w[2] for w in want.pending_writes]
                    for message in mine:  # a caller's changes reach no later read
                        mutate(message)
                    for _, _, written in got.pending_writes:
                        for message in written:
                            mutate(message)
            assert len(reader.lists.objects) == len(all_messages)
            listed = list(reader.list({"configurable": {"thread_id": "t"}}))
            peer_listed = list(peer.list({"configurable": {"thread_id": "t"}}))
            assert [SERDE.dumps_typed(t.checkpoint["channel_values"]) for t in listed] == [
                SERDE.dumps_typed(t.checkpoint["channel_values"]) for t in peer_listed
            ]
