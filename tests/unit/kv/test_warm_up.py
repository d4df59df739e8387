"""A start that serves at once: the snapshot and the block files taken in steps.

- A snapshot streamed in chunks (``begin_stream`` / ``stream`` / ``sweep``), with turns,
  registry changes and forgets noted in between, leaves the policy and the index's eviction
  order exactly where a one-shot ``load`` of the same snapshot followed by the same changes
  leaves them: the same victims in the same order.
- Block files found by the background scan are indexed a bounded amount per step; a block not
  indexed yet is a miss, one dropped while the scan runs is never indexed, and once every file
  is in the index equals the one the old one-step start built.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.kv.registry.sql import SessionRow
from server.kv.scheduler.continuations import Continuations
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy, group_snapshot
from server.kv.scheduler.registry_sync import SessionChange, Snapshot
from server.kv.scheduler.tails import TailBook
from server.kv.scheduler.warm_up import FileScan, WarmUp
from server.kv.tiers.disk import DiskStore
from server.kv.tiers.manifest import Manifest

FILE = 100


@dataclass
class Clock:
    """A settable unix time (the policy's clock)."""

    t: float

    def __call__(self) -> float:
        return self.t


def key(i: int) -> str:
    return f"{i:016x}"


def random_row(rng: random.Random, i: int, now: float) -> SessionRow:
    pinned = rng.random() < 0.15
    return SessionRow(
        "t", f"s{i}", 0, 3, now, now - rng.uniform(0, 7200), pinned, None,
        rng.choice([0, 1, 3]), rng.uniform(1, 600), managed=rng.random() < 0.2,
        pin_until=now + rng.uniform(-60, 600) if pinned and rng.random() < 0.5 else None,
    )  # fmt: skip


def random_snapshot(
    rng: random.Random, sessions: int, now: float
) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
    rows = [random_row(rng, i, now) for i in range(sessions)]
    refs: list[tuple[str, str, str]] = []
    for row in rows:
        if rng.random() < 0.1:
            continue  # a session without blocks
        own = [key(1000 + int(row.id[1:]) * 8 + j) for j in range(rng.randint(1, 4))]
        shared = [key(rng.randrange(8))] if rng.random() < 0.5 else []
        refs += [(row.tenant, row.id, k) for k in shared + own]
    refs += [("t", "orphan", key(3)), ("t", "orphan", key(5000))]  # refs without a row
    return rows, refs


def build(clock: Clock, keys: list[str]) -> tuple[EvictionPolicy, BlockIndex]:
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1, clock=clock)
    index = BlockIndex(num_slots=0, file_bytes=FILE, disk_bytes=FILE * 10**6, policy=policy)
    for k in keys:
        assert index.add_disk_file(k)
    return policy, index


def victims(index: BlockIndex) -> list[str]:
    got = list(index.disk_order.victims(index.policy.clock(), set(), allow_pinned=False))
    return got


@pytest.mark.parametrize("seed", range(6))
def test_streamed_snapshot_gives_the_one_shot_decisions(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock(1.7e9)
    before_rows, before_refs = random_snapshot(rng, 40, clock.t)  # what the engine knew
    rows, refs = random_snapshot(rng, 60, clock.t)  # the snapshot (some sessions gone, new)
    rows = [r for r in rows if int(r.id[1:]) % 7 != 3]
    keys = sorted({k for _, _, k in before_refs + refs} | {key(9000 + i) for i in range(5)})
    one_policy, _ = build(clock, keys)
    inc_policy, inc_index = build(clock, keys)
    for policy in (one_policy, inc_policy):
        policy.load(before_rows, before_refs)
    changes: list[tuple[str, object]] = []
    for i in rng.sample(range(80), 20):  # turns, registry changes and deletes meanwhile
        what = rng.choice(["turn", "record", "forget"])
        own = [key(1000 + i * 8), key(rng.randrange(8))]
        changes.append((what, (i, random_row(rng, i, clock.t + 1), own)))

    def apply(policy: EvictionPolicy, change: tuple[str, object]) -> None:
        what, (i, row, own) = change  # type: ignore[misc]
        if what == "turn":
            policy.note_turn("t", f"s{i}", own, clock.t + 1)
        elif what == "record":
            policy.record(row, own)
        else:
            policy.forget("t", f"s{i}")

    one_policy.load(rows, refs)
    for change in changes:
        apply(one_policy, change)

    grouped = group_snapshot(rows, refs)
    items = list(grouped.values())
    inc_policy.begin_stream()
    pending = list(changes)
    while items:
        n = rng.randint(1, 9)
        for item in items[:n]:
            inc_policy.stream(item)
        items = items[n:]
        if pending and rng.random() < 0.5:
            change = pending.pop(0)
            if change[0] == "turn":  # the scheduler takes the session's item first (settle)
                item = grouped.get(("t", f"s{change[1][0]}"))  # type: ignore[index]
                if item is not None:
                    inc_policy.stream(item)
            apply(inc_policy, change)
    while not inc_policy.sweep(rng.randint(1, 5)):
        if pending and rng.random() < 0.5:
            apply(inc_policy, pending.pop(0))
    for change in pending:
        apply(inc_policy, change)

    assert inc_policy._sessions == one_policy._sessions
    assert dict(inc_policy._blocks_of) == dict(one_policy._blocks_of)
    assert {k: v for k, v in inc_policy._refs.items() if v} == {
        k: v for k, v in one_policy._refs.items() if v
    }
    for k in keys:
        assert inc_policy.pin_end(k) == one_policy.pin_end(k)
        assert inc_policy.is_managed(k) == one_policy.is_managed(k)
    for t in (clock.t + 2, clock.t + 700):  # before and after the leases lapse
        clock.t = t
        candidates = [(k, 0.0) for k in keys]
        assert inc_policy.order(candidates, allow_pinned=False) == one_policy.order(
            candidates, allow_pinned=False
        )
        assert victims(inc_index) == one_policy.order(candidates, allow_pinned=False)


class _Sync:
    """The registry thread's write queue, run at once on a list of tier updates."""

    def __init__(self) -> None:
        self.tiers: dict[str, tuple[bool, bool, bool, int]] = {}

    def write(self, what: str, fn) -> None:  # type: ignore[no-untyped-def]
        class Reg:
            set_block_tiers = self.tiers.update

        fn(Reg())


MANIFEST = Manifest(
    model_id="m", dtype="torch.float32", block_size=4, layers=("l0",),
    layer_block_bytes=(16,), hash_scheme="sha256:abc",
)  # fmt: skip


def test_files_come_in_a_bounded_amount_per_step(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    keys = [key(i) for i in range(2000)]
    store.write(keys[0], memoryview(bytes(16)))
    data = store.path(keys[0]).read_bytes()
    for k in keys[1:]:  # the same size as a written file (the scan checks names and sizes)
        store.path(k).parent.mkdir(parents=True, exist_ok=True)
        store.path(k).write_bytes(data)
    clock = Clock(1.7e9)
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1, clock=clock)
    index = BlockIndex(
        num_slots=4, file_bytes=store.file_bytes, disk_bytes=store.file_bytes * 10**4,
        policy=policy,
    )  # fmt: skip
    sync = _Sync()
    answered: list[int] = []
    done: list[bool] = []
    (tmp_path / "registry-exists").touch()
    scan = FileScan(store, tmp_path / "registry-exists", chunk=128)
    warm = WarmUp(
        index, policy, TailBook(4), sync, scan,  # type: ignore[arg-type]
        block_bytes=16, answered=answered.append, on_files_done=lambda: done.append(True),
    )  # fmt: skip
    warm.add_snapshot(Snapshot([], [], first=True, last=False))
    assert warm.defer(7) and not answered  # a barrier waits behind the snapshot
    dropped = keys[1999]
    warm.removed([dropped])  # deleted by the API process while the scan runs
    steps = 0
    seen: list[int] = []
    while warm.pending():
        if steps == 3:
            warm.add_snapshot(Snapshot([], [], first=False, last=True))
        warm.step(0.0005)
        steps += 1
        seen.append(len(index.blocks))
        for k in keys[:50]:
            assert index.tier_of(k) in (None, "disk")  # a miss until indexed, never wrong
        time.sleep(0.0005)
        assert steps < 100_000
    assert answered == [7] and warm.policy_ready and done == [True]
    assert steps > 3 and len(set(seen)) > 3  # it came in over several steps
    assert set(index.blocks) == set(keys) - {dropped}
    assert index.disk_used == len(index.blocks) * store.file_bytes
    assert len(index.disk_order) == len(index.blocks)
    assert sync.tiers == {k: (False, True, False, 16) for k in index.blocks}
    assert not warm.holding()


def test_the_token_ids_of_files_found_at_start_are_learnt(tmp_path: Path) -> None:
    """A restart learns each block file's parent and token ids from its header page, so reuse
    up to a token and shifted reuse work on them; a file written without them teaches
    nothing."""
    store = DiskStore(tmp_path, MANIFEST)
    store.write(key(1), memoryview(bytes(16)), ("root", bytes(range(16))))
    store.write(key(2), memoryview(bytes(16)), (key(1), bytes(range(16, 32))))
    store.write(key(3), memoryview(bytes(16)))
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1, clock=Clock(1.7e9))
    index = BlockIndex(
        num_slots=4, file_bytes=store.file_bytes, disk_bytes=store.file_bytes * 10, policy=policy
    )
    (tmp_path / "registry-exists").touch()
    learnt = Continuations(4)
    warm = WarmUp(
        index, policy, TailBook(4), _Sync(), FileScan(store, tmp_path / "registry-exists"),  # type: ignore[arg-type]
        block_bytes=16, answered=lambda token: None, learn=learnt.learn_packed,
    )  # fmt: skip
    warm.add_snapshot(Snapshot([], [], first=True, last=True))
    deadline = time.monotonic() + 30
    while warm.pending() and time.monotonic() < deadline:
        warm.step(0.01)
        time.sleep(0.001)
    assert set(index.blocks) == {key(1), key(2), key(3)}
    assert learnt.stored(key(1)) == ("root", bytes(range(16)))
    assert learnt.stored(key(2)) == (key(1), bytes(range(16, 32)))
    assert learnt.stored(key(3)) is None
    assert warm.files.tokens == {}  # handed over, nothing kept twice


def test_missing_registry_deletes_the_files_in_the_background(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, MANIFEST)
    for i in range(10):
        store.write(key(i), memoryview(bytes(16)))
    scan = FileScan(store, tmp_path / "no-registry.sqlite3")
    deadline = time.monotonic() + 30
    while not scan.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scan.done and scan.take() is None
    assert not any(store.path(key(i)).exists() for i in range(10))


def test_a_burst_of_session_changes_is_taken_in_steps() -> None:
    """Another process's bulk writes arrive as one drain of changes: taken a bounded amount
    per step, a newer change of a session replacing the older, a barrier answered after
    them, and a turn of a session whose change waits takes that change first."""
    clock = Clock(1.7e9)
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1, clock=clock)
    index = BlockIndex(num_slots=0, file_bytes=FILE, disk_bytes=FILE, policy=policy)
    answered: list[int] = []
    warm = WarmUp(
        index, policy, TailBook(4), _Sync(), FileScan(None),  # type: ignore[arg-type]
        block_bytes=16, answered=answered.append,
    )  # fmt: skip
    rng = random.Random(3)
    for i in range(3000):
        row = random_row(rng, i % 2500, clock.t)  # the last 500 replace earlier ones
        warm.add_change(SessionChange("t", row.id, row, [key(i)]))
    assert warm.defer(9)
    warm.step(0.0005)
    assert 0 < len(policy._sessions) < 2500 and answered == []
    row = random_row(rng, 2400, clock.t)
    policy_gap = policy._outlook(row).expected_gap_s
    warm.add_change(SessionChange("t", "s2400", row, [key(7)]))
    warm.settle("t", "s2400")  # before its turn is noted: the change read earlier goes first
    policy.note_turn("t", "s2400", [key(7)], clock.t + 1)
    assert policy._sessions[("t", "s2400")].expected_gap_s == policy_gap
    warm.finish()
    assert answered == [9] and not warm.pending()
    assert len(policy._sessions) == 2500
    assert policy.keys_of("t", "s10") == [key(2510)]  # the newer change of s10 won
