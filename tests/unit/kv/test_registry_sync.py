"""The scheduler side's background threads: the registry thread and the Redis lookups.

Both registry backends (``backend``: a real SQLite file; sessions in the real Redis), where
another connection plays the API process (or another replica), and a real socket that never
answers (a hung Redis).
"""

from __future__ import annotations

import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from registries import Backend, proxy

from server.kv.scheduler.registry_sync import Done, Dropped, RegistrySync, SessionChange, Snapshot


def engine_sync(backend: Backend, url: str | None = None) -> RegistrySync:
    """The engine's registry thread on ``backend`` (through ``url`` when given)."""
    return RegistrySync(
        backend.path,
        busy_timeout_s=0.2,
        poll_s=0.01,
        opener=lambda: backend.open(busy_timeout_s=0.2, url=url),
    )


@pytest.fixture
def sync(backend: Backend) -> Iterator[RegistrySync]:
    rs = engine_sync(backend)
    yield rs
    rs.close()


def settled(rs: RegistrySync) -> list[object]:
    token = rs.barrier()
    assert rs.wait(token, 10)
    return rs.drain()


def test_api_changes_arrive_as_increments(sync: RegistrySync, backend: Backend) -> None:
    sync.write("turn", lambda reg: reg.record_turn("t", "a", ["k1", "k2"], 8, default_ttl_s=None))
    first = settled(sync)
    assert isinstance(first[0], Snapshot) and first[0].sessions == []  # once, at start
    (change,) = [e for e in first if isinstance(e, SessionChange)]
    assert change.row is not None and change.row.turns == 1 and change.keys == ["k1", "k2"]

    api = backend.open()  # the API process's connection (with Redis: maybe another replica's)
    api.update_session("t", "a", set_ttl=False, ttl_seconds=None, pinned=True)
    assert api.copy_session("t", "a", "b", overwrite=False) == "ok"
    events = settled(sync)
    assert not any(isinstance(e, Snapshot) for e in events)  # increments, no reload
    changes = {e.session_id: e for e in events if isinstance(e, SessionChange)}
    assert changes["a"].row is not None and changes["a"].row.pinned
    assert changes["b"].keys == ["k1", "k2"]

    api.delete_session("t", "b")
    api.delete_session("t", "a")
    events = settled(sync)
    dropped = [k for e in events if isinstance(e, Dropped) for k in e.keys]
    assert sorted(dropped) == ["k1", "k2"]
    gone = {e.session_id for e in events if isinstance(e, SessionChange) and e.row is None}
    assert gone == {"a", "b"}
    assert isinstance(events[-1], Done)
    api.close()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_writes_wait_out_a_locked_registry_and_are_kept(sync: RegistrySync, tmp_path: Path) -> None:
    settled(sync)  # open
    lock = sqlite3.connect(tmp_path / "sessions.sqlite3", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    sync.write("turn", lambda reg: reg.record_turn("t", "a", ["k"], 4, default_ttl_s=None))
    sync.publish({"k": (True, False, False, 100)}, {"c": 1.0}, {"g": 1.0})
    sync.publish({}, {"c": 2.0}, {"g": 5.0})  # merges with the queued one
    token = sync.barrier()  # each call above returned at once, the lock held
    assert not sync.wait(token, 0.5)  # the writes are held up behind the lock...
    lock.execute("ROLLBACK")
    lock.close()
    assert sync.wait(token, 10)  # ...and land once it goes, in order
    reg = sync.registry
    assert reg.get_session("t", "a") is not None
    assert reg.stats() == {"c": 3.0, "g": 5.0}
    assert reg.tier_usage("t", "a")["ram"].blocks == 1


def test_redis_lookups_answer_not_yet_then_a_miss_when_redis_hangs(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    from server.kv.scheduler.redis_lookups import RedisLookups
    from server.kv.tiers.manifest import Manifest
    from server.kv.tiers.redis import RedisStore

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # the kernel accepts connections; nothing ever answers
    manifest = Manifest("m", "torch.float32", 4, ("l0",), (100,), "sha256:x")
    url = f"redis://127.0.0.1:{hung.getsockname()[1]}/0"
    lookups = RedisLookups(RedisStore(url, manifest, ttl_s=30, timeout_s=0.3))
    try:
        assert lookups.exists("r1", ["a", "b"]) is None  # asked, not waited for
        assert lookups.exists("r1", ["a", "b"]) is None  # asked once, still pending
        deadline = time.monotonic() + 10
        while (answer := lookups.exists("r1", ["a", "b"])) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert answer == [False, False]  # a hung Redis is a miss
        lookups.forget("r1")
    finally:
        lookups.close()
        hung.close()


@pytest.mark.redis
@pytest.mark.parametrize("backend", ["redis"], indirect=True)
def test_writes_wait_out_a_redis_outage_and_are_kept(backend: Backend) -> None:
    redis = proxy()  # the engine reaches Redis through it
    rs = engine_sync(backend, url=redis.url)
    try:
        settled(rs)  # open
        redis.down()  # Redis gone, as the engine sees it
        rs.write("turn", lambda reg: reg.record_turn("t", "a", ["k"], 4, default_ttl_s=None))
        rs.publish({"k": (True, False, False, 100)}, {"c": 1.0}, {})
        token = rs.barrier()  # each call returned at once
        assert not rs.wait(token, 1.0)  # the turn is held up while Redis is away...
        redis.up()
        assert rs.wait(token, 20)  # ...and lands once it is back, in order
        api = backend.open()
        row = api.get_session("t", "a")
        assert row is not None and row.num_blocks == 1
        assert api.stats() == {"c": 1.0} and api.tier_usage("t", "a")["ram"].blocks == 1
        api.close()
    finally:
        rs.close()
        redis.close()
