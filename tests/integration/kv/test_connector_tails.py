"""Partial tail blocks on a real vLLM engine: the next turn reuses the previous turn's whole
prompt and answer (all but its last token, whose KV was never computed), from RAM and from
disk, and greedy outputs equal a cache-off run.

Shares the session engine of conftest.py (RAM 8 blocks, disk 24); each test uses its own
sessions and random token prompts, so no two share a block. ``turn`` resets vLLM's prefix
cache first, so every hit comes from the connector's tiers.
"""

from __future__ import annotations

from typing import Any

import pytest
from kv_engine import BLOCK, RAM_BLOCKS
from test_connector import TENANT, hits, same_answer, tier_blocks, tokens, turn

from server.kv.keys import parse_tail_key
from server.kv.registry import Registry

pytestmark = pytest.mark.vllm


def share(cached: int, prompt: list[int], answer: list[int], label: str) -> float:
    prior = len(prompt) + len(answer)
    value = cached / prior
    print(f"\n{label}: turn 2 cached {cached} of the {prior} tokens of turn 1 ({value:.1%})")
    return value


def test_next_turn_reuses_prompt_and_answer_from_ram(llm: Any, registry: Registry) -> None:
    p1 = tokens(101, 2 * BLOCK + 50)
    first = turn(llm, p1, "tail-ram")
    p2 = p1 + first.tokens + tokens(102, 30)
    ref = turn(llm, p2, None, cache=False)
    before = (hits(registry, "ram"), hits(registry, "ram", "tails"))
    got = turn(llm, p2, "tail-ram")
    same_answer(got, ref)
    assert got.num_cached_tokens == len(p1) + len(first.tokens) - 1  # all but the last token
    assert (hits(registry, "ram") - before[0], hits(registry, "ram", "tails") - before[1]) == (2, 1)
    assert share(got.num_cached_tokens, p1, first.tokens, "RAM") >= 0.99
    keys = registry.session_keys(TENANT, "tail-ram")
    tails = [k for k in keys if parse_tail_key(k)]
    assert tails == [keys[-1]]  # turn 2's own tail; turn 1's was superseded
    assert parse_tail_key(keys[-1]) == (keys[-2], len(p2) + len(got.tokens) - 1 - 2 * BLOCK)


def test_next_turn_reuses_tail_from_disk(llm: Any, registry: Registry) -> None:
    p1 = tokens(111, 3 * BLOCK + 90)
    first = turn(llm, p1, "tail-disk")
    turn(llm, tokens(112, RAM_BLOCKS * BLOCK + 10), "tail-push")  # pushes the session out of RAM
    assert tier_blocks(llm, registry, "tail-disk", ram=0, disk=4) == {"ram": 0, "disk": 4}
    p2 = p1 + first.tokens + tokens(113, 20)
    ref = turn(llm, p2, None, cache=False)
    before = hits(registry, "disk", "tails")
    got = turn(llm, p2, "tail-disk")
    same_answer(got, ref)
    assert got.num_cached_tokens == len(p1) + len(first.tokens) - 1
    assert hits(registry, "disk", "tails") - before == 1
    assert share(got.num_cached_tokens, p1, first.tokens, "disk") >= 0.99


def test_tail_covering_the_whole_prompt_leaves_its_last_token(llm: Any, registry: Registry) -> None:
    p1 = tokens(121, BLOCK + 70)
    first = turn(llm, p1, "tail-full")
    p2 = p1 + first.tokens[:-1]  # exactly the tokens turn 1 computed
    ref = turn(llm, p2, None, cache=False)
    got = turn(llm, p2, "tail-full")
    same_answer(got, ref)
    assert got.num_cached_tokens == len(p2) - 1  # vLLM computes at least one token


def test_tail_of_another_prompt_is_used_up_to_the_first_difference(
    llm: Any, registry: Registry
) -> None:
    p1 = tokens(131, BLOCK + 60)
    first = turn(llm, p1, "tail-other")
    p2 = [*p1[:-1], p1[-1] + 1, *first.tokens]  # differs inside the tail
    ref = turn(llm, p2, None, cache=False)
    before = hits(registry, "ram", "tails")
    got = turn(llm, p2, "tail-other")
    same_answer(got, ref)
    # the tail's tokens before the changed one (a rewind into a tail: continuations.py)
    assert got.num_cached_tokens == len(p1) - 1 and hits(registry, "ram", "tails") == before + 1


# A session is a tree (server/kv/scheduler/continuations.py): every call stream keeps its tail,
# and a rewind or fork reuses a stored block up to the last token it shares.


def test_a_nested_call_stream_keeps_the_threads_tail(llm: Any, registry: Registry) -> None:
    p1 = tokens(141, 2 * BLOCK + 50)
    first = turn(llm, p1, "tree-nested")  # the agent's call
    q1 = tokens(142, BLOCK + 30)
    nested = turn(llm, q1, "tree-nested")  # a tool's own model call in the same thread
    keys = registry.session_keys(TENANT, "tree-nested")
    assert len([k for k in keys if parse_tail_key(k)]) == 2  # both streams' tails
    p2 = p1 + first.tokens + tokens(143, 20)
    ref = turn(llm, p2, None, cache=False)
    got = turn(llm, p2, "tree-nested")
    same_answer(got, ref)
    assert got.num_cached_tokens == len(p1) + len(first.tokens) - 1
    assert share(got.num_cached_tokens, p1, first.tokens, "agent after a nested call") >= 0.99
    q2 = q1 + nested.tokens + tokens(144, 20)  # and the nested stream's next call
    ref = turn(llm, q2, None, cache=False)
    got = turn(llm, q2, "tree-nested")
    same_answer(got, ref)
    assert got.num_cached_tokens == len(q1) + len(nested.tokens) - 1
    assert share(got.num_cached_tokens, q1, nested.tokens, "nested call after the agent") >= 0.99


def test_a_rewind_reuses_up_to_the_last_shared_token(llm: Any, registry: Registry) -> None:
    p1 = tokens(151, 3 * BLOCK + 40)
    turn(llm, p1, "tree-rewind")
    for shared in (BLOCK + 41, 87):  # inside a full block; inside the first block
        p2 = p1[:shared] + tokens(152 + shared, 25)  # back to a checkpoint, a new message
        ref = turn(llm, p2, None, cache=False)
        before = hits(registry, "ram", "tails")
        got = turn(llm, p2, "tree-rewind")
        same_answer(got, ref)
        print(f"\nrewind sharing {shared} tokens: cached {got.num_cached_tokens}")
        assert got.num_cached_tokens == shared
        assert hits(registry, "ram", "tails") == before + 1  # the block, loaded in part
