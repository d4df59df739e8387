"""What only the Redis session registry must do: several replicas at once, namespaces, a
replica that was away, trimmed feeds, and Redis down (real Redis on 127.0.0.1:6379, db 11;
a proxy in front of it plays the outage)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from registries import Backend, proxy
from test_registry_sync import engine_sync, settled

from server.api.protocol import APIError
from server.api.sessions import _guard
from server.kv.registry.api import RegistryUnavailable
from server.kv.scheduler.registry_sync import Dropped, SessionChange, Snapshot

pytestmark = [pytest.mark.redis, pytest.mark.parametrize("backend", ["redis"], indirect=True)]


def test_replicas_purging_at_once_delete_each_session_and_record_each_drop_once(
    backend: Backend,
) -> None:
    writer = backend.open()
    for i in range(40):
        keys = [f"{i:04x}a", f"{i:04x}b", "shared"]
        writer.record_turn("t", f"s{i}", keys, 8, default_ttl_s=0.05, now=time.time() - 1)
    writer.record_turn("t", "keeper", ["shared"], 4, default_ttl_s=None)
    replicas = [backend.open() for _ in range(4)]
    freed: list[list[str]] = []
    start = threading.Barrier(len(replicas))

    def purge(reg) -> None:  # type: ignore[no-untyped-def]
        start.wait()
        freed.append(reg.purge_expired())

    threads = [threading.Thread(target=purge, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = sorted(f"{i:04x}{x}" for i in range(40) for x in "ab")  # "shared" is kept
    assert sorted(k for keys in freed for k in keys) == expected  # once, by whoever ran first
    assert sorted(writer.drops_after(0)[1]) == expected  # and recorded once
    assert writer.count_sessions() == 1 and writer.session_keys("t", "keeper") == ["shared"]
    for reg in [writer, *replicas]:
        reg.close()


def test_namespaces_never_mix(backend: Backend, tmp_path: Path) -> None:
    other = Backend("redis", tmp_path / "o.sqlite3", backend.redis_url, backend.namespace + "-b")
    a, b = backend.open(), other.open()
    try:
        a.record_turn("t", "s", ["k1"], 4, default_ttl_s=None)
        assert b.get_session("t", "s") is None and b.count_sessions() == 0
        b.record_turn("t", "s", ["k2"], 4, default_ttl_s=None)
        assert a.delete_session("t", "s") == ["k1"]
        assert b.session_keys("t", "s") == ["k2"] and b.drops_after(0)[1] == []
    finally:
        a.close()
        b.close()
        other.clear()


def test_an_engine_that_was_away_applies_the_drops_it_missed(backend: Backend) -> None:
    rs = engine_sync(backend)
    rs.write("turn", lambda reg: reg.record_turn("t", "a", ["k1", "k2"], 8, default_ttl_s=None))
    settled(rs)
    rs.close()  # the replica stops (its drops position is saved in its own file)
    api = backend.open()  # another replica's API process deletes meanwhile
    assert api.delete_session("t", "a") == ["k1", "k2"]
    rs = engine_sync(backend)  # restarted on the same cache folder
    try:
        events = settled(rs)
        assert isinstance(events[0], Snapshot) and events[0].sessions == []
        assert [k for e in events if isinstance(e, Dropped) for k in e.keys] == ["k1", "k2"]
        assert not any(isinstance(e, Dropped) for e in settled(rs))  # once
    finally:
        rs.close()
        api.close()


def test_a_reader_behind_the_trimmed_changes_reloads_the_snapshot(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("server.kv.registry.redis.DROPS_KEPT", 10)
    reg = backend.open()
    reg.record_turn("t", "first", ["k"], 4, default_ttl_s=None)
    behind = reg.change_seq()
    assert reg.changes_after(0) == (behind, [("t", "first")])
    for i in range(400):  # MAXLEN ~ 10 trims whole stream nodes (100 entries each)
        reg.mark_managed("t", f"s{i}")
    newest, changed = reg.changes_after(behind)
    assert changed is None and newest == reg.change_seq()  # reload, never a silent gap
    assert reg.changes_after(newest) == (newest, [])
    reg.close()


def test_redis_down_answers_503_at_once_and_recovers(backend: Backend) -> None:
    redis = proxy()
    control = backend.control(url=redis.url)
    rs = engine_sync(backend, url=redis.url)
    try:
        settled(rs)  # open
        control.create("s", "t", ttl_seconds=60)
        assert any(isinstance(e, SessionChange) and e.session_id == "s" for e in settled(rs))
        redis.down()
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=r"unreachable.*retry when Redis is back"):
            control.get("s", "t")
        with pytest.raises(APIError) as http:  # what the session routes answer
            asyncio.run(_guard(asyncio.to_thread, control.update, "s", "t", pinned=True))
        assert http.value.status == 503 and "Redis" in http.value.message
        assert time.monotonic() - t0 < 10  # no wait for the engine first
        assert "lgkv_sessions" not in control.metrics()  # /metrics still answers
        redis.up()
        assert control.get("s", "t").ttl_seconds == 60
    finally:
        rs.close()
        control.close()
        redis.close()
