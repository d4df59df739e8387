"""vLLM's scheduler thread never waits on the registry or on Redis.

One engine (its own process) starts and generates while this process holds the registry's
write lock, with its Redis tier pointing at a server that accepts connections and never
answers. The requests must finish while the lock is still held (this process releases it
only after they did), give the cache-off answer, hit the RAM tier (lookups use the in-memory
index), and treat Redis as a miss with a warning. The turn records queued meanwhile must not
be lost: they reach the registry once the lock goes.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kv_engine import BLOCK, engine_kwargs

from server.kv.registry import Registry

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).with_name("engine_script.py")


class SilentServer:
    """A TCP server that accepts every connection and never sends a byte (a hung Redis)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._sock.getsockname()[1]}/0"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)  # held open, never answered

    def close(self) -> None:
        self._stop = True
        self._sock.close()
        for conn in self._conns:
            conn.close()


def test_locked_registry_and_hung_redis_do_not_stall_generation(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    path = cache / "sessions.sqlite3"
    Registry(path).close()  # schema and WAL mode, as a server that ran before leaves it
    redis = SilentServer()
    engine = engine_kwargs(tiny_model_dir, cache)
    engine["kv_connector_extra_config"]["redis_url"] = redis.url
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
        assert done[2]["num_cached_tokens"] == 3 * BLOCK
        assert done[2]["tokens"] == done[1]["tokens"]
        assert done[2]["logprobs"] == pytest.approx(done[1]["logprobs"], abs=1e-3)
        reader = sqlite3.connect(path)  # WAL: readers go on while the lock is held
        assert reader.execute("SELECT count(*) FROM sessions").fetchone()[0] == 0
        reader.close()
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        release.touch()
        redis.close()
    proc.wait(timeout=300)
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    assert "redis tier unavailable" in out  # a tier failure is a miss plus a warning
    assert "session registry" in out and "retrying" in out

    reg = Registry(path)
    row = reg.get_session("t", "A")
    stats = reg.stats()
    reg.close()
    assert row is not None and (row.turns, row.num_blocks) == (2, 4)  # + a tail; not lost
    assert stats['lgkv_hit_blocks_total{tier="ram"}'] == 3
    assert stats.get('lgkv_hit_blocks_total{tier="redis"}', 0) == 0
