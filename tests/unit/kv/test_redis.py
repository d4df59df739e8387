"""The Redis tier against the real Redis on 127.0.0.1:6379: checked blocks, TTL, outages,
and a second scheduler (another replica) finding blocks the first one stored."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.kv.keys import block_key
from server.kv.metadata import WorkerReport
from server.kv.tiers.block_frame import BlockFileError
from server.kv.tiers.manifest import Manifest
from server.kv.tiers.redis import RedisStore, RedisUnavailable

pytestmark = pytest.mark.redis
URL = "redis://127.0.0.1:6379/0"
KEY = "ab" * 32


@pytest.fixture
def manifest() -> Iterator[Manifest]:
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    m = Manifest(f"test-{uuid.uuid4().hex}", "torch.float32", 4, ("l0",), (100,), "sha256:x")
    yield m
    for pattern in (f"lgkv:{m.fingerprint()}:*", f"lgkv:reg:{{{m.model_id}}}:*"):
        for k in client.scan_iter(pattern):
            client.delete(k)


def test_many_blocks_in_one_round_trip(manifest: Manifest) -> None:
    import redis

    store = RedisStore(URL, manifest, ttl_s=30)
    keys = [f"{i:02x}" * 32 for i in range(4)]
    for i, key in enumerate(keys[:3]):
        store.write(key, memoryview(bytes([i]) * 100))
    client = redis.Redis.from_url(URL)
    raw = bytearray(client.get(store.prefix + keys[1]))
    raw[-1] ^= 1
    client.set(store.prefix + keys[1], bytes(raw))
    outs = [bytearray(100) for _ in keys]
    errors = store.read_many_into(keys, [memoryview(o) for o in outs])
    assert errors[0] is None and bytes(outs[0]) == bytes([0]) * 100
    assert errors[1] is not None and "checksum" in errors[1]  # damaged: that block only
    assert errors[2] is None and bytes(outs[2]) == bytes([2]) * 100
    assert errors[3] is not None and "missing" in errors[3]
    assert store.read_many_into([], []) == []
    down = RedisStore("redis://127.0.0.1:1/0", manifest, ttl_s=30, timeout_s=0.2)
    assert all(e for e in down.read_many_into(keys[:2], [memoryview(o) for o in outs[:2]]))


def test_roundtrip_ttl_and_damage(manifest: Manifest) -> None:
    import redis

    store = RedisStore(URL, manifest, ttl_s=30)
    data = bytes(range(100))
    store.write(KEY, memoryview(data))
    out = bytearray(100)
    store.read_into(KEY, memoryview(out))
    assert bytes(out) == data
    assert store.exists_many([KEY, "cd" * 32]) == [True, False]
    client = redis.Redis.from_url(URL)
    ttl = client.pttl(store.prefix + KEY)
    assert 0 < ttl <= 30_000
    raw = bytearray(client.get(store.prefix + KEY))
    raw[-1] ^= 1
    client.set(store.prefix + KEY, bytes(raw))
    with pytest.raises(BlockFileError, match="checksum"):
        store.read_into(KEY, memoryview(out))
    assert store.remove_many([KEY]) == 1
    with pytest.raises(BlockFileError, match="missing"):
        store.read_into(KEY, memoryview(out))


def test_redis_down_is_a_miss(manifest: Manifest) -> None:
    store = RedisStore("redis://127.0.0.1:1/0", manifest, ttl_s=30, timeout_s=0.2)
    with pytest.raises(RedisUnavailable):
        store.write(KEY, memoryview(bytes(100)))
    assert store.exists_many([KEY]) == [False]  # and no wait: the store stays quiet a while
    with pytest.raises(OSError):
        store.read_into(KEY, memoryview(bytearray(100)))


def test_second_replica_hits_from_redis(manifest: Manifest, tmp_path: Path) -> None:
    from test_scheduler import BB, BS, FB, Req, prompt  # same folder

    from server.kv.scheduler.scheduler import SessionKVScheduler
    from server.kv.settings import ConnectorSettings

    def replica(name: str) -> SessionKVScheduler:
        settings = ConnectorSettings.from_extra_config(
            {
                "cache_dir": str(tmp_path / name),
                "ram_bytes": 4 * BB,
                "disk_bytes": 4 * FB,
                "redis_url": URL,
                "redis_namespace": manifest.model_id,  # this test's sessions, deleted after
                "stats_flush_s": 0.001,
            }
        )
        return SessionKVScheduler(
            settings,
            block_size=BS,
            block_bytes=BB,
            file_bytes=FB,
            disk_files={},
            redis=RedisStore(URL, manifest, ttl_s=30),
        )

    first = replica("a")
    p = prompt(1, 3)
    req = Req("r1", p, "s")
    first.get_num_new_matched_tokens(req, 0)
    first.update_state_after_alloc(req, [], 0)
    plan = first.build_plan([("r1", [1, 2, 3, 4], True, 0)], {"r1": len(p)})
    assert all(s.to_redis for s in plan.saves)
    for s in plan.saves:  # what the first replica's worker does with each saved block
        first.redis.write(s.key, memoryview(bytes(BB)))
    first.on_report(
        WorkerReport(saved=[s.key for s in plan.saves], redis_written=[s.key for s in plan.saves])
    )
    first.catch_up()
    assert first.registry.stats()['lgkv_tier_blocks{tier="redis"}'] == 3

    second = replica("b")
    req2 = Req("r2", p, "s")
    # Redis is asked on the Redis thread: "not yet" until its answer is in, then the hit.
    assert second.get_num_new_matched_tokens(req2, 0) == (None, False)
    deadline = time.monotonic() + 10
    while (got := second.get_num_new_matched_tokens(req2, 0))[0] is None:
        assert time.monotonic() < deadline, "the Redis check never answered"
        time.sleep(0.01)
    assert got == (3 * BS, True)
    second.update_state_after_alloc(req2, [7, 8, 9, 10], 3 * BS)
    (job,) = second.build_plan([], {}).loads
    assert [i.source for i in job.items] == ["redis"] * 3
    assert {i.key for i in job.items} == {block_key(h) for h in req2.block_hashes}


def test_each_rank_has_its_own_key_and_a_block_needs_every_rank() -> None:
    import redis

    url = "redis://127.0.0.1:6379/15"
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    m = Manifest(
        f"tp-{uuid.uuid4().hex}", "torch.float32", 4, ("l0",), (100,), "sha256:x", tp_size=2
    )
    ranks = [RedisStore(url, m, ttl_s=30, rank=r) for r in (0, 1)]
    scheduler = RedisStore(url, m, ttl_s=30)
    try:
        other = "cd" * 32
        for r, store in enumerate(ranks):
            store.write(KEY, memoryview(bytes([r]) * 100))
        ranks[0].write(other, memoryview(bytes(100)))
        assert ranks[1].name(KEY) == f"lgkv:{m.fingerprint()}:{KEY}:r1"
        assert scheduler.exists_many([KEY, other]) == [True, False]
        out = bytearray(100)
        ranks[1].read_into(KEY, memoryview(out))
        assert bytes(out) == bytes([1]) * 100
        client.set(ranks[1].name(other), client.get(ranks[0].name(other)))  # rank 0's bytes
        with pytest.raises(BlockFileError, match="another block"):
            ranks[1].read_into(other, memoryview(out))
        assert scheduler.remove_many([KEY, other]) == 4
        assert not list(client.scan_iter(f"lgkv:{m.fingerprint()}:*"))
    finally:
        for k in client.scan_iter(f"lgkv:{m.fingerprint()}:*"):
            client.delete(k)
