"""The worker side on plain torch tensors shaped like vLLM's CPU KV cache (no engine)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from server.kv.metadata import NO_SLOT, LoadItem, LoadJob, SaveItem, StepPlan  # noqa: E402
from server.kv.tiers.block_frame import PAGE  # noqa: E402
from server.kv.tiers.disk import DiskStore  # noqa: E402
from server.kv.tiers.manifest import Manifest  # noqa: E402
from server.kv.worker.worker import SessionKVWorker  # noqa: E402

NUM_BLOCKS, SHAPE = 16, (2, 8, 4)  # per layer: [blocks, K/V, tokens, heads*dim]
LAYERS = ["l0", "l1"]
LAYER_BYTES = 2 * 8 * 4 * 4
KEYS = [f"{i:02x}" * 32 for i in range(8)]


def caches() -> dict[str, torch.Tensor]:
    return {n: torch.randn(NUM_BLOCKS, *SHAPE) for n in LAYERS}


def make(
    tmp_path: Path, kv: dict[str, torch.Tensor], slots: int = 4, rank: int = 0
) -> SessionKVWorker:
    manifest = Manifest("m", "torch.float32", 8, tuple(LAYERS), (LAYER_BYTES,) * 2, "x")
    worker = SessionKVWorker(
        num_slots=slots,
        layers=LAYERS,
        layer_block_bytes=[LAYER_BYTES] * 2,
        store=DiskStore(tmp_path, manifest),
        rank=rank,
    )
    worker.register_kv_caches(kv, NUM_BLOCKS)
    return worker


def drain(worker: SessionKVWorker, want: int) -> tuple[set[str], set[int]]:
    finished: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + 10
    while len(finished) < want and time.monotonic() < deadline:
        f, e = worker.collect()
        finished |= f
        errors |= e
        time.sleep(0.01)
    return finished, errors


def test_save_then_sync_load_from_ram(tmp_path: Path) -> None:
    kv = caches()
    worker = make(tmp_path, kv)
    worker.save(StepPlan(saves=[SaveItem(3, KEYS[0], 1, to_disk=False)]))
    expected = {n: t[3].clone() for n, t in kv.items()}
    worker.start_load(StepPlan(loads=[LoadJob("r", (LoadItem(9, KEYS[0], 1, "ram"),), False)]))
    worker.finish_loads()  # the step's end (its save) waits for the layer-wise copies
    for n in LAYERS:
        assert torch.equal(kv[n][9], expected[n])
    report = worker.take_report()
    assert report is not None and report.saved == [KEYS[0]] and report.released_slots == [1]
    worker.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_stats_measure_saves_and_loads_on_rank_zero_only(tmp_path: Path, rank: int) -> None:
    worker = make(tmp_path, caches(), rank=rank)
    worker.save(StepPlan(saves=[SaveItem(b, KEYS[b], b, to_disk=False) for b in (2, 3)]))
    worker.start_load(StepPlan(loads=[LoadJob("r", (LoadItem(9, KEYS[2], 2, "ram"),), False)]))
    worker.finish_loads()
    stats = worker.take_stats()
    worker.shutdown()
    if rank:
        assert stats is None  # rank 0's measurements stand for every rank
        return
    assert stats is not None and stats.data["saved_blocks"] == 2
    assert len(stats.data["save_seconds"]) == 1 and len(stats.data["load_seconds"]) == 1
    assert worker.take_stats() is None  # taken: the next interval starts empty


def test_disk_roundtrip_async_and_corruption(tmp_path: Path) -> None:
    kv = caches()
    worker = make(tmp_path, kv)
    saves = [SaveItem(b, KEYS[b], b, to_disk=True) for b in (0, 1)]
    worker.save(StepPlan(saves=saves))
    expected = {b: {n: kv[n][b].clone() for n in LAYERS} for b in (0, 1)}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(worker._report.written) < 2:
        worker.collect()
        time.sleep(0.01)
    assert sorted(worker.take_report().written) == sorted(KEYS[:2])
    path = worker.store.path(KEYS[1])
    raw = bytearray(path.read_bytes())
    raw[PAGE + worker.store.manifest.block_bytes - 1] ^= 0xFF  # the payload's last byte
    path.write_bytes(bytes(raw))
    items = (LoadItem(10, KEYS[0], 2, "disk"), LoadItem(11, KEYS[1], NO_SLOT, "disk"))
    worker.start_load(StepPlan(loads=[LoadJob("r", items, True)]))
    finished, errors = drain(worker, 1)
    assert finished == {"r"} and errors == {11}  # block 11 is recomputed by vLLM
    for n in LAYERS:
        assert torch.equal(kv[n][10], expected[0][n])
        promoted = worker.pool.data[LAYERS.index(n)][2].view(torch.float32).view(SHAPE)
        assert torch.equal(promoted, expected[0][n])  # promoted to RAM slot 2
    report = worker.take_report()
    assert report.read_ok == [KEYS[0]] and report.read_failed == [KEYS[1]]
    assert report.released_slots == [2]
    worker.shutdown()


def test_layout_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    kv = {n: torch.randn(NUM_BLOCKS, 2, 8, 8) for n in LAYERS}  # twice the expected bytes
    with pytest.raises(RuntimeError, match="bytes per block"):
        make(tmp_path, kv)
