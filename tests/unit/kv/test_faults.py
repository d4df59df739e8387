"""Recovery from damaged files, full disks, budgets, failed loads and swapped weights."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy
from server.kv.scheduler.recovery import DiskSpace, check_budgets, forget_unregistered_files
from server.kv.scheduler.usage import LoadAccounting
from server.kv.tiers.disk import MANIFEST_FILE, DiskStore, block_file_bytes
from server.kv.tiers.manifest import Manifest
from server.kv.weights import weights_fingerprint

MANIFEST = Manifest("m", "torch.float32", 4, ("l0", "l1"), (32, 32), "sha256:abc")
KEYS = [f"{i:02x}" * 32 for i in range(1, 5)]


def filled(tmp_path: Path) -> DiskStore:
    store = DiskStore(tmp_path, MANIFEST)
    for i, key in enumerate(KEYS):
        store.write(key, memoryview(bytes([i]) * 64))
    return store


def test_truncated_file_is_deleted_with_one_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = filled(tmp_path)
    bad = store.path(KEYS[1])
    bad.write_bytes(bad.read_bytes()[:50])
    with caplog.at_level(logging.WARNING):
        found = DiskStore(tmp_path, MANIFEST).scan()
    assert set(found) == set(KEYS) - {KEYS[1]}
    assert not bad.exists() and not bad.parent.exists()  # its empty fan-out folders went too
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(bad) in lines[0] and "deleted" in lines[0]


@pytest.mark.parametrize("text", ["{not json", json.dumps({"model_id": "other"}), "[]"])
def test_garbage_manifest_distrusts_the_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    store = filled(tmp_path)
    (store.root / MANIFEST_FILE).write_text(text)
    with caplog.at_level(logging.WARNING):
        assert DiskStore(tmp_path, MANIFEST).scan() == {}
    assert not any(store.path(k).exists() for k in KEYS)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(store.root / MANIFEST_FILE) in lines[0]
    assert "4 block files" in lines[0]
    rewritten = Manifest(**json.loads((store.root / MANIFEST_FILE).read_text()))
    assert rewritten.fingerprint() == MANIFEST.fingerprint()
    caplog.clear()
    assert DiskStore(tmp_path, MANIFEST).scan() == {}  # rewritten: a clean start now
    assert not caplog.records


def test_remove_takes_empty_fanout_folders_and_write_recreates_them(tmp_path: Path) -> None:
    store = filled(tmp_path)
    path = store.path(KEYS[0])
    assert store.remove(KEYS[0])
    assert not path.parent.exists() and not path.parent.parent.exists()
    store.write(KEYS[0], memoryview(bytes(64)))
    assert path.exists()


def test_missing_registry_deletes_the_files_no_session_reaches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = filled(tmp_path)
    registry = tmp_path / "sessions.sqlite3"
    with caplog.at_level(logging.WARNING):
        assert forget_unregistered_files(store, store.scan(), registry) == {}
    assert not any(store.path(k).exists() for k in KEYS)
    assert len(caplog.records) == 1 and str(registry) in caplog.records[0].getMessage()
    store = filled(tmp_path)
    registry.write_bytes(b"")
    assert set(forget_unregistered_files(store, store.scan(), registry)) == set(KEYS)


def test_budgets_below_one_block_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    file_bytes = block_file_bytes(MANIFEST)
    with caplog.at_level(logging.WARNING):
        assert check_budgets(1 << 20, file_bytes, 64, file_bytes)
        assert not caplog.records
        assert not check_budgets(1 << 20, file_bytes - 1, 64, file_bytes)
        assert not check_budgets(63, 1 << 20, 64, file_bytes)
        assert not check_budgets(1 << 20, 0, 64, file_bytes)  # off on purpose: no warning
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "--kv-disk-bytes" in messages[0] and str(file_bytes) in messages[0]
    assert "--kv-ram-bytes" in messages[1]


def index_with_files(n: int, file_bytes: int, budget: int) -> BlockIndex:
    index = BlockIndex(
        num_slots=4, file_bytes=file_bytes, disk_bytes=budget, policy=EvictionPolicy(60, 30)
    )
    for i in range(n):
        assert index.add_disk_file(f"{i:064x}")
    return index


def test_full_disk_shrinks_the_budget_once_then_evicts_instead_of_failing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    free = {"bytes": 10 << 20}
    now = {"t": 0.0}
    index = index_with_files(3, 100, 10_000)
    space = DiskSpace(
        tmp_path, 10_000, 100, retry_s=30, free=lambda _: free["bytes"], clock=lambda: now["t"]
    )
    space.fit_at_start(index)
    assert index.disk_bytes == 10_000 and not caplog.records
    free["bytes"] = 150  # someone else filled the file system
    with caplog.at_level(logging.WARNING):
        space.on_write_failed(index)
        space.on_write_failed(index)
    assert index.disk_bytes == 300  # the three files it holds; 150 free keeps one spare
    assert len(caplog.records) == 1 and str(tmp_path) in caplog.records[0].getMessage()
    assert index.reserve_disk(protect=set())  # room made by evicting the oldest file
    assert index.disk_used == 300 and index.removes
    free["bytes"] = 5_000
    space.maybe_regrow(index)
    assert index.disk_bytes == 300  # not before retry_s
    now["t"] = 31.0
    space.maybe_regrow(index)
    assert index.disk_bytes == 2 * 100 + 5_000 - 100  # two files written, one spare kept


def test_budget_is_capped_at_start_by_the_file_system(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = index_with_files(0, 100, 1 << 30)
    space = DiskSpace(tmp_path, 1 << 30, 100, free=lambda _: 1050)
    with caplog.at_level(logging.WARNING):
        space.fit_at_start(index)
    assert index.disk_bytes == 900
    assert len(caplog.records) == 1


def request(req_id: str, local: int, external: int, prompt: int) -> SimpleNamespace:
    from vllm.v1.metrics.stats import PrefillStats

    stats = PrefillStats()
    stats.set(
        num_prompt_tokens=prompt, num_local_cached_tokens=local, num_external_cached_tokens=external
    )
    return SimpleNamespace(request_id=req_id, prefill_stats=stats)


def test_failed_load_lowers_cached_tokens_to_the_prefix_kept() -> None:
    acct = LoadAccounting(block_size=128)
    a = request("a", local=128, external=6 * 128, prompt=1000)
    b = request("b", local=0, external=2 * 128, prompt=300)
    acct.on_alloc(a, [10, 11, 12, 13, 14, 15, 16, 17], 6 * 128)  # block 10 is local
    acct.on_alloc(b, [20, 21, 22], 2 * 128)
    acct.on_output({13, 15}, finished=set())  # the 3rd loaded block of a failed first
    assert a.prefill_stats.num_cached_tokens == 128 + 2 * 128
    assert a.prefill_stats.num_computed_tokens == 1000 - 3 * 128
    assert b.prefill_stats.num_cached_tokens == 2 * 128
    acct.on_output(set(), finished={"a", "b"})
    acct.on_output({11, 20}, finished=set())  # finished loads are no longer adjusted
    assert a.prefill_stats.num_cached_tokens == 3 * 128
    assert b.prefill_stats.num_cached_tokens == 2 * 128


def test_weights_fingerprint_sees_new_weights_with_the_same_header(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    tensors = {"a": torch.zeros(64, 64), "b": torch.ones(8)}
    save_file(tensors, tmp_path / "model.safetensors")
    first = weights_fingerprint(str(tmp_path))
    assert weights_fingerprint(str(tmp_path)) == first
    save_file({**tensors, "a": torch.full((64, 64), 0.5)}, tmp_path / "model.safetensors")
    second = weights_fingerprint(str(tmp_path))
    assert second != first
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "rope_theta": 1}')
    assert weights_fingerprint(str(tmp_path)) != second
    assert weights_fingerprint("org/not-downloaded") == weights_fingerprint("org/not-downloaded")
    assert replace(MANIFEST, weights=first).fingerprint() != MANIFEST.fingerprint()
