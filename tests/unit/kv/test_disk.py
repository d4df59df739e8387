"""Disk tier files: atomic writes, checked reads, manifests that separate layouts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from server.kv.keys import tail_key
from server.kv.tiers.block_frame import PAGE, BlockFileError
from server.kv.tiers.disk import DiskStore, remove_block_files
from server.kv.tiers.manifest import Manifest

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
        lambda b: b[: PAGE + 63] + bytes([b[PAGE + 63] ^ 1]) + b[PAGE + 64 :],  # a flipped bit
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


PAGED = replace(MANIFEST, layer_block_bytes=(PAGE, PAGE + 100))
"""A layout whose blocks are two whole pages and 100 bytes: the O_DIRECT write stages the tail."""


def aligned(data: bytes) -> memoryview:
    """``data`` in a page-aligned buffer (anonymous mappings start on a page)."""
    import mmap

    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return memoryview(buf)


def test_page_aligned_payload_goes_direct_and_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.kv.tiers import block_frame, disk

    direct: list[Path] = []
    real = block_frame.write_direct
    monkeypatch.setattr(disk, "write_direct", lambda p, h, d: (direct.append(p), real(p, h, d)))
    store = DiskStore(tmp_path, PAGED)
    data = bytes(i * 7 % 251 for i in range(PAGED.block_bytes))
    other = "cd" * 32
    store.write(KEY, aligned(data))  # O_DIRECT
    store.write(other, memoryview(data))  # not aligned: through the page cache
    assert len(direct) == 1 and store._direct
    a, b = store.path(KEY).read_bytes(), store.path(other).read_bytes()
    assert len(a) == len(b) == store.file_bytes == 4 * PAGE  # header page, 2 pages, tail page
    assert a[PAGE:] == b[PAGE:] and a[PAGE:][PAGED.block_bytes :] == bytes(PAGE - 100)
    for key in (KEY, other):
        out = bytearray(PAGED.block_bytes)
        store.read_into(key, memoryview(out))
        assert bytes(out) == data
    assert store.scan() == {KEY: store.file_bytes, other: store.file_bytes}


def test_a_file_system_without_o_direct_gets_page_cache_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno
    import os

    from server.kv.tiers import block_frame

    real_open = os.open

    def refuse_direct(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:  # what ext4 with data=journal or some FUSE file systems say
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(block_frame.os, "open", refuse_direct)
    store = DiskStore(tmp_path, PAGED)
    data = bytes(i % 13 for i in range(PAGED.block_bytes))
    with caplog.at_level("INFO"):
        store.write(KEY, aligned(data))
    assert not store._direct and "no O_DIRECT" in caplog.text
    out = bytearray(PAGED.block_bytes)
    store.read_into(KEY, memoryview(out))
    assert bytes(out) == data
    assert [p.name for p in store.path(KEY).parent.iterdir()] == [f"{KEY}.kvb"]  # no temp left


def test_scan_deletes_this_layouts_folder_of_the_earlier_file_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = tmp_path / MANIFEST.fingerprint(files=1)  # what an older version wrote
    (old / "ab" / "ab").mkdir(parents=True)
    (old / "ab" / "ab" / f"{KEY}.kvb").write_bytes(b"x" * 150)
    (old / "manifest.json").write_text("{}")
    other = tmp_path / replace(MANIFEST, model_id="other").fingerprint(files=1)
    other.mkdir()  # another model's folder: left alone
    store = DiskStore(tmp_path, MANIFEST)
    assert store.root != old
    with caplog.at_level("WARNING"):
        assert store.scan() == {}
    assert not old.exists() and other.is_dir()
    assert "2 files in block file layout 1" in caplog.text


def test_a_files_header_page_keeps_the_blocks_tokens_and_its_parent(tmp_path: Path) -> None:
    """Token ids written with a block come back from its header page alone; the payload and
    its checks are unchanged; a file written without them, or a damaged section, gives None."""
    store = DiskStore(tmp_path, MANIFEST)
    tokens = bytes(range(16))  # 4 packed ids
    store.write(KEY, payload(3), ("root-salt", tokens))
    assert store.read_tokens(KEY) == ("root-salt", tokens)
    out = bytearray(64)
    store.read_into(KEY, memoryview(out))
    assert bytes(out) == bytes(payload(3))
    assert store.path(KEY).stat().st_size == store.file_bytes
    other = "cd" * 32
    store.write(other, payload(4))
    assert store.read_tokens(other) is None
    assert store.read_tokens("ef" * 32) is None  # no file
    raw = bytearray(store.path(KEY).read_bytes())
    raw[280] ^= 1  # inside the token section (from byte 256 on)
    store.path(KEY).write_bytes(bytes(raw))
    assert store.read_tokens(KEY) is None
    store.read_into(KEY, memoryview(out))  # the block itself still reads


def test_tokens_that_do_not_fit_the_header_page_are_left_out(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    store.write(KEY, payload(5), ("p", bytes(4 * 1000)))  # 4,000 bytes: more than the page
    assert store.read_tokens(KEY) is None
