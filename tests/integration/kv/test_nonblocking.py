"""vLLM's scheduler thread never waits on the registry or on Redis.

One engine (its own process) starts and generates while this process holds the registry
file's write lock, with its Redis (the tier, and so the sessions too) behind a proxy that
accepts connections and never answers (a hung Redis). The requests must finish while both
hang (this process releases them only after they did), give the cache-off answer, hit the RAM
tier (lookups use the in-memory index), and treat Redis as a miss with a warning. The turn
records queued meanwhile must not be lost: they reach the registry (sessions in Redis,
counters in the file) once the lock goes and Redis answers again.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kv_engine import BLOCK, engine_kwargs
from redis_proxy import RedisProxy

from server.kv.registry import Registry

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).with_name("engine_script.py")


def test_locked_registry_and_hung_redis_do_not_stall_generation(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    path = cache / "sessions.sqlite3"
    pytest.importorskip("redis")
    from server.kv.registry.redis import RedisSessions

    Registry(path).close()  # schema and WAL mode, as a server that ran before leaves it
    redis = RedisProxy(18152, mode="hung")  # port of this suite's range; db 11
    namespace = f"nonblocking-{uuid.uuid4().hex}"
    shared = RedisSessions(redis.url.replace(":18152/", ":6379/"), namespace)
    try:
        shared.ping()
    except OSError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    engine = engine_kwargs(tiny_model_dir, cache)
    engine["kv_connector_extra_config"].update(redis_url=redis.url, redis_namespace=namespace)
    held, release = tmp_path / "held", tmp_path / "release"
    first = [1000 + i for i in range(3 * BLOCK + 40)]
    second = [*first, *range(2000, 2060)]
    turns = [
        {"prompt": first, "session": "A"},
        {"prompt": second, "cache": False},  # the reference answer
        {"prompt": second, "session": "A", "reset": True},  # from our RAM tier
        {"signal": str(held)},
        {"await": str(release)},
        {"settle": True},  # a SYNC_OP: returns once the queued records are committed
    ]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"engine": engine, "turns": turns}))

    log = tmp_path / "engine.log"
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # another process's write transaction, held throughout
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(spec)], stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 600
        while not held.exists():
            if proc.poll() is not None:
                pytest.fail("the engine exited early:\n" + log.read_text()[-6000:])
            assert time.monotonic() < deadline, "the engine never finished its turns"
            time.sleep(0.1)
        # Every request finished while this process still holds the registry's write lock.
        done = json.loads(held.read_text())
        assert done[0]["num_cached_tokens"] == 0  # Redis (hung) answered as a miss
        assert done[2]["num_cached_tokens"] == len(first)  # blocks, the tail's prompt part
        assert done[2]["tokens"] == done[1]["tokens"]
        assert done[2]["logprobs"] == pytest.approx(done[1]["logprobs"], abs=1e-3)
        reader = sqlite3.connect(path)  # WAL: readers go on while the lock is held
        assert reader.execute("SELECT count(*) FROM stats").fetchone()[0] == 0
        reader.close()
        assert shared.count_sessions() == 0  # nothing reached Redis yet either
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        redis.up()  # Redis answers again
        release.touch()
    proc.wait(timeout=300)
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    assert "redis tier unavailable" in out  # a tier failure is a miss plus a warning
    assert "session registry" in out and "retrying" in out

    redis.close()
    row = shared.get_session("t", "A")
    shared.clear()
    reg = Registry(path)
    stats = reg.stats()
    reg.close()
    # 3 blocks, turn 2's tail and turn 1's (turn 2's prompt left turn 1's answer: a branch)
    assert row is not None and (row.turns, row.num_blocks) == (2, 5)  # not lost
    assert stats['lgkv_hit_blocks_total{tier="ram"}'] == 3
    assert stats.get('lgkv_hit_blocks_total{tier="redis"}', 0) == 0
