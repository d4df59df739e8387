"""Two real server replicas sharing KV and sessions through the real Redis (issue 11).

Replicas A and B: the tiny model, each its own cache folder, the same ``--kv-redis-url``
(db 10, emptied first) and so the same session namespace (the served model name). Small
budgets: 32-token blocks, a 3 MiB resident cache (one context) that a couple of long
prompts flush, so a hit can only come from the connector's tiers. One pair for the module.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server.kv.keys import block_path
from tests.integration.conftest import ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

REDIS_URL = "redis://127.0.0.1:6379/10"
NAMESPACE = "tiny-llama"  # the served model name: replicas of one model share sessions
PORTS = (18101, 18102)
BLOCK = 32
REPLICA_ARGS: tuple[str, ...] = (
    "--kv-cache-memory-bytes", "3MiB",
    "--max-model-len", "2048",
    "--max-num-seqs", "4",
    "--block-size", str(BLOCK),
    "--enforce-eager",
    "--distributed-executor-backend", "uni",
    "--kv-ram-bytes", "64MiB",
    "--kv-disk-bytes", "256MiB",
    "--kv-redis-url", REDIS_URL,
    "--kv-stats-flush", "0.2",
)  # fmt: skip
DOC = " ".join(f"Entry {i}: the ferry left pier {i % 7} at {i % 12} o'clock." for i in range(70))


def _port(wanted: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", wanted))
        except OSError:
            return free_port()
    return wanted


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, server_model_dir: Path
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL).flushdb()  # db 10 is this module's alone
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    servers = []
    for name, port in zip("ab", PORTS, strict=True):
        root = tmp_path_factory.mktemp(f"replica-{name}")
        servers.append(
            ServerProcess(
                model_dir=server_model_dir,
                model="tiny-llama",
                cache_dir=root / "cache",
                log_path=root / "server.log",
                args=REPLICA_ARGS,
                port=_port(port),
            )
        )
    try:
        with ThreadPoolExecutor(2) as pool:  # both engines load at once
            list(pool.map(ServerProcess.start, servers))
        yield servers[0], servers[1]
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.stop, servers))


def complete(server: ServerProcess, prompt: str, session: str | None, max_tokens: int = 8) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if session:
        body["session_id"] = session
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(check, timeout_s: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return bool(check())


def test_turn_two_on_b_hits_from_redis_and_b_runs_the_session_api(
    replicas: tuple[ServerProcess, ServerProcess],
) -> None:
    import redis

    a, b = replicas
    sid = "replica-thread"
    first = complete(a, DOC, sid)
    prior = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    full = first["usage"]["prompt_tokens"] // BLOCK
    # A's worker writes the blocks to Redis in the background; its metrics say when.
    assert wait_for(lambda: metric(a, 'lgkv_tier_blocks{tier="redis"}') >= full)

    with httpx.Client(base_url=b.base_url, timeout=60) as api_b:
        seen = api_b.get(f"/v1/sessions/{sid}")  # created by A's turn, answered by B
        assert seen.status_code == 200, seen.text
        assert seen.json()["turns"] == 1 and seen.json()["num_blocks"] >= full

        second = complete(b, DOC + first["choices"][0]["text"] + " And then?", sid)
        assert cached(second) >= 0.9 * prior, (cached(second), prior)
        print(f"\nturn 2 on B cached {cached(second)} of turn 1's {prior} tokens (prompt+answer)")
        assert metric(b, 'lgkv_hit_blocks_total{tier="redis"}') >= full  # B had nothing local
        assert api_b.get(f"/v1/sessions/{sid}").json()["turns"] == 2  # one session, two replicas

        assert api_b.post(f"/v1/sessions/{sid}/pin").json()["pinned"] is True
        assert httpx.get(f"{a.base_url}/v1/sessions/{sid}", timeout=60).json()["pinned"] is True
        fork = api_b.post(f"/v1/sessions/{sid}/copy", json={"target_id": "replica-fork"})
        assert fork.status_code == 201, fork.text
        on_a = httpx.get(f"{a.base_url}/v1/sessions/replica-fork", timeout=60).json()
        assert on_a["num_blocks"] == api_b.get(f"/v1/sessions/{sid}").json()["num_blocks"]

        keys = _session_keys(sid)
        a_files = [k for k in keys if _file(a, k)]
        assert a_files, "A saved turn 1's blocks to its disk tier"
        assert api_b.delete("/v1/sessions/replica-fork").json()["freed_blocks"] == 0
        assert api_b.delete(f"/v1/sessions/{sid}").json()["freed_blocks"] == len(set(keys))

    assert httpx.get(f"{a.base_url}/v1/sessions/{sid}", timeout=60).status_code == 404
    # A was idle: its API process saw the drops in the stream and woke its engine.
    assert wait_for(lambda: not any(_file(a, k) for k in a_files)), "A kept its files"
    assert not any(_file(b, k) for k in keys)
    client = redis.Redis.from_url(REDIS_URL)
    assert wait_for(lambda: not any(client.keys(f"lgkv:*:{k}") for k in keys)), "left in Redis"
    assert not client.keys(f"lgkv:reg:{{{NAMESPACE}}}:s:*")  # no session rows left

    # Nothing serves the session's blocks any more: flush A's resident cache (3,072 tokens)
    # with long prompts of other sessions, then repeat turn 2 on A.
    for i in range(4):
        complete(a, f"Filler {i}. " + " ".join(f"word{i}x{j}" for j in range(350)), f"fill-{i}", 1)
    again = complete(a, DOC + first["choices"][0]["text"] + " And then?", sid)
    assert cached(again) == 0, cached(again)


def _session_keys(sid: str) -> list[str]:
    import redis

    member = f"lgkv:reg:{{{NAMESPACE}}}:b:default\x1f{sid}"
    return [k.decode() for k in redis.Redis.from_url(REDIS_URL).lrange(member, 0, -1)]


def _file(server: ServerProcess, key: str) -> bool:
    """Whether the replica has a block file of ``key`` (exact paths: the engine may be
    removing files and their empty fan-out folders right now)."""
    layouts = [p for p in (server.cache_dir / "blocks").iterdir() if p.is_dir()]
    return any(block_path(layout, key).exists() for layout in layouts)
