"""SessionControl and the registry: lifecycle, tenants, TTL, copy, delete (files gone).

Each test runs on both registry backends (``backend``: the SQLite file, then sessions in the
real Redis with the local part in the file)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from registries import Backend

from langgraph_kvcache.contract import check_session_id
from server.kv.registry.control import (
    InvalidSessionId,
    SessionControl,
    SessionExists,
    SessionNotFound,
)
from server.kv.tiers.disk import DiskStore
from server.kv.tiers.manifest import Manifest

MANIFEST = Manifest(
    model_id="m",
    dtype="torch.float32",
    block_size=4,
    layers=("l0",),
    layer_block_bytes=(16,),
    hash_scheme="sha256:00",
)


@pytest.fixture
def control(backend: Backend) -> SessionControl:
    c = backend.control()
    yield c
    c.close()


def _keys(*names: str) -> list[str]:
    return [f"{n:0>16}" for n in names]


def test_session_id_syntax() -> None:
    assert check_session_id("thread-1:ns|a@b") == "thread-1:ns|a@b"
    for bad in ["", "-x", "a/b", "../etc", "x" * 256, "a b"]:
        with pytest.raises(InvalidSessionId):
            check_session_id(bad)


def test_create_get_update_list(control: SessionControl) -> None:
    info = control.create("s1", "t1", ttl_seconds=60, pinned=True)
    assert (info.id, info.tenant, info.pinned, info.ttl_seconds) == ("s1", "t1", True, 60)
    assert info.expires_at == pytest.approx(info.last_used_at + 60)
    with pytest.raises(SessionExists):
        control.create("s1", "t1")
    with pytest.raises(SessionNotFound):
        control.get("s1", "other-tenant")
    info = control.update("s1", "t1", ttl_seconds=None, pinned=False)
    assert (info.pinned, info.ttl_seconds, info.expires_at) == (False, None, None)
    control.create("s2", "t1")
    assert [s.id for s in control.list("t1")] == ["s2", "s1"]
    assert control.list("t2") == []
    body = control.get("s1", "t1").to_dict()
    assert body["object"] == "session" and set(body["tiers"]) == {"ram", "disk", "redis"}


def test_turns_gaps_and_block_tiers(control: SessionControl, backend: Backend) -> None:
    reg = backend.open()  # the engine's connection
    reg.record_turn("t", "s", _keys("a", "b"), 300, default_ttl_s=None, now=100.0)
    reg.record_turn("t", "s", _keys("a", "b", "c"), 400, default_ttl_s=None, now=110.0)
    reg.record_turn("t", "s", _keys("a", "b", "c"), 420, default_ttl_s=None, now=130.0)
    row = reg.get_session("t", "s")
    assert row is not None and (row.turns, row.num_tokens, row.num_blocks) == (3, 420, 3)
    assert (row.gap_count, row.gap_mean) == (2, pytest.approx(15.0))
    reg.set_block_tiers(
        {_keys("a")[0]: (True, True, False, 10), _keys("b")[0]: (False, True, True, 10)}
    )
    info = control.get("s", "t")
    assert (info.tiers["ram"].blocks, info.tiers["disk"].blocks, info.tiers["disk"].bytes) == (
        1,
        2,
        20,
    )
    reg.close()


def test_copy_and_delete_keep_shared_blocks(control: SessionControl, tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "blocks", MANIFEST)
    keys = _keys("a", "b", "c")
    for k in keys:
        store.write(k, memoryview(bytes(16)))
    reg = control.registry
    reg.record_turn("t", "src", keys[:2], 8, default_ttl_s=None)
    forked = control.copy("src", "dst", "t")
    assert forked.num_blocks == 2
    with pytest.raises(SessionExists):
        control.copy("src", "dst", "t")
    with pytest.raises(SessionNotFound):
        control.copy("nope", "x", "t")
    reg.record_turn("t", "dst", keys, 12, default_ttl_s=None)
    assert control.delete("src", "t") == 0  # both blocks still used by dst
    assert all(store.path(k).exists() for k in keys)
    assert control.delete("dst", "t") == 3
    # Recorded for the engine, which owns the files (removes them when it applies the drops).
    assert all(store.path(k).exists() for k in keys)
    seq, dropped = reg.drops_after(0)
    assert sorted(dropped) == sorted(keys) and seq == reg.last_drop_seq()
    with pytest.raises(SessionNotFound):
        control.delete("dst", "t")


def test_ttl_expiry_drops_session(control: SessionControl) -> None:
    control.registry.record_turn("t", "old", _keys("a"), 4, default_ttl_s=0.05)
    time.sleep(0.1)
    with pytest.raises(SessionNotFound):
        control.get("old", "t")
    assert control.list("t") == []
    assert control.registry.drops_after(0)[1] == []  # the API process purges nothing
    assert control.registry.purge_expired() == _keys("a")  # the engine's purge
    assert control.registry.drops_after(0)[1] == _keys("a")


def test_prefetch_without_engine_and_metrics(control: SessionControl) -> None:
    control.registry.record_turn("t", "s", _keys("a", "b"), 8, default_ttl_s=None)
    assert asyncio.run(control.prefetch("s", "t")) == {"blocks": 2, "ram_blocks": 0}
    control.registry.add_stats({"lgkv_miss_blocks_total": 2}, {'lgkv_tier_bytes{tier="ram"}': 5})
    control.registry.add_stats({"lgkv_miss_blocks_total": 3}, {'lgkv_tier_bytes{tier="ram"}': 7})
    m = control.metrics()
    assert m["lgkv_miss_blocks_total"] == 5 and m['lgkv_tier_bytes{tier="ram"}'] == 7
    assert m["lgkv_sessions"] == 1 and m['lgkv_hit_blocks_total{tier="disk"}'] == 0


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), -1.0, 0.0, 1e-05, 1e999, 4e7])
def test_bad_ttls_are_refused_before_anything_is_written(
    control: SessionControl, ttl: float
) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        control.create("s", "t", ttl_seconds=ttl)
    assert control.list("t") == []
    control.create("s", "t", ttl_seconds=60)
    with pytest.raises(ValueError, match="ttl_seconds"):
        control.update("s", "t", ttl_seconds=ttl)
    assert control.get("s", "t").ttl_seconds == 60


def test_a_bad_stored_row_is_skipped_with_a_warning(
    control: SessionControl, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    control.create("good", "t", ttl_seconds=60)
    control.create("bad", "t", ttl_seconds=60)
    if backend.redis_url is None:
        with sqlite3.connect(backend.path) as db:  # as an older version wrote it
            db.execute("UPDATE sessions SET ttl_seconds = 9e999 WHERE id = 'bad'")
    else:
        import redis

        sessions = control.registry.sessions  # type: ignore[attr-defined]
        redis.Redis.from_url(backend.redis_url).hset(sessions.prefix + "s:t\x1fbad", "ttl", "9e999")
    with caplog.at_level("WARNING"):
        assert [s.id for s in control.list("t")] == ["good"]
    assert "skipping session 'bad'" in caplog.text
    with pytest.raises(SessionNotFound):
        control.get("bad", "t")
    assert control.delete("bad", "t") == 0  # and it can still be deleted
