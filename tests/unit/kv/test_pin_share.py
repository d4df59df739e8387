"""``--kv-pin-share``: pinned blocks as a whole hold at most a share of each tier; pinned blocks
past it may be evicted like unpinned ones, so unpinned sessions always keep the rest."""

from __future__ import annotations

import pytest

from server.kv.metadata import WorkerReport
from server.kv.registry.sql import SessionRow
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy
from tests.unit.kv.test_eviction_order import FILE, Clock, History

T0 = 1_000.0


def _row(sid: str, *, pinned: bool, pin_until: float | None = None) -> SessionRow:
    return SessionRow("t", sid, 0, 1, T0, T0, pinned, None, 0, 0.0, pin_until=pin_until)


def _setup(
    share: float | None, *, slots: int = 8, files: int = 0
) -> tuple[BlockIndex, EvictionPolicy, Clock]:
    clock = Clock(T0)
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1, clock=clock)
    index = BlockIndex(
        num_slots=slots, file_bytes=FILE, disk_bytes=files * FILE, policy=policy, pin_share=share
    )
    return index, policy, clock


def _session(
    index: BlockIndex,
    policy: EvictionPolicy,
    sid: str,
    n: int,
    *,
    pinned: bool,
    to_disk: bool = False,
    pin_until: float | None = None,
) -> list[str]:
    keys = [f"{sid}{i:015x}" for i in range(n)]
    policy.note_turn("t", sid, keys, policy.clock())
    policy.record(_row(sid, pinned=pinned, pin_until=pin_until), keys)
    slots = index.alloc_slots(n, protect=set(keys))
    assert len(slots) == n
    for key, slot in zip(keys, slots, strict=True):
        index.new_block(key, slot, to_disk and index.reserve_disk(protect=set(keys)))
        index.apply(WorkerReport(saved=[key], written=[key] if to_disk else []))
    return keys


def _in_ram(index: BlockIndex, keys: list[str]) -> list[str]:
    return [k for k in keys if index.tier_of(k) == "ram"]


@pytest.mark.parametrize(("share", "room"), [(None, 2), (0.5, 4), (0.25, 6), (0.0, 8)])
def test_unpinned_sessions_keep_the_rest_of_ram(share: float | None, room: int) -> None:
    index, policy, clock = _setup(share)
    pinned = _session(index, policy, "p", 6, pinned=True)  # not on disk: may not leave RAM
    clock.t += 5
    others = [f"u{i:015x}" for i in range(8)]
    policy.note_turn("t", "u", others, clock.t)
    got = index.alloc_slots(8, protect=set(others))
    assert len(got) == room  # the 2 free slots, then pinned blocks past the share
    kept = _in_ram(index, pinned)
    assert len(kept) == 8 - room
    assert kept == pinned[: len(kept)]  # the first pinned blocks are the ones held
    if share is not None:
        assert index.ram_order.pinned_held == len(kept) == int(8 * share)


def test_pinned_files_past_the_share_make_room_for_unpinned_ones() -> None:
    index, policy, clock = _setup(0.5, slots=16, files=10)
    pinned = _session(index, policy, "p", 8, pinned=True, to_disk=True)
    assert index.disk_order.pinned_held == 5
    clock.t += 5
    policy.note_turn("t", "u", [], clock.t)
    reserved = 0
    while index.reserve_disk(protect=set()):
        reserved += 1
        assert reserved <= 10
    assert reserved == 5  # 2 free files, then the 3 pinned past the share
    on_disk = [k for k in pinned if index.blocks.get(k) and index.blocks[k].on_disk]
    assert on_disk == pinned[:5]


def test_a_held_pin_that_ends_lets_a_waiting_one_be_held() -> None:
    index, policy, clock = _setup(0.5)
    first = _session(index, policy, "a", 3, pinned=True, pin_until=T0 + 10)
    second = _session(index, policy, "b", 3, pinned=True)
    assert index.ram_order.pinned_held == 4  # a's 3 and b's first; b's others wait
    clock.t = T0 + 20  # a's lease lapsed: b's blocks are held, a's rank as unpinned
    policy.note_turn("t", "u", [], clock.t)
    got = index.alloc_slots(8, protect=set())
    assert len(got) == 5  # 2 free slots + a's 3 blocks
    assert _in_ram(index, second) == second and not _in_ram(index, first)
    assert index.ram_order.pinned_held == 3


def test_a_smaller_disk_budget_lets_go_of_the_newest_held_pins() -> None:
    index, policy, _ = _setup(0.5, slots=16, files=10)
    pinned = _session(index, policy, "p", 5, pinned=True, to_disk=True)
    assert index.disk_order.pinned_held == 5
    index.disk_bytes = 4 * FILE  # the file system filled up
    assert index.disk_order.pinned_held == 2
    victims = list(index.disk_order.victims(index.policy.clock(), set(), allow_pinned=False))
    assert victims == pinned[2:][: len(victims)] and len(victims) == 3


def _share(history: History, share: float) -> None:
    """Give a fresh history an index with a pin share."""
    old = history.index
    history.index = BlockIndex(
        num_slots=old.num_slots,
        file_bytes=FILE,
        disk_bytes=old.disk_bytes,
        policy=history.policy,
        pin_share=share,
    )


class _NoBudgetCuts(History):
    """A random history (tests/unit/kv/test_eviction_order.py) on an index with a pin share
    that is never reached: 1.0, and no disk budget cuts."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, grid=True)
        _share(self, 1.0)

    def squeeze(self) -> None:
        protect = set(self.rng.sample(list(self.index.blocks), min(2, len(self.index.blocks))))
        slots = self.alloc(self.rng.randint(1, 3), protect)
        self.index.free_slots.extend(slots)


@pytest.mark.parametrize("seed", range(10))
def test_below_the_share_the_order_is_the_policys(seed: int) -> None:
    history = _NoBudgetCuts(seed)
    history.run(300)
    assert history.checked > 50


class _Shared(History):
    """A random history on an index with a pin share of 0.5, checking the share's invariants
    instead of the reference order (which knows no share)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed, grid=False)
        _share(self, 0.5)

    def alloc(self, count: int, protect: set[str]) -> list[int]:
        self.checked += 1
        return self.index.alloc_slots(count, protect)

    def reserve(self, protect: set[str]) -> bool:
        return self.index.reserve_disk(protect)

    def check_counters(self) -> None:
        super().check_counters()
        now = self.clock.t
        for order, limit in (
            (self.index.ram_order, int(self.index.num_slots * 0.5)),
            (self.index.disk_order, int(self.index.disk_bytes // FILE * 0.5)),
        ):
            order._advance(max(now, order.now))
            held = order._held
            assert len(held) <= limit
            pinned = [k for k in order.keys() if self.policy.pin_end(k) > order.now]  # noqa: SIM118
            assert set(held) <= set(pinned)
            if len(held) < limit:  # room: every pinned member is held
                assert set(pinned) == set(held)


@pytest.mark.parametrize("seed", range(10))
def test_pinned_blocks_held_never_pass_the_share(seed: int) -> None:
    history = _Shared(seed)
    history.run(300)
    assert history.checked > 20
