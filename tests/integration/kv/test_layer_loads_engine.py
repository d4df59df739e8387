"""Layer-wise RAM loads on a real vLLM engine: in the step that loads, vLLM calls
``wait_for_layer_load`` for every attention layer, in order, after ``start_load_kv`` handed
the blocks to the copy thread; greedy outputs equal a cache-off run; a layer that fails to
copy is a miss that vLLM recomputes.

Shares the session engine of conftest.py (in-process, so the test reaches the worker through
vLLM's KV transfer group); each test uses its own sessions and random token prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kv_engine import BLOCK
from test_connector import Turn, hits, same_answer, tokens, turn

from server.kv.registry import Registry

pytestmark = pytest.mark.vllm


@pytest.fixture
def worker(llm: Any) -> Iterator[Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    assert connector.worker is not None and connector.worker.layer_loads is not None
    yield connector.worker


def second_turn(llm: Any, seed: int, blocks: int, session: str) -> tuple[int, list[int], Turn]:
    """Run a session's first turn (``blocks`` full blocks and 40 tokens); return the tokens it
    left for the second turn to load, the second turn's prompt and its cache-off answer."""
    p1 = tokens(seed, blocks * BLOCK + 40)
    first = turn(llm, p1, session)
    p2 = p1 + first.tokens + tokens(seed + 1, 60)
    return len(p1) + len(first.tokens) - 1, p2, turn(llm, p2, None, cache=False)


def test_layer_wise_loads_match_cache_off(
    llm: Any, registry: Registry, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    loadable, p2, ref = second_turn(llm, 201, 3, "layer-wise")

    connector = get_kv_transfer_group()
    real_wait = connector.wait_for_layer_load
    calls: list[tuple[str, bool]] = []  # (layer, the step has layer-wise loads)

    def recording_wait(layer_name: str) -> None:
        calls.append((layer_name, worker.layer_loads.busy))
        real_wait(layer_name)

    monkeypatch.setattr(connector, "wait_for_layer_load", recording_wait)
    before = hits(registry, "ram"), hits(registry, "ram", "tails")
    got = turn(llm, p2, "layer-wise")
    monkeypatch.undo()

    same_answer(got, ref)
    assert got.num_cached_tokens == loadable  # 3 blocks and the tail
    assert (hits(registry, "ram") - before[0], hits(registry, "ram", "tails") - before[1]) == (3, 1)
    loading = [name for name, busy in calls if busy]
    # vLLM waited on every attention layer, in order, in the step whose copies it started
    assert loading[: len(worker.layers)] == worker.layers, calls[: len(worker.layers) + 2]


def test_failed_layer_copy_is_recomputed_not_served(
    llm: Any, registry: Registry, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, p2, ref = second_turn(llm, 211, 2, "layer-fail")

    real_copy = worker.layer_loads._copy_layer
    failures: list[int] = []

    def failing_copy(layer: int, src: Any, dst: Any) -> None:
        if layer == 1 and not failures:  # the first batch's second layer only
            failures.append(len(dst))
            raise RuntimeError("injected layer copy failure")
        real_copy(layer, src, dst)

    monkeypatch.setattr(worker.layer_loads, "_copy_layer", failing_copy)
    before = hits(registry, "ram")
    got = turn(llm, p2, "layer-fail")
    monkeypatch.undo()

    assert failures == [2]  # the two full blocks were in the batch that failed
    assert hits(registry, "ram") - before == 2  # they were hits that failed to load...
    same_answer(got, ref)  # ...so vLLM recomputed them: the answer is the cache-off one
    assert got.num_cached_tokens == 0  # nothing before the first failed block was loaded

    again = turn(llm, p2, "layer-fail")  # the RAM copies themselves are sound
    same_answer(again, ref)
    assert again.num_cached_tokens >= 2 * BLOCK
