"""Pin leases: a pin with ``pin_ttl_seconds`` holds until then, and the engine's purge turns
the session into an ordinary one again (the engine owns expiry).

Each test runs on both registry backends (``backend``: the SQLite file, then sessions in the
real Redis with the local part in the file)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from registries import Backend

from langgraph_kvcache.contract import InvalidTTL
from server.kv.registry.control import SessionControl
from server.kv.scheduler.policy import EvictionPolicy

KEYS = [f"{n:0>16}" for n in ("a1", "a2")]


@pytest.fixture
def control(backend: Backend) -> Iterator[SessionControl]:
    c = backend.control()
    yield c
    c.close()


def _turn(backend: Backend, sid: str) -> None:
    reg = backend.open()  # the engine's connection records the turn
    reg.record_turn("t", sid, KEYS, 8, default_ttl_s=None)
    reg.close()


def test_a_lease_pins_until_it_lapses_then_purge_unpins(
    control: SessionControl, backend: Backend
) -> None:
    _turn(backend, "s")
    before = time.time()
    info = control.update("s", "t", pin_ttl_seconds=60)
    assert info.pinned and info.pin_expires_at is not None
    assert before + 60 <= info.pin_expires_at <= time.time() + 60
    engine = backend.open()
    seq = engine.change_seq()

    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1)
    policy.load(*engine.policy_snapshot())
    assert policy.is_pinned(KEYS[0], now=time.time())
    assert not policy.is_pinned(KEYS[0], now=info.pin_expires_at + 1)  # lapsed: not pinned

    engine.purge_expired(now=info.pin_expires_at - 1)  # still within the lease
    assert control.get("s", "t").pinned
    engine.purge_expired(now=info.pin_expires_at + 1)
    row = engine.get_session("t", "s")
    assert row is not None and (row.pinned, row.pin_until) == (False, None)
    assert row.num_blocks == len(KEYS)  # the session itself stays
    _, changed = engine.changes_after(seq)
    assert changed is not None and ("t", "s") in changed  # engines reload it
    policy.load(*engine.policy_snapshot())
    assert not policy.is_pinned(KEYS[0], now=time.time())
    info = control.get("s", "t")
    assert (info.pinned, info.pin_expires_at) == (False, None)
    engine.close()


def test_readers_see_a_lapsed_lease_as_unpinned_before_the_purge(
    control: SessionControl, backend: Backend
) -> None:
    _turn(backend, "s")
    control.update("s", "t", pin_ttl_seconds=1)
    time.sleep(1.2)
    info = control.get("s", "t")
    assert (info.pinned, info.pin_expires_at) == (False, None)


def test_pin_renews_unpin_drops_and_a_plain_pin_has_no_lease(
    control: SessionControl, backend: Backend
) -> None:
    _turn(backend, "s")
    first = control.update("s", "t", pin_ttl_seconds=30).pin_expires_at
    renewed = control.update("s", "t", pin_ttl_seconds=300).pin_expires_at
    assert first is not None and renewed is not None and renewed > first + 200
    info = control.update("s", "t", pinned=False)
    assert (info.pinned, info.pin_expires_at) == (False, None)
    control.update("s", "t", pin_ttl_seconds=5)
    info = control.update("s", "t", pinned=True)  # pinned until unpinned
    assert (info.pinned, info.pin_expires_at) == (True, None)
    engine = backend.open()
    engine.purge_expired(now=time.time() + 10_000)
    assert control.get("s", "t").pinned
    engine.close()


def test_copies_and_deletes_of_leased_sessions(control: SessionControl, backend: Backend) -> None:
    _turn(backend, "s")
    control.update("s", "t", pin_ttl_seconds=60)
    copy = control.copy("s", "fork", "t")
    assert (copy.pinned, copy.pin_expires_at) == (False, None)
    control.delete("s", "t")
    engine = backend.open()
    assert engine.purge_expired(now=time.time() + 120) == []  # nothing left to unpin or free
    assert engine.get_session("t", "s") is None
    assert not control.get("fork", "t").pinned
    engine.close()


def test_bad_leases_are_refused(control: SessionControl, backend: Backend) -> None:
    _turn(backend, "s")
    for bad in (0, -1, float("inf"), 10**9):
        with pytest.raises(InvalidTTL, match="pin_ttl_seconds"):
            control.update("s", "t", pin_ttl_seconds=bad)
    with pytest.raises(ValueError, match="pin_ttl_seconds pins"):
        control.update("s", "t", pinned=False, pin_ttl_seconds=10)
    assert not control.get("s", "t").pinned
