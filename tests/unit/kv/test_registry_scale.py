"""The registry at scale (issue 26) and expired rows (issue 27), on both backends: page
cursors, bounded purges, kept counts, the chunked snapshot, and writes that treat an expired
session as missing. Timings are figures of ``benchmarks/scale_registry.py``, never asserted
here; what is asserted is the shape that keeps them flat (batches, cursors, counters).

Each test runs on both registry backends (``backend``: the SQLite file, then sessions in the
real Redis with the local part in the file) unless it names one."""

from __future__ import annotations

import time

import pytest
from registries import Backend

from server.kv.registry.api import EngineRegistry
from server.kv.registry.page import parse_session_cursor, session_cursor
from server.kv.registry.sql import SessionRow

T0 = 1_700_000_000.0


def _keys(sid: str, n: int = 2) -> list[str]:
    return [f"{sid}-k{i}" for i in range(n)]


def _turn(reg: EngineRegistry, sid: str, at: float, ttl: float | None = None) -> None:
    reg.record_turn("t", sid, _keys(sid), 8, default_ttl_s=ttl, now=at)


def _order(rows: list[SessionRow]) -> list[tuple[float, str]]:
    return [(r.last_used_at, r.id) for r in rows]


def _page_all(reg: EngineRegistry, limit: int, between=None) -> list[str]:  # type: ignore[no-untyped-def]
    seen: list[str] = []
    after = None
    while True:
        page = reg.list_sessions("t", limit, after=after)
        assert _order(page) == sorted(_order(page), reverse=True)  # newest first, ties id desc
        seen.extend(r.id for r in page)
        if len(page) < limit:
            return seen
        after = session_cursor(page[-1])
        if between is not None:
            between(len(seen))


def test_cursor_pages_visit_every_session_once_while_sessions_are_added(
    backend: Backend,
) -> None:
    reg = backend.open()
    start = time.time() + 1000  # newer than anything the test adds by wall clock
    ids = [f"s{i:03d}" for i in range(60)]
    for i, sid in enumerate(ids):  # runs of five share a last use: ties across pages
        _turn(reg, sid, start - i // 5)
    added: list[str] = []

    def add(n: int) -> None:  # new and newly used sessions go to the front, not onto pages
        sid = f"new{n:03d}"
        _turn(reg, sid, start + 10 + n)
        added.append(sid)

    listed = _page_all(reg, 7, between=add)
    assert sorted(listed) == ids and len(listed) == len(set(listed))  # each exactly once
    everything = reg.list_sessions("t", 1000)
    assert [r.id for r in everything] == [*reversed(added), *listed]  # one order, both ways
    assert [r.id for r in reg.list_sessions("t", 5, 10)] == [r.id for r in everything[10:15]]
    after = session_cursor(everything[9])
    assert reg.list_sessions("t", 5, 2, after=after) == everything[12:17]  # offset after it
    assert reg.list_sessions("t", 5, after=session_cursor(everything[-1])) == []
    assert reg.list_sessions("other", 5) == [] and reg.list_sessions("t", 0) == []
    reg.close()


def test_a_malformed_cursor_is_a_clear_value_error(backend: Backend) -> None:
    reg = backend.open()
    _turn(reg, "a", T0)
    row = reg.list_sessions("t", 1)[0]
    assert parse_session_cursor(session_cursor(row)) == (row.last_used_at, "a")
    for bad in ["", "nope", "!!!!", session_cursor(row)[:-3], "W1sxLDIsM11d", "a" * 2000]:
        with pytest.raises(ValueError, match="malformed session list cursor"):
            reg.list_sessions("t", 5, after=bad)
    reg.close()


def test_counts_are_kept_through_every_write(backend: Backend) -> None:
    reg = backend.open()
    now = time.time()

    def check() -> None:
        for tenant in ("t", "u", "nobody"):
            assert reg.count_sessions(tenant) == len(reg.list_sessions(tenant, 1000))
        assert reg.count_sessions() == reg.count_sessions("t") + reg.count_sessions("u")

    for i in range(5):
        _turn(reg, f"a{i}", now)
    reg.record_turn("u", "x", ["k"], 4, default_ttl_s=None)
    _turn(reg, "a0", now + 1)  # a second turn: no new session
    check()
    assert reg.create_session("t", "c", ttl_seconds=None, pinned=False)
    assert not reg.create_session("t", "c", ttl_seconds=None, pinned=False)
    assert reg.copy_session("t", "a1", "a2", overwrite=True) == "ok"  # replaces a2
    assert reg.copy_session("t", "a1", "f", overwrite=False) == "ok"
    check()
    assert reg.delete_session("t", "a3") is not None and reg.delete_session("t", "a3") is None
    _turn(reg, "old", now - 100, ttl=1.0)
    check()
    assert reg.count_sessions("t") == 7
    reg.purge_expired()
    check()
    assert (reg.count_sessions(), reg.count_sessions("t"), reg.count_sessions("u")) == (7, 6, 1)
    reg.close()


def test_a_purge_batch_deletes_at_most_its_limit_and_says_when_more_is_due(
    backend: Backend,
) -> None:
    reg = backend.open()
    now = time.time()
    for i in range(25):
        _turn(reg, f"e{i:02d}", now - 100 - i, ttl=10.0)  # e24 expired first
    _turn(reg, "live", now, ttl=10.0)
    reg.update_session("t", "live", set_ttl=False, ttl_seconds=None, pinned=True, pin_ttl_s=0.01)
    freed, more = reg.purge_expired_batch(now + 1, limit=10)
    assert more and reg.count_sessions() == 16
    assert freed == sorted(k for i in range(15, 25) for k in _keys(f"e{i:02d}"))  # earliest
    left = reg.purge_expired(now + 1)  # the rest, batch after batch
    assert len(left) == 30 and reg.count_sessions() == 1
    assert sorted(reg.drops_after(0)[1]) == sorted(freed + left)  # each recorded once
    assert not reg.get_session("t", "live").pinned  # type: ignore[union-attr]  # lease lifted
    assert reg.purge_expired_batch(now + 1) == ([], False)  # nothing due
    reg.close()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_purge_holds_the_write_lock_for_one_batch_at_a_time(backend: Backend) -> None:
    from server.kv.registry.expiry import PURGE_BATCH

    reg = backend.open()
    now = time.time()
    n = PURGE_BATCH * 2 + 17
    rows = [("t", f"e{i:04d}", 0, 1, now - 100, now - 100, 10.0) for i in range(n)]
    with reg._write() as db:  # type: ignore[attr-defined]
        db.executemany(
            "INSERT INTO sessions (tenant, id, num_tokens, turns, created_at, last_used_at, "
            "ttl_seconds) VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    per_transaction: list[int] = []
    last = [""]

    def trace(sql: str) -> None:  # a statement that fires triggers is traced once per trigger
        if sql.startswith("BEGIN IMMEDIATE"):
            per_transaction.append(0)
        elif sql.startswith("DELETE FROM sessions") and sql != last[0]:
            per_transaction[-1] += 1
        last[0] = sql

    reg._db.set_trace_callback(trace)  # type: ignore[attr-defined]
    reg.purge_expired(now)
    reg._db.set_trace_callback(None)  # type: ignore[attr-defined]
    assert sum(per_transaction) == n and reg.count_sessions() == 0
    assert len(per_transaction) >= 3 and max(per_transaction) <= PURGE_BATCH
    reg.close()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_purge_with_nothing_due_takes_no_write_lock(backend: Backend) -> None:
    import sqlite3

    reg = backend.open(busy_timeout_s=0.2)
    _turn(reg, "a", time.time(), ttl=60.0)
    lock = sqlite3.connect(backend.path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        assert reg.purge_expired() == []  # no wait behind it, no "database is locked"
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    reg.close()


def test_the_snapshot_streams_in_chunks_that_join_to_the_whole(backend: Backend) -> None:
    reg = backend.open()
    for i in range(23):
        reg.record_turn("t" if i % 2 else "u", f"s{i:02d}", _keys(f"s{i}", 3), 8,
                        default_ttl_s=None)  # fmt: skip
    chunks = list(reg.iter_policy_snapshot(chunk=5))
    assert len(chunks) >= 3 and all(rows for rows, _ in chunks)
    if backend.kind == "sqlite":
        assert [len(rows) for rows, _ in chunks] == [5, 5, 5, 5, 3]
    sessions = [r for rows, _ in chunks for r in rows]
    refs = [ref for _, chunk_refs in chunks for ref in chunk_refs]
    assert len({(r.tenant, r.id) for r in sessions}) == len(sessions) == 23  # each once
    whole_sessions, whole_refs = reg.policy_snapshot()
    assert sorted(sessions, key=lambda r: (r.tenant, r.id)) == sorted(
        whole_sessions, key=lambda r: (r.tenant, r.id)
    )
    assert sorted(refs) == sorted(whole_refs) and len(refs) == 69
    for rows, chunk_refs in chunks:  # a chunk carries its own sessions' blocks, in order
        mine = {(r.tenant, r.id) for r in rows}
        assert {(t, s) for t, s, _ in chunk_refs} == mine
        for t, s in mine:
            assert [k for tt, ss, k in chunk_refs if (tt, ss) == (t, s)] == reg.session_keys(t, s)
    reg.close()


def test_an_expired_session_is_missing_for_every_write(backend: Backend) -> None:
    reg = backend.open()
    past = time.time() - 100
    for sid in ("gone", "gone2", "gone3", "target"):
        _turn(reg, sid, past, ttl=10.0)  # expired 90 s ago, not purged
    reg.update_session("t", "gone", set_ttl=False, ttl_seconds=None, pinned=True)  # refused
    _turn(reg, "live", time.time())
    # TTL and pin changes would bring it back: refused as for an unknown session.
    assert not reg.update_session("t", "gone", set_ttl=True, ttl_seconds=1e6, pinned=None)
    assert not reg.update_session("t", "gone", set_ttl=False, ttl_seconds=None, pinned=True)
    row = reg.get_session("t", "gone")
    assert row is not None and row.ttl_seconds == 10.0 and not row.pinned  # unchanged
    # A copy of it would too: no source. An expired target is free (its blocks dropped).
    assert reg.copy_session("t", "gone", "fresh", overwrite=True) == "no_source"
    assert reg.get_session("t", "fresh") is None
    assert reg.copy_session("t", "live", "target", overwrite=False) == "ok"
    assert reg.session_keys("t", "target") == _keys("live")
    assert sorted(reg.drops_after(0)[1]) == _keys("target")
    # A turn for it starts a new session; creating it over the expired row succeeds.
    reg.record_turn("t", "gone", ["n1"], 5, default_ttl_s=30.0)
    row = reg.get_session("t", "gone")
    assert row is not None and (row.turns, row.gap_count, row.ttl_seconds) == (1, 0, 30.0)
    assert row.created_at == row.last_used_at > past + 50 and not row.managed
    assert reg.session_keys("t", "gone") == ["n1"]
    assert reg.create_session("t", "gone2", ttl_seconds=None, pinned=False)
    assert reg.get_session("t", "gone2").turns == 0  # type: ignore[union-attr]
    assert reg.count_sessions("t") == 5  # gone, gone2, gone3, target, live
    reg.close()


def test_a_tenants_pinned_and_managed_sessions_are_read_from_their_index(
    backend: Backend,
) -> None:
    reg = backend.open()
    now = time.time()
    for sid in ("a", "b", "c", "d", "old"):
        _turn(reg, sid, now - (100 if sid == "old" else 0), ttl=50.0)
    reg.record_turn("u", "x", ["k"], 4, default_ttl_s=None)
    reg.update_session("t", "a", set_ttl=False, ttl_seconds=None, pinned=True)
    reg.update_session("t", "b", set_ttl=False, ttl_seconds=None, pinned=True, pin_ttl_s=5.0)
    reg.update_session("u", "x", set_ttl=False, ttl_seconds=None, pinned=True)
    assert reg.create_session("t", "e", ttl_seconds=None, pinned=True)
    assert reg.copy_session("t", "a", "f", overwrite=False) == "ok"  # a copy is not pinned
    reg.update_session("t", "e", set_ttl=False, ttl_seconds=None, pinned=False)
    pinned = reg.pinned_sessions("t", now + 1)
    assert sorted(r.id for r in pinned) == ["a", "b"]
    blocks = {r.id: r.num_blocks for r in pinned}  # the pin quota counts them
    assert blocks == {sid: reg.get_session("t", sid).num_blocks for sid in "ab"}  # type: ignore[union-attr]
    assert blocks["a"] > 0
    assert {r.id: r.num_blocks for r in reg.managed_sessions("t")}["f"] == blocks["a"]
    assert [r.id for r in reg.pinned_sessions("t", now + 10)] == ["a"]  # b's lease lapsed
    assert sorted(r.id for r in reg.managed_sessions("t")) == ["a", "b", "e", "f"]
    reg.delete_session("t", "a")
    reg.mark_managed("t", "c")
    assert reg.pinned_sessions("t", now + 1)[0].id == "b"
    assert sorted(r.id for r in reg.managed_sessions("t")) == ["b", "c", "e", "f"]
    assert [r.id for r in reg.pinned_sessions("u", now)] == ["x"]
    if backend.kind == "redis":  # a namespace an older version wrote has no such sets yet
        client, prefix = reg.sessions._client, reg.sessions.prefix  # type: ignore[attr-defined]
        client.delete(prefix + "layout", prefix + "pin:t", prefix + "mgd:t")
        fresh = backend.open()
        assert [r.id for r in fresh.pinned_sessions("t", now + 1)] == ["b"]
        assert sorted(r.id for r in fresh.managed_sessions("t")) == ["b", "c", "e", "f"]
        fresh.close()
    reg.close()
