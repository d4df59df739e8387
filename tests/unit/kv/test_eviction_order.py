"""The index's eviction orders pick the victims the reference ranking picks.

Random histories (seeded) drive a real :class:`BlockIndex` and :class:`EvictionPolicy` on a
fake clock: turns with shared prefixes and forked copies, tails, registry records with gaps,
pins with leases that lapse as time moves (and a clock step back), managed sessions, snapshot
loads, locks, drops, failed files and a shrinking disk budget. Before every eviction the test
ranks the candidates from scratch with :meth:`EvictionPolicy.order` (the old ranking: every
block walked, every session looked up) and asserts the index evicts exactly those keys in
exactly that order.
"""

from __future__ import annotations

import math
import random

import pytest

from server.kv.keys import tail_key
from server.kv.metadata import NO_SLOT, WorkerReport
from server.kv.registry.sql import SessionRow
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy
from server.kv.scheduler.tournament import KineticTournament, first, holds_until

FILE = 100


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ram_reference(index: BlockIndex, count: int, protect: set[str]) -> list[str]:
    """The old ``alloc_slots``: rank every ready, unlocked RAM block; skip pinned ones that
    are not on disk."""
    free = min(count, len(index.free_slots))
    candidates = [
        (s.key, s.last_access)
        for s in index.blocks.values()
        if s.slot != NO_SLOT and s.ram_ready and s.locks == 0 and s.key not in protect
    ]
    out: list[str] = []
    for key in index.policy.order(candidates, allow_pinned=True):
        if free + len(out) == count:
            break
        if index.policy.is_pinned(key) and not index.blocks[key].on_disk:
            continue
        out.append(key)
    return out


def disk_reference(index: BlockIndex, protect: set[str]) -> list[str]:
    """The old ``reserve_disk``'s victims."""
    if index.disk_bytes < index.file_bytes:
        return []
    need = index.disk_used + index.file_bytes - index.disk_bytes
    if need <= 0:
        return []
    candidates = [
        (s.key, s.last_access)
        for s in index.blocks.values()
        if s.on_disk and not s.dropped and s.key not in protect
    ]
    order = index.policy.order(candidates, allow_pinned=False)
    return order[: math.ceil(need / index.file_bytes)]


class History:
    """One random history against the index, checking every eviction."""

    def __init__(self, seed: int, *, grid: bool) -> None:
        self.rng = random.Random(seed)
        self.grid = grid
        self.clock = Clock(0.0 if grid else 1.7e9 + self.rng.random())
        self.policy = EvictionPolicy(default_gap_s=60, min_gap_s=1, clock=self.clock)
        self.index = BlockIndex(
            num_slots=self.rng.choice([4, 8, 16]),
            file_bytes=FILE,
            disk_bytes=FILE * self.rng.choice([6, 12, 24]),
            policy=self.policy,
        )
        self.sessions: dict[str, list[str]] = {}
        self.rows: dict[str, SessionRow] = {}
        self.next_block = 0
        self.checked = 0

    # ---------------------------------------------------------------- helpers

    def time(self, scale: float) -> float:
        if self.grid:
            return self.rng.randrange(0, int(scale * 4) + 1) / 4
        return self.rng.random() * scale

    def new_key(self) -> str:
        self.next_block += 1
        return f"{self.next_block:016x}"

    def alloc(self, count: int, protect: set[str]) -> list[int]:
        want = ram_reference(self.index, count, protect)
        owner = {s.slot: s.key for s in self.index.blocks.values() if s.slot != NO_SLOT}
        free = set(self.index.free_slots)
        slots = self.index.alloc_slots(count, protect)
        got = [owner[s] for s in slots if s not in free]
        assert got == want, (self.clock.t, got, want)
        self.checked += 1
        return slots

    def reserve(self, protect: set[str]) -> bool:
        want = disk_reference(self.index, protect)
        before = len(self.index.removes)
        ok = self.index.reserve_disk(protect)
        got = self.index.removes[before:]
        assert got == want[: len(got)], (self.clock.t, got, want)
        assert got == want or not ok
        self.checked += 1
        return ok

    # ------------------------------------------------------------- operations

    def turn(self) -> None:
        sid = self.rng.choice([f"s{i}" for i in range(8)])
        keys = list(self.sessions.get(sid, []))
        if not keys:
            keys = ["0" * 15 + "a"] if self.rng.random() < 0.7 else []  # a shared prompt
            if self.sessions and self.rng.random() < 0.4:  # a fork of another session
                keys = list(self.rng.choice(list(self.sessions.values())))
        keys = [k for k in keys if len(k) == 16]  # the old tail is superseded
        keys += [self.new_key() for _ in range(self.rng.randint(0, 3))]
        if keys and self.rng.random() < 0.5:
            keys.append(tail_key(keys[-1], [self.rng.randint(1, 9)]))
        self.policy.note_turn("t", sid, keys, self.clock.t)
        self.sessions[sid] = keys
        new = [k for k in keys if k not in self.index.blocks]
        protect = set(keys)
        slots = self.alloc(len(new), protect)
        for key, slot in zip(new, slots, strict=False):
            to_disk = self.reserve(protect)
            self.index.new_block(key, slot, to_disk)
            if self.rng.random() < 0.8:
                self.index.apply(WorkerReport(saved=[key]))
            if to_disk and self.rng.random() < 0.8:
                self.index.apply(WorkerReport(written=[key]))

    def record(self) -> None:
        if not self.sessions:
            return
        sid = self.rng.choice(list(self.sessions))
        pinned = self.rng.random() < 0.3
        lease = self.clock.t + self.time(200) if pinned and self.rng.random() < 0.6 else None
        count = self.rng.choice([0, 1, 3])
        row = SessionRow(
            "t",
            sid,
            0,
            count + 1,
            0.0,
            self.clock.t - self.time(300),
            pinned,
            self.rng.choice([None, 600.0]),
            count,
            self.rng.choice([1.0, 2.0, 3.0, 7.5, 60.0, 100.0]) if count else 0.0,
            managed=self.rng.random() < 0.25,
            pin_until=lease,
        )
        self.rows[sid] = row
        self.policy.record(row, self.sessions[sid])

    def forget(self) -> None:
        if self.sessions:
            sid = self.rng.choice(list(self.sessions))
            del self.sessions[sid]
            self.rows.pop(sid, None)
            self.policy.forget("t", sid)

    def load(self) -> None:
        rows = [r for sid, r in self.rows.items() if sid in self.sessions]
        refs = [("t", sid, k) for sid, keys in self.sessions.items() for k in keys]
        refs.append(("t", "ghost", self.rng.choice(refs)[2]) if refs else ("t", "ghost", "x"))
        self.policy.load(rows, refs)
        self.sessions = {r.id: self.sessions[r.id] for r in rows}

    def lock_or_release(self) -> None:
        blocks = list(self.index.blocks.values())
        if not blocks:
            return
        s = self.rng.choice(blocks)
        if s.locks:
            self.index.apply(WorkerReport(released_slots=[s.slot]))
        elif s.slot != NO_SLOT and s.ram_ready:
            s.locks += 1  # a RAM hit (the scheduler locks the slot directly)

    def damage(self) -> None:
        blocks = list(self.index.blocks)
        if not blocks:
            return
        key = self.rng.choice(blocks)
        roll = self.rng.random()
        if roll < 0.3:
            self.index.drop(key)
        elif roll < 0.5:
            self.index.apply(WorkerReport(write_failed=[key]))
        elif roll < 0.7:
            self.index.apply(WorkerReport(read_failed=[key]))
        elif roll < 0.85:
            self.index.touch(key)
        else:
            self.index.apply(WorkerReport(saved=[key], written=[key]))

    def squeeze(self) -> None:
        """Alloc with random protects (the whole RAM now and then), or a disk budget cut."""
        roll = self.rng.random()
        if roll < 0.5:
            protect = set(self.rng.sample(list(self.index.blocks), min(2, len(self.index.blocks))))
            count = self.index.num_slots if roll < 0.1 else self.rng.randint(1, 3)
            slots = self.alloc(count, protect)
            self.index.free_slots.extend(slots)  # not used after all
        else:
            if roll < 0.75:
                self.index.disk_bytes = FILE * self.rng.randint(0, 24)
            protect = set(self.rng.sample(list(self.index.blocks), min(1, len(self.index.blocks))))
            if self.reserve(protect):
                self.index.disk_used -= FILE  # the write was not planned after all

    def run(self, steps: int) -> None:
        ops = [self.turn] * 5 + [self.record] * 2 + [self.squeeze] * 3
        ops += [self.forget, self.load, self.lock_or_release, self.lock_or_release, self.damage]
        for _ in range(steps):
            roll = self.rng.random()
            if roll < 0.02:
                self.clock.t -= self.time(50)  # a clock step back
            elif roll < 0.6:
                self.clock.t += self.time(40) if self.rng.random() < 0.8 else 0.0
            self.rng.choice(ops)()
            self.check_counters()

    def check_counters(self) -> None:
        blocks = self.index.blocks.values()
        assert self.index.unconfirmed_writes == sum(
            s.on_disk and not s.disk_confirmed for s in blocks
        )
        assert self.index.confirmed_files == sum(s.on_disk and s.disk_confirmed for s in blocks)
        owners = {s.slot: s.key for s in blocks if s.slot != NO_SLOT}
        assert self.index.slot_owners() == owners


@pytest.mark.parametrize("seed", range(40))
def test_same_victims_as_the_reference_on_a_time_grid(seed: int) -> None:
    """Times on a quarter-second grid: latenesses tie often (the tie-breakers decide)."""
    history = History(seed, grid=True)
    history.run(400)
    assert history.checked > 50


@pytest.mark.parametrize("seed", range(20))
def test_same_victims_as_the_reference_at_unix_times(seed: int) -> None:
    """Unix-scale float times, as in production (rounding near line crossings)."""
    history = History(1000 + seed, grid=False)
    history.run(400)
    assert history.checked > 50


class Line:
    def __init__(self, i: int, start: float, gap: float, rank: tuple[int, int]) -> None:
        self.rank, self.start, self.gap = rank, start, gap
        self.tail = (i % 2, float(i % 3), f"{i:04d}")
        self.leaf = -1


@pytest.mark.parametrize("seed", range(10))
def test_tournament_drains_in_sorted_order(seed: int) -> None:
    """Many lines, crossing often, drained at increasing times with inserts between."""
    rng = random.Random(seed)
    kt = KineticTournament()
    now = 1.7e9
    live: list[Line] = []
    for i in range(300):
        line = Line(
            i, now + rng.uniform(-500, 50), rng.choice([1, 2.5, 7, 60, 61]), (0, i % 7 == 0)
        )
        kt.insert(line, now)
        live.append(line)
        if i % 10 == 0:
            now += rng.uniform(0, 30)
            kt.advance(now)
            best = min(live, key=lambda e: (e.rank, -max(0.0, now - e.start) / e.gap, e.tail))
            assert kt.top() is best
            if rng.random() < 0.5:
                kt.remove(best, now)
                live.remove(best)
    for e in live:
        for o in live:
            if e is not o and first(e, o, now):
                assert holds_until(e, o, now) >= now


@pytest.mark.parametrize("seed", range(5))
def test_certificates_hold_up_to_their_end_and_end_near_the_crossing(seed: int) -> None:
    """Sound: the winner stays first at every time up to its certificate's end (sampled
    densely near the end). Tight: the end is within a microsecond of the real crossing."""
    rng = random.Random(seed)
    for i in range(2000):
        t = 1.7e9 + rng.uniform(0, 1000)
        a = Line(i, t - rng.uniform(-100, 3000), rng.choice([1, 2.5, 7, 60, 61, 86.4]), (0, 0))
        b = Line(i + 1, t - rng.uniform(-100, 3000), rng.choice([1, 2.5, 7, 60, 61]), (0, 0))
        w, o = (a, b) if first(a, b, t) else (b, a)
        end = holds_until(w, o, t)
        if end == math.inf:
            assert all(first(w, o, t + d) for d in (1, 1e3, 1e6, 1e9))
            continue
        assert end >= t
        for s in [
            t,
            end,
            *(end - d for d in (1e-6, 1e-3, 1, 10)),
            *(t + (end - t) * f for f in (0.5, 0.9, 0.999)),
        ]:
            if t <= s <= end:
                assert first(w, o, s), (w.start, w.gap, o.start, o.gap, t, s, end)
        if (
            t > max(w.start, o.start) and w.gap != o.gap
        ):  # both rising: the end is the crossing, less a hair
            assert not first(w, o, end + 2e-6 + 8 * math.ulp(end))
