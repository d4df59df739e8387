"""The scheduler side without vLLM: lookups, plans, worker reports, budgets, eviction order.

``Req`` carries exactly the fields of ``vllm.v1.request.Request`` the scheduler side reads.
The registry is read and written by the scheduler's registry thread; ``sched.catch_up()``
waits for it where a test reads the registry or a change from the API process must be seen.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from server.kv.keys import block_key
from server.kv.metadata import NO_SLOT, StepPlan, WorkerReport
from server.kv.registry import Registry, SessionRow
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy
from server.kv.scheduler.scheduler import SessionKVScheduler
from server.kv.settings import ConnectorSettings

BS = 4  # tokens per block
BB = 100  # bytes per block
FB = 120  # bytes per block file


@dataclass
class Params:
    extra_args: dict[str, Any] | None = None


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    session: str | None = None
    op: str | None = None
    num_computed_tokens: int = 0
    sampling_params: Params = field(default_factory=Params)
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        extra: dict[str, Any] = {}
        if self.session:
            extra.update(session_id=self.session, tenant="t")
        if self.op:
            extra["lgkv_op"] = self.op
        self.sampling_params = Params(extra or None)
        parent = b"seed"
        for i in range(len(self.prompt) // BS):
            parent = hashlib.sha256(parent + bytes(self.prompt[i * BS : (i + 1) * BS])).digest()
            self.block_hashes.append(parent)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)


def make(
    tmp_path: Path, ram_blocks: int = 4, disk_blocks: int = 6, **kw: Any
) -> SessionKVScheduler:
    settings = ConnectorSettings.from_extra_config(
        {
            "cache_dir": str(tmp_path),
            "ram_bytes": ram_blocks * BB,
            "disk_bytes": disk_blocks * FB,
            "stats_flush_s": 0.001,
            **kw,
        }
    )
    return SessionKVScheduler(settings, block_size=BS, block_bytes=BB, file_bytes=FB, disk_files={})


def run(sched: SessionKVScheduler, req: Req, *, worker_ok: bool = True) -> StepPlan:
    """Admit a request, schedule all its tokens in one step, let a worker 'do' the plan."""
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    assert n is not None
    block_ids = list(range(100, 100 + len(req.prompt) // BS + 1))
    sched.update_state_after_alloc(req, block_ids, n)
    plan = sched.build_plan(
        [(req.request_id, block_ids, True, n)], {req.request_id: req.num_tokens - n}
    )
    report(sched, plan, worker_ok)
    req.num_computed_tokens = req.num_tokens
    sched.request_finished(req)
    sched.catch_up()  # the turn and the stats are in the registry
    return plan


def report(sched: SessionKVScheduler, plan: StepPlan, ok: bool = True) -> None:
    rep = WorkerReport(saved=[s.key for s in plan.saves])
    rep.written = [s.key for s in plan.saves if s.to_disk]
    for job in plan.loads:
        for item in job.items:
            if item.from_disk:
                (rep.read_ok if ok else rep.read_failed).append(item.key)
            if item.slot != NO_SLOT:
                rep.released_slots.append(item.slot)
    for key, slot in plan.reads:
        (rep.read_ok if ok else rep.read_failed).append(key)
        rep.released_slots.append(slot)
    sched.on_report(rep)


def check_slots(index: BlockIndex) -> None:
    used = [s.slot for s in index.blocks.values() if s.slot != NO_SLOT]
    assert len(used) == len(set(used)), "a slot is assigned twice"
    assert sorted(used + index.free_slots) == list(range(index.num_slots))
    assert index.disk_used <= index.disk_bytes


def prompt(seed: int, blocks: int, extra: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(blocks * BS + extra)]


def test_save_then_hit_from_ram_is_synchronous(tmp_path: Path) -> None:
    sched = make(tmp_path)
    p = prompt(1, 3)
    plan = run(sched, Req("r1", p, "s"))
    assert [s.block_id for s in plan.saves] == [100, 101, 102] and all(
        s.to_disk for s in plan.saves
    )
    req = Req("r2", [*p, 9, 9, 9], "s")
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    assert sched.get_num_new_matched_tokens(req, BS) == (2 * BS, False)  # beyond a local hit
    sched.update_state_after_alloc(req, [5, 6, 7, 8], 2 * BS)
    (job,) = sched.build_plan([], {}).loads
    assert not job.is_async and [(i.block_id, i.source) for i in job.items] == [
        (6, "ram"),
        (7, "ram"),
    ]
    sched.catch_up()
    assert sched.registry.stats()['lgkv_hit_blocks_total{tier="ram"}'] == 2
    check_slots(sched.index)
    row = sched.registry.get_session("t", "s")
    assert row is not None and row.num_blocks == 3 and row.turns == 1


def test_never_the_whole_prompt(tmp_path: Path) -> None:
    sched = make(tmp_path)
    p = prompt(2, 2, extra=0)
    run(sched, Req("r1", [*p, 1]))
    assert sched.get_num_new_matched_tokens(Req("r2", p), 0) == (BS, False)


def test_disk_hit_is_async_and_promotes(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=3)
    p = prompt(3, 3)
    run(sched, Req("a", p, "A"))
    run(sched, Req("b", prompt(4, 3), "B"))  # pushes A out of RAM
    assert {sched.index.tier_of(block_key(h)) for h in Req("x", p).block_hashes} == {"disk"}
    req = Req("a2", p, "A")
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    sched.update_state_after_alloc(req, [7, 8, 9, 10], 3 * BS)
    plan = sched.build_plan([], {})
    (job,) = plan.loads
    assert job.is_async and [i.block_id for i in job.items] == [7, 8, 9]
    assert all(i.source == "disk" and i.slot != NO_SLOT for i in job.items)
    report(sched, plan)
    assert {sched.index.tier_of(i.key) for i in job.items} == {"ram"}
    check_slots(sched.index)


def test_failed_read_is_a_miss_afterwards(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=3)
    p = prompt(5, 3)
    run(sched, Req("a", p))
    run(sched, Req("b", prompt(6, 3)))
    req = Req("a2", p)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [1, 2, 3, 4], n)
    plan = sched.build_plan([], {})
    report(sched, plan, ok=False)
    assert sched.get_num_new_matched_tokens(Req("a3", p), 0) == (0, False)
    assert set(sched.build_plan([], {}).removes) == {i.key for i in plan.loads[0].items}
    check_slots(sched.index)


def test_budgets_hold_and_pins_survive(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=4, disk_blocks=6)
    pinned = prompt(7, 2)
    run(sched, Req("p", pinned, "P"))
    api = Registry(tmp_path / "sessions.sqlite3")  # pins come from the API process
    api.update_session("t", "P", set_ttl=False, ttl_seconds=None, pinned=True)
    api.close()
    sched.catch_up()  # the registry thread read the pin
    for i in range(8):
        run(sched, Req(f"r{i}", prompt(100 + i, 3), f"S{i}"))
        check_slots(sched.index)
        assert sched.index.disk_blocks() <= 6 and sched.index.ram_blocks() <= 4
    keys = [block_key(h) for h in Req("x", pinned).block_hashes]
    assert all(sched.index.tier_of(k) in ("ram", "disk") for k in keys)
    assert sched.get_num_new_matched_tokens(Req("p2", pinned), 0)[0] == 2 * BS
    stats = sched.registry.stats()
    assert stats['lgkv_evicted_blocks_total{tier="disk"}'] > 0
    assert stats['lgkv_tier_blocks{tier="disk"}'] <= 6


def test_drop_from_api_process_forgets_blocks(tmp_path: Path) -> None:
    sched = make(tmp_path)
    p = prompt(8, 2)
    run(sched, Req("a", p, "A"))
    api = Registry(tmp_path / "sessions.sqlite3")  # the API process's own connection
    orphans = api.delete_session("t", "A")
    assert orphans is not None and len(orphans) == 2
    api.add_drops(orphans)
    sched.catch_up()  # the registry thread read the drops
    assert sched.get_num_new_matched_tokens(Req("a2", p), 0) == (0, False)
    assert sched.index.ram_blocks() == 0
    api.close()


def test_prefetch_waits_for_reads(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=2)
    p = prompt(9, 2)
    run(sched, Req("a", p, "A"))
    run(sched, Req("b", prompt(10, 2), "B"))
    op = Req("op", [0], "A", op="prefetch")
    assert sched.get_num_new_matched_tokens(op, 0) == (None, False)
    plan = sched.build_plan([], {})
    assert len(plan.reads) == 2
    assert sched.get_num_new_matched_tokens(op, 0) == (None, False)  # reads not done yet
    report(sched, plan)
    sched.catch_up()  # the new RAM locations are published
    assert sched.get_num_new_matched_tokens(op, 0) == (0, False)
    sched.request_finished(op)
    assert sched.registry.tier_usage("t", "A")["ram"].blocks == 2
    assert sched.registry.get_session("t", "A").turns == 1  # the op is not a turn


def test_policy_prefers_overdue_sessions() -> None:
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1)
    now = time.time()

    def row(sid: str, last: float, gap: float, pinned: bool = False) -> SessionRow:
        return SessionRow("t", sid, 0, 3, now, last, pinned, None, 2, gap)

    policy.load(
        [row("quick", now - 100, 5), row("slow", now - 100, 1000), row("pin", now - 1e6, 1, True)],
        [
            ("t", "quick", "k1"),
            ("t", "slow", "k2"),
            ("t", "pin", "k3"),
            ("t", "slow", "k4"),
            ("t", "quick", "k4"),
        ],
    )
    order = policy.order(
        [("k1", 0), ("k2", 0), ("k3", 0), ("k4", 0), ("k5", now)], allow_pinned=True
    )
    assert order[0] == "k1" and order[-1] == "k3"  # 20 gaps overdue first, pinned last
    assert order.index("k4") > order.index("k1")  # shared with the promising session
    assert "k3" not in policy.order([("k3", 0)], allow_pinned=False)


def test_policy_keeps_managed_sessions_after_unmanaged_ones() -> None:
    policy = EvictionPolicy(default_gap_s=60, min_gap_s=1)
    now = time.time()
    # "live" is a checkpointer's thread, idle far longer than the anonymous session.
    live = SessionRow("t", "live", 0, 3, now, now - 3600, False, 86400.0, 2, 5, managed=True)
    anon = SessionRow("t", "anon", 0, 3, now, now - 10, False, None, 2, 5)
    policy.load([live, anon], [("t", "live", "k1"), ("t", "anon", "k2")])
    # By lateness alone the managed block would go first (720 gaps vs 2); managed ranks it last,
    # and its TTL stretches its expected gap to a tenth of the TTL.
    order = policy.order([("k1", 0), ("k2", 0), ("k3", now)], allow_pinned=True)
    assert order[-1] == "k1" and sorted(order[:2]) == ["k2", "k3"]
    assert policy.lateness("k1", 0, now) == pytest.approx(3600 / 8640)


def test_session_api_calls_mark_sessions_managed(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=4, disk_blocks=6)
    reg = sched.registry
    reg.record_turn("t", "by-request", ["a"], 128, default_ttl_s=None)
    reg.record_turn("t", "resumed", ["b"], 128, default_ttl_s=None)
    reg.create_session("t", "created", ttl_seconds=60.0, pinned=False)
    reg.mark_managed("t", "resumed")
    assert reg.copy_session("t", "by-request", "forked", overwrite=False) == "ok"
    managed = {r.id: r.managed for r in reg.policy_snapshot()[0]}
    assert managed == {"by-request": False, "resumed": True, "created": True, "forked": True}


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_invariants(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sched = make(tmp_path, ram_blocks=5, disk_blocks=7)
    prompts = [prompt(1000 * seed + i, rng.randrange(1, 5)) for i in range(6)]
    for step in range(40):
        p = rng.choice(prompts)
        run(
            sched, Req(f"r{step}", [*p, step], f"s{prompts.index(p)}"), worker_ok=rng.random() > 0.1
        )
        check_slots(sched.index)
        assert all(s.locks == 0 for s in sched.index.blocks.values())


def test_failed_disk_write_frees_the_budget(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=4, disk_blocks=6)
    p = prompt(11, 2)
    req = Req("a", p, "A")
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [], 0)
    plan = sched.build_plan([("a", [1, 2, 3], True, 0)], {"a": len(p)})
    assert sched.index.disk_blocks() == 2
    keys = [s.key for s in plan.saves]
    sched.on_report(WorkerReport(saved=keys, write_failed=keys))  # e.g. disk full
    assert sched.index.disk_blocks() == 0
    assert [sched.index.tier_of(k) for k in keys] == ["ram", "ram"]
    assert sched.build_plan([], {}).removes == keys  # any partial file goes too


def test_expired_sessions_leave_every_tier(tmp_path: Path) -> None:
    sched = make(tmp_path, default_ttl_s=0.05)
    p = prompt(12, 2)
    run(sched, Req("a", p, "A"))
    keys = [block_key(h) for h in Req("x", p).block_hashes]
    assert [sched.index.tier_of(k) for k in keys] == ["ram", "ram"]
    time.sleep(0.1)
    sched.catch_up(purge=True)  # the engine purges every few seconds; do it now
    assert sched.get_num_new_matched_tokens(Req("a2", p), 0) == (0, False)
    assert sched.registry.get_session("t", "A") is None
    assert sorted(sched.build_plan([], {}).removes) == sorted(keys)


def test_barrier_op_runs_after_the_turns_queued_before_it(tmp_path: Path) -> None:
    sched = make(tmp_path)
    p = prompt(13, 2)
    req = Req("a", p, "A")
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [], 0)
    report(sched, sched.build_plan([("a", [1, 2, 3], True, 0)], {"a": len(p)}))
    req.num_computed_tokens = len(p)
    sched.request_finished(req)  # queued for the registry thread, not written here
    op = Req("op", [0], op="barrier")  # what SessionControl.catch_up sends
    deadline = time.monotonic() + 10
    while (answer := sched.get_num_new_matched_tokens(op, 0)) == (None, False):
        assert time.monotonic() < deadline, "the barrier was never answered"
        sched.build_plan([], {})  # a step goes by
    assert answer == (0, False)
    row = sched.registry.get_session("t", "A")
    assert row is not None and row.turns == 1 and row.num_blocks == 2
