"""Joined list prefixes (:class:`~langgraph_kvcache.checkpoint.list_rows._PrefixLRU`): an
append of a list version joins only the items after its anchor, an entry is used only for
the digests it was built from, and values read back equal to what was put (SQLite and
PostgreSQL, warm and from a saver that remembers nothing)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from test_lists import Thread, _count

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.list_rows import (
    DIGEST_SIZE,
    MIN_PREFIX_ITEMS,
    ListVersion,
    _ByteLRU,
    _PrefixLRU,
    in_packed,
    joined_items,
)
from langgraph_kvcache.checkpoint.schema import items
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

KEY = ("t", "", "messages", "v1")


def test_an_entry_serves_only_digests_it_starts() -> None:
    cache = _PrefixLRU(max_bytes=10_000)
    a, b, c = (bytes([n]) * DIGEST_SIZE for n in (1, 2, 3))
    cache.put(KEY, a + b, b"AB")
    assert cache.get(KEY, a + b + c) == (2 * DIGEST_SIZE, b"AB")
    assert cache.get(KEY, a + b) == (2 * DIGEST_SIZE, b"AB")
    assert cache.get(KEY, a + c + b) is None  # same key, other items: never used
    assert cache.get(KEY, a) is None
    assert cache.get(("t", "", "messages", "v2"), a + b) is None


def test_entries_are_bounded_least_recently_used_first() -> None:
    entry = DIGEST_SIZE + 100 + 64
    cache = _PrefixLRU(max_bytes=2 * entry)
    digests = [os.urandom(DIGEST_SIZE) for _ in range(3)]
    cache.put(("t", "", "c", "0"), digests[0], b"0" * 100)
    cache.put(("t", "", "c", "1"), digests[1], b"1" * 100)
    assert cache.get(("t", "", "c", "0"), digests[0]) is not None  # now the most recent
    cache.put(("t", "", "c", "2"), digests[2], b"2" * 100)  # evicts "1"
    assert cache.get(("t", "", "c", "1"), digests[1]) is None
    assert cache.get(("t", "", "c", "0"), digests[0]) is not None
    cache.put(("t", "", "c", "0"), digests[0], b"x" * 100)  # replaced, not counted twice
    assert cache.get(("t", "", "c", "2"), digests[2]) is not None
    cache.put(("t", "", "c", "big"), digests[0], b"y" * (3 * entry))  # larger than the bound
    assert cache.get(("t", "", "c", "big"), digests[0]) is None


def test_in_packed_matches_whole_digests_only() -> None:
    a, b = os.urandom(DIGEST_SIZE), os.urandom(DIGEST_SIZE)
    packed = a + b
    assert in_packed(packed, a) and in_packed(packed, b)
    straddling = packed[DIGEST_SIZE // 2 : DIGEST_SIZE // 2 + DIGEST_SIZE]
    assert not in_packed(packed, straddling)
    assert not in_packed(b"", a)


def test_joined_items_reuses_the_anchor_and_falls_back_when_not_remembered() -> None:
    memory = _ByteLRU(max_bytes=1 << 20)
    cache = _PrefixLRU(max_bytes=1 << 20)
    digests = [os.urandom(DIGEST_SIZE) for _ in range(MIN_PREFIX_ITEMS + 3)]
    for i, d in enumerate(digests):
        memory.put(d, ("msgpack", bytes([i]) * 3))
    whole = b"".join(bytes([i]) * 3 for i in range(len(digests)))
    n = MIN_PREFIX_ITEMS + 1
    anchor = ListVersion("a", b"".join(digests[:n]), 1, ("s", 0), ("a", n))
    leaf = ListVersion("l", b"".join(digests), 2, ("s", 0), ("a", n))
    assert b"".join(joined_items(memory, cache, KEY[:3], leaf) or []) == whole
    assert cache.get((*KEY[:3], "a"), leaf.digests) == (n * DIGEST_SIZE, whole[: 3 * n])
    parts = joined_items(memory, cache, KEY[:3], anchor)
    assert parts == [whole[: 3 * n]]  # the anchor itself: a whole hit
    memory.put(b"j" * DIGEST_SIZE, ("json", b"{}"))
    other = ListVersion("o", leaf.digests + b"j" * DIGEST_SIZE, 3, ("s", 0), ("a", n))
    assert joined_items(memory, cache, KEY[:3], other) is None
    # A leaf of an anchor not remembered, whose snapshot is: the anchor's join is built on
    # the snapshot's and remembered.
    snapshot = ListVersion("s2", b"".join(digests[:n]), 0, ("s2", n), ("s2", n))
    assert joined_items(memory, cache, KEY[:3], snapshot) == [whole[: 3 * n]]
    leaf2 = ListVersion("l2", leaf.digests, 2, ("s2", n), ("a2", n + 1))
    assert b"".join(joined_items(memory, cache, KEY[:3], leaf2) or []) == whole
    assert cache.get((*KEY[:3], "a2"), leaf.digests) == ((n + 1) * DIGEST_SIZE, whole[: 3 * n + 3])
    short = ListVersion("x", b"".join(digests[:3]), 0, ("x", 3), ("x", 3))
    assert b"".join(joined_items(memory, cache, KEY[:3], short) or []) == whole[:9]
    assert cache.get((*KEY[:3], "x"), short.digests) is None  # too short to remember


def message(i: int) -> Any:
    text = f"turn {i}: " + "the agent looked up the weather and the trains " * 3
    return HumanMessage(text, id=f"h{i}") if i % 2 == 0 else AIMessage(text, id=f"a{i}")


def test_long_thread_reads_back_equal_with_repeats_and_an_edit(db_url: str) -> None:
    """Appends past several anchors, the same message (no id) appended twice, and a message
    edited in place once its anchor's join is remembered: every checkpoint reads back equal,
    from the writer and from a saver that remembers nothing; the repeated message is one
    item."""
    values: list[list[Any]] = []
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=49) as saver:
        saver.setup()
        thread = Thread(saver, "t")
        current: list[Any] = []
        for i in range(60):
            # Steps 20 and 21 append equal messages (no id): equal bytes, one item.
            current = [*current, HumanMessage("ok") if i in (20, 21) else message(i)]
            if i == 40:
                current[3].content = "edited in place"  # same object, new content
            values.append([m.model_copy() for m in current])
            thread.put(current)
        for config, expected in zip(thread.configs, values, strict=True):
            assert thread.read(config) == expected
        stored = _count(saver, items, "t")
    assert stored == 60 - 1 + 1  # "ok" once; the edited message is a new item
    with SQLAlchemySaver.from_conn_string(db_url, snapshot_every=49) as fresh:
        reader = Thread(fresh, "t")
        for config, expected in reversed(list(zip(thread.configs, values, strict=True))):
            assert reader.read(config) == expected
        listed = list(fresh.list({"configurable": {"thread_id": "t", "checkpoint_ns": ""}}))
        assert [t.checkpoint["channel_values"]["messages"] for t in listed] == values[::-1]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
async def test_latest_reads_decode_each_item_once(db_url: str, async_: bool) -> None:
    """A reader's repeated latest reads of a long thread give equal values; each item is
    decoded once and remembered, later reads get copies (:mod:`.item_objects`), never the
    objects an earlier read handed out."""
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        thread = Thread(saver, "t")
        current: list[Any] = []
        for i in range(MIN_PREFIX_ITEMS + 12):
            current = [*current, message(i)]
            thread.put(list(current))
    latest = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    if async_:
        async with AsyncSQLAlchemySaver.from_conn_string(db_url) as reader:
            first = await reader.aget_tuple(latest)
            again = await reader.aget_tuple(latest)
            remembered = len(reader.lists.objects)
    else:
        with SQLAlchemySaver.from_conn_string(db_url) as reader:
            first = reader.get_tuple(latest)
            again = reader.get_tuple(latest)
            remembered = len(reader.lists.objects)
    assert first is not None and again is not None
    assert first.checkpoint["channel_values"]["messages"] == current
    assert again.checkpoint["channel_values"]["messages"] == current
    assert remembered == len(current)
    pairs = zip(
        first.checkpoint["channel_values"]["messages"],
        again.checkpoint["channel_values"]["messages"],
        strict=True,
    )
    assert all(a is not b for a, b in pairs)
