"""Disk tier files: atomic writes, checked reads, manifests that separate layouts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from server.kv.keys import tail_key
from server.kv.tiers.disk import BlockFileError, DiskStore, Manifest, remove_block_files

MANIFEST = Manifest(
    model_id="m",
    dtype="torch.float32",
    block_size=4,
    layers=("l0", "l1"),
    layer_block_bytes=(32, 32),
    hash_scheme="sha256:abc",
)
KEY = "ab" * 32


def payload(seed: int) -> memoryview:
    return memoryview(bytes((seed + i) % 256 for i in range(64)))


def test_roundtrip_and_layout(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    store.write(KEY, payload(1))
    path = store.path(KEY)
    assert path == tmp_path / MANIFEST.fingerprint() / "ab" / "ab" / f"{KEY}.kvb"
    out = bytearray(64)
    store.read_into(KEY, memoryview(out))
    assert bytes(out) == bytes(payload(1))
    assert store.scan() == {KEY: path.stat().st_size}
    assert path.stat().st_size == store.file_bytes


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1],  # truncated payload
        lambda b: b[:10],  # truncated header
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # one flipped bit
        lambda b: b"X" + b[1:],  # not a block file
    ],
)
def test_damaged_file_is_an_error(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    store = DiskStore(tmp_path, MANIFEST)
    store.write(KEY, payload(2))
    path = store.path(KEY)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BlockFileError):
        store.read_into(KEY, memoryview(bytearray(64)))


def test_missing_and_foreign_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    with pytest.raises(BlockFileError, match="missing"):
        store.read_into(KEY, memoryview(bytearray(64)))
    other = "cd" * 32
    store.write(other, payload(3))
    store.path(KEY).parent.mkdir(parents=True, exist_ok=True)
    store.path(KEY).write_bytes(store.path(other).read_bytes())  # right size, wrong block
    with pytest.raises(BlockFileError, match="another block"):
        store.read_into(KEY, memoryview(bytearray(64)))


def test_changed_model_uses_a_fresh_folder(tmp_path: Path) -> None:
    old = DiskStore(tmp_path, MANIFEST)
    old.write(KEY, payload(4))
    new = DiskStore(tmp_path, replace(MANIFEST, model_id="other"))
    assert new.root != old.root and new.scan() == {}
    again = DiskStore(tmp_path, MANIFEST)  # a restart with the same model sees the file
    assert set(again.scan()) == {KEY}


def test_scan_removes_temp_files_and_remove_everywhere(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    store.write(KEY, payload(5))
    tmp = store.path(KEY).parent / ".tmp-123-x"
    tmp.write_bytes(b"partial")
    assert set(store.scan()) == {KEY} and not tmp.exists()
    other = DiskStore(tmp_path, replace(MANIFEST, dtype="torch.bfloat16"))
    other.write(KEY, payload(6))
    assert remove_block_files(tmp_path, [KEY, "ef" * 32]) == 2
    assert store.scan() == {} and other.scan() == {}


def test_wrong_payload_size_is_refused(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    with pytest.raises(ValueError, match="expected 64"):
        store.write(KEY, memoryview(bytes(10)))
    assert store.scan() == {}


def test_a_tail_file_is_a_block_file_of_the_same_size(tmp_path: Path) -> None:
    """A tail's key is longer than a full block's; its file is the same size (the header names
    it by a 64-character id), so a restart keeps it and budgets count it as one block."""
    tail = tail_key(KEY, [5, 6, 7])
    store = DiskStore(tmp_path, MANIFEST)
    store.write(KEY, payload(7))
    store.write(tail, payload(8))
    assert store.path(tail).stat().st_size == store.path(KEY).stat().st_size == store.file_bytes
    again = DiskStore(tmp_path, MANIFEST)  # a restart: the start-up scan checks sizes
    assert set(again.scan()) == {KEY, tail}
    out = bytearray(64)
    again.read_into(tail, memoryview(out))
    assert bytes(out) == bytes(payload(8))
    other = tail_key(KEY, [5, 6, 8])
    again.path(other).write_bytes(again.path(tail).read_bytes())  # right size, wrong tail
    with pytest.raises(BlockFileError, match="another block"):
        again.read_into(other, memoryview(bytearray(64)))


TP2 = replace(MANIFEST, tp_size=2)


def test_one_rank_layout_keeps_its_fingerprint_and_tp_size_changes_it() -> None:
    assert replace(MANIFEST, tp_size=1).fingerprint() == MANIFEST.fingerprint()
    assert TP2.fingerprint() != MANIFEST.fingerprint()
    assert TP2.total_block_bytes == 2 * MANIFEST.block_bytes


def test_each_rank_writes_its_own_file_and_a_block_needs_every_rank(tmp_path: Path) -> None:
    ranks = [DiskStore(tmp_path, TP2, rank=r) for r in (0, 1)]
    for r, store in enumerate(ranks):
        store.write(KEY, payload(r))
        assert store.path(KEY).name == f"{KEY}.r{r}.kvb"
    other = "cd" * 32
    ranks[0].write(other, payload(5))  # rank 1 never wrote it (a crash between ranks)
    scheduler = DiskStore(tmp_path, TP2)
    assert scheduler.file_bytes == 2 * ranks[0].file_bytes
    assert scheduler.scan() == {KEY: scheduler.file_bytes}
    assert not ranks[0].path(other).exists()  # the lone rank's file is deleted
    out = bytearray(64)
    ranks[1].read_into(KEY, memoryview(out))
    assert bytes(out) == bytes(payload(1))
    ranks[0].path(KEY).replace(ranks[1].path(KEY))  # rank 0's bytes under rank 1's name
    with pytest.raises(BlockFileError, match="another block"):
        ranks[1].read_into(KEY, memoryview(out))
    assert DiskStore(tmp_path, MANIFEST).scan() == {}  # one rank: another layout, no files
    assert scheduler.remove(KEY) and not list(scheduler.root.glob("*/*/*.kvb"))


def test_api_side_removal_covers_every_rank(tmp_path: Path) -> None:
    for r in (0, 1):
        DiskStore(tmp_path, TP2, rank=r).write(KEY, payload(r))
    assert remove_block_files(tmp_path, [KEY]) == 2
