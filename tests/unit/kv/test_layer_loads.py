"""Layer-wise RAM loads (``server.kv.worker.layer_loads``) and the worker's use of them, on plain
tensors (no engine): per-layer waits, tails copied before the forward, failures as misses."""

from __future__ import annotations

import logging
import threading

import pytest

torch = pytest.importorskip("torch")

from server.kv.metadata import LoadItem, LoadJob, SaveItem, StepPlan  # noqa: E402
from server.kv.worker.layer_loads import LayerLoads  # noqa: E402
from server.kv.worker.worker import SessionKVWorker  # noqa: E402

NUM_BLOCKS, SHAPE = 16, (2, 8, 4)
LAYERS = ["l0", "l1", "l2"]
LAYER_BYTES = 2 * 8 * 4 * 4
KEYS = [f"{i:02x}" * 32 for i in range(8)]


def make(kv: dict[str, torch.Tensor]) -> SessionKVWorker:
    worker = SessionKVWorker(
        num_slots=4, layers=LAYERS, layer_block_bytes=[LAYER_BYTES] * 3, store=None
    )
    worker.register_kv_caches(kv, NUM_BLOCKS)
    return worker


def saved(worker: SessionKVWorker, kv: dict[str, torch.Tensor], blocks: list[int]) -> dict:
    """Save paged ``blocks`` to slots 0.. and return their contents per block and layer."""
    worker.save(StepPlan(saves=[SaveItem(b, KEYS[s], s, False) for s, b in enumerate(blocks)]))
    return {b: {n: kv[n][b].clone() for n in LAYERS} for b in blocks}


class GatedCopy:
    """A copy function that waits for permission before each layer and records calls."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.gates = [threading.Event() for _ in LAYERS]
        self.copied: list[int] = []
        self.fail_at = fail_at

    def __call__(self, layer: int, src: list[int], dst: list[int]) -> None:
        assert self.gates[layer].wait(10)
        if layer == self.fail_at:
            raise RuntimeError("injected")
        self.copied.append(layer)


def test_wait_layer_returns_once_its_layer_is_copied_not_the_later_ones() -> None:
    copy = GatedCopy()
    loads = LayerLoads(LAYERS, copy)
    loads.start([0, 1], [5, 6])
    copy.gates[0].set()
    loads.wait_layer("l0")
    assert copy.copied == [0]  # layers 1 and 2 are still waiting: l0's attention may run
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (loads.wait_layer("l2"), waited.set()))
    waiter.start()
    copy.gates[1].set()
    loads.wait_layer("l1")
    assert not waited.wait(0.05)  # l2 is not copied yet
    copy.gates[2].set()
    assert waited.wait(10)
    slots, failed, seconds = loads.finish() or ((), (), -1.0)
    assert list(slots) == [0, 1] and not failed and seconds >= 0
    assert loads.finish() is None  # nothing in flight
    loads.wait_layer("l0")  # returns at once with nothing in flight
    loads.wait_layer("not-ours")
    loads.close()


def test_failed_layer_fails_every_block_and_releases_the_waiters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    copy = GatedCopy(fail_at=1)
    for gate in copy.gates:
        gate.set()
    loads = LayerLoads(LAYERS, copy)
    with caplog.at_level(logging.WARNING, logger="server.kv.worker.layer_loads"):
        loads.start([0, 1], [5, 6])
        loads.wait_layer("l2")  # does not hang: later layers are given up, not copied
        done = loads.finish()
    assert done is not None and done[1] == [5, 6]
    assert copy.copied == [0]
    assert "recomputed" in caplog.text
    loads.close()


def test_worker_copies_layer_by_layer_and_releases_slots_at_the_end() -> None:
    with torch.inference_mode():  # as vLLM allocates its KV cache: the copy thread must cope
        kv = {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}
    worker = make(kv)
    assert worker.layer_loads is not None
    expected = saved(worker, kv, [1, 2])
    worker.take_report()
    items = (LoadItem(9, KEYS[0], 0, "ram"), LoadItem(10, KEYS[1], 1, "ram"))
    worker.start_load(StepPlan(loads=[LoadJob("r", items, False)]))
    for n in LAYERS:
        worker.wait_layer(n)
        assert torch.equal(kv[n][9], expected[1][n]) and torch.equal(kv[n][10], expected[2][n])
    worker.finish_loads()
    report = worker.take_report()
    assert report is not None and sorted(report.released_slots) == [0, 1]
    assert worker.collect() == (set(), set())
    worker.shutdown()


def test_tail_of_a_sync_load_is_copied_before_start_load_returns() -> None:
    """The step writes the tail block's later slots before a layer's wait_for_layer_load,
    so a tail is never left to the copy thread."""
    kv = {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}
    worker = make(kv)
    expected = saved(worker, kv, [1, 2])
    gate = threading.Event()
    assert worker.layer_loads is not None
    real = worker.layer_loads._copy_layer
    worker.layer_loads._copy_layer = lambda *a: (gate.wait(10), real(*a))
    items = (LoadItem(9, KEYS[0], 0, "ram"), LoadItem(10, KEYS[1], 1, "ram", partial=True))
    worker.start_load(StepPlan(loads=[LoadJob("r", items, False)]))
    for n in LAYERS:
        assert torch.equal(kv[n][10], expected[2][n])  # the tail: there already
    assert not torch.equal(kv["l0"][9], expected[1]["l0"])  # the full block: held at the gate
    gate.set()
    worker.finish_loads()
    assert torch.equal(kv["l2"][9], expected[1]["l2"])
    worker.shutdown()


def test_failed_layer_load_is_a_load_error_for_vllm_to_recompute() -> None:
    kv = {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}
    worker = make(kv)
    saved(worker, kv, [1, 2])
    assert worker.layer_loads is not None

    def broken(layer: int, src: list[int], dst: list[int]) -> None:
        raise RuntimeError("injected")

    worker.layer_loads._copy_layer = broken
    items = (LoadItem(9, KEYS[0], 0, "ram"), LoadItem(10, KEYS[1], 1, "ram"))
    worker.start_load(StepPlan(loads=[LoadJob("r", items, False)]))
    for n in LAYERS:
        worker.wait_layer(n)
    assert worker.collect() == (set(), {9, 10})
    report = worker.take_report()
    assert report is not None and sorted(report.released_slots) == [0, 1]
    worker.shutdown()


def test_all_at_once_when_layer_wise_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SessionKVWorker, "layer_wise", False)
    kv = {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}
    worker = make(kv)
    assert worker.layer_loads is None
    expected = saved(worker, kv, [1])
    worker.start_load(StepPlan(loads=[LoadJob("r", (LoadItem(9, KEYS[0], 0, "ram"),), False)]))
    for n in LAYERS:
        assert torch.equal(kv[n][9], expected[1][n])
    worker.wait_layer("l0")  # a no-op
    worker.shutdown()
