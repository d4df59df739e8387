"""A million sessions on one node: each per-request, per-step and per-save operation's time
against the number of blocks held (issue 26).

For each N, a synthetic scheduler side is built through the project's own classes: an
:class:`EvictionPolicy` that knows N/4 sessions of 4 blocks (one shared system-prompt block
per 1,000 sessions, the rest their own; gaps from 1 s to 1 h, last turns spread over a day, a
tenth managed, one in a hundred pinned with a lease), a :class:`BlockIndex` whose disk tier
holds all N blocks and is full, and whose RAM tier holds 1,024 of them, and a
:class:`Publisher` with N/4 blocks in Redis. A fake clock moves 10 ms per call, so lateness
lines cross and leases lapse while an operation runs. Each operation then runs repeatedly
(at least 5 times and 0.3 s); its median per N is printed with k, the slope of a least-squares
fit of log(time) against log(N) (time ~ N^k: 0 flat, 1 linear; the goal is k <= 0.15).
The registry's operations (``benchmarks/scale_registry.py``, same contract) join the table
when that module is present. Then the engine start with N real block files and a registry of
N/4 sessions (``benchmarks/scale_start.py``: start to serving, every file indexed, the steps
meanwhile; ``--only start`` for that table alone). Last, the scheduler's memory per block and
per session: the process's RSS growth while building each N, divided by N (and by N/4).

    python benchmarks/session_scale.py [--sizes 1e3 1e4 1e5 1e6] [--quick] [--only NAME ...]

``OPERATIONS``: (name, where it runs, setup); ``setup(N)`` returns a zero-argument callable to
time, or that and an undo run untimed after each call. Operations that change the index put
back what they took (a save's eviction puts the evicted block back), so every call works on
the same N blocks of N/4 sessions.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.kv.metadata import NO_SLOT, WorkerReport  # noqa: E402
from server.kv.registry.sql import SessionRow  # noqa: E402
from server.kv.scheduler.control_ops import ControlOps  # noqa: E402
from server.kv.scheduler.index import BlockIndex  # noqa: E402
from server.kv.scheduler.policy import EvictionPolicy  # noqa: E402
from server.kv.scheduler.publisher import Publisher  # noqa: E402
from server.kv.scheduler.scheduler import SessionKVScheduler  # noqa: E402
from server.kv.scheduler.tails import TailBook  # noqa: E402
from server.kv.scheduler.warm_up import FileScan, WarmUp  # noqa: E402

Run = Callable[[], object]
Setup = Callable[[int], "Run | tuple[Run, Run]"]
"""``setup(N)``: the callable to time, or (it, an undo run untimed after each call)."""
RAM_SLOTS = 1024
BLOCKS_PER_SESSION = 4
FILE = 1


class Clock:
    """Unix time that moves 10 ms each time the timed callable asks the policy."""

    def __init__(self) -> None:
        self.t = 1.7e9

    def __call__(self) -> float:
        self.t += 0.01
        return self.t


class _Sync:
    """Stands in for the registry thread: a publish only queues its job."""

    def publish(self, updates: dict, counters: dict, gauges: dict) -> None:
        self.last = (len(updates), len(counters), len(gauges))


class World:
    """The scheduler side's structures holding N blocks (see the module doc)."""

    def __init__(self, n: int) -> None:
        rng = random.Random(n)
        self.n = n
        self.clock = Clock()
        self.policy = EvictionPolicy(60.0, 1.0, clock=self.clock)
        self.index = BlockIndex(
            num_slots=RAM_SLOTS, file_bytes=FILE, disk_bytes=n * FILE, policy=self.policy
        )
        now = self.clock.t
        self.sessions = max(1, n // BLOCKS_PER_SESSION)
        for i in range(self.sessions):
            gap = rng.choice([1.0, 10.0, 60.0, 600.0, 3600.0]) * rng.uniform(0.5, 1.5)
            pinned = i % 100 == 0
            row = SessionRow(
                "t", f"s{i}", 0, 3, now, now - rng.uniform(0, 86400), pinned, None, 2, gap,
                managed=i % 10 == 0, pin_until=now + rng.uniform(0, 600) if pinned else None,
            )  # fmt: skip
            self.policy.record(row, self.keys(i))
        for i in range(self.sessions):
            for key in self.keys(i):
                self.index.add_disk_file(key)
        for key in [k for i in range(min(self.sessions, RAM_SLOTS)) for k in self.keys(i)][
            :RAM_SLOTS
        ]:
            slot = self.index.alloc_slots(1, set())[0]
            self.index.new_block(key, slot, to_disk=False)
            self.index.saved(key)
        self.publisher = Publisher(
            _Sync(),  # type: ignore[arg-type]
            block_bytes=FILE,
            stats_flush_s=1.0,
            redis_ttl_s=3600.0,
            offload_dtype="auto",
            compression_ratio=1.0,
        )
        for i in range(self.sessions):
            self.publisher.redis_written(self.keys(i)[1])
        self.next = 0
        self.ram: dict[int, str] = {
            s.slot: s.key for s in self.index.blocks.values() if s.ram_ready
        }
        """Slot -> key of the RAM tier as built (what an allocation's undo puts back)."""

    @staticmethod
    def keys(i: int) -> list[str]:
        shared = f"a{i // 1000:015x}"
        return [shared] + [f"{(i + 1) << 8 | j:016x}" for j in range(1, BLOCKS_PER_SESSION)]

    def fresh_key(self) -> str:
        self.next += 1
        return f"f{self.next:015x}"


_worlds: dict[int, World] = {}


def world(n: int) -> World:
    """The world of N blocks (one at a time: building the next frees the last)."""
    if n not in _worlds:
        _worlds.clear()
        gc.collect()
        _worlds[n] = World(n)
    return _worlds[n]


def _reserve_disk(n: int) -> tuple[Run, Run]:
    """A save's disk space when the disk is full; the undo drops the new block and puts the
    evicted file back, so every call evicts from the same N blocks of N/4 sessions."""
    w = world(n)
    key = ""

    def run() -> None:
        nonlocal key
        key = w.fresh_key()
        assert w.index.reserve_disk({key})
        w.index.new_block(key, NO_SLOT, to_disk=True)
        w.index.written(key)

    def undo() -> None:
        evicted, w.index.removes = w.index.removes, []
        w.index.drop(key, remove_file=False)
        for victim in evicted:
            assert w.index.add_disk_file(victim)
        w.index.dirty.clear()

    return run, undo


def _alloc_slot(n: int) -> tuple[Run, Run]:
    """A RAM slot when RAM is full; the undo puts the evicted block back in its slot."""
    w = world(n)
    key, slot = "", NO_SLOT
    while w.index.free_slots:  # N below the RAM tier's slots: fill it, so every call evicts
        filler = w.fresh_key()
        (free,) = w.index.alloc_slots(1, set())
        w.index.new_block(filler, free, to_disk=False)
        w.index.saved(filler)
        w.ram[free] = filler

    def run() -> None:
        nonlocal key, slot
        key = w.fresh_key()
        (slot,) = w.index.alloc_slots(1, {key})
        w.index.new_block(key, slot, to_disk=False)
        w.index.saved(key)

    def undo() -> None:
        w.index.drop(key, remove_file=False)  # frees the slot
        victim = w.ram[slot]
        (back,) = w.index.alloc_slots(1, set())
        state = w.index.new_block(victim, back, to_disk=False)
        state.last_access = 0.0  # as built (files found at start)
        w.index.saved(victim)
        del w.ram[slot]
        w.ram[back] = victim
        w.index.dirty.clear()

    return run, undo


def _release(n: int) -> Callable[[], object]:
    w = world(n)
    states = [s for s in w.index.blocks.values() if s.ram_ready][:64]
    turn = iter(range(10**12))

    def run() -> None:
        state = states[next(turn) % len(states)]
        state.locks += 1  # a RAM hit locks the slot ...
        w.index.apply(WorkerReport(released_slots=[state.slot]))  # ... its load releases it

    return run


def _has_pending_work(n: int) -> Callable[[], object]:
    w = world(n)
    sched = object.__new__(SessionKVScheduler)
    sched.index = w.index
    sched._removing, sched._to_redis = set(), set()
    sched._ops = ControlOps(w.index, w.policy, None, lambda: None, set())  # type: ignore[arg-type]
    sched._warm = WarmUp(
        w.index, w.policy, TailBook(16), None, FileScan(None),  # type: ignore[arg-type]
        block_bytes=FILE, answered=lambda token: None,
    )  # fmt: skip
    sched._warm.finish()  # started long ago: nothing left to take
    return sched.has_pending_work


def _flush(n: int) -> Callable[[], object]:
    w = world(n)
    keys = [w.keys(i)[2] for i in range(min(w.sessions, 16))]

    def run() -> None:
        w.index.dirty.update(keys)
        w.publisher.flush(w.index, force=True)

    return run


def _note_turn(n: int) -> Callable[[], object]:
    w = world(n)
    turn = iter(range(10**12))

    def run() -> None:
        i = next(turn) * 7919 % w.sessions
        w.policy.note_turn("t", f"s{i}", w.keys(i), w.clock())

    return run


def _touch(n: int) -> Callable[[], object]:
    w = world(n)
    keys = [k for k in (w.keys(i)[3] for i in range(w.sessions)) if k in w.index.blocks][:64]
    turn = iter(range(10**12))
    return lambda: w.index.touch(keys[next(turn) % len(keys)])


OPERATIONS: list[tuple[str, str, Setup]] = [
    ("reserve_disk (disk full)", "scheduler thread, per saved block", _reserve_disk),
    ("alloc_slots (RAM full)", "scheduler thread, per RAM allocation", _alloc_slot),
    ("apply (slot released)", "scheduler thread, per load", _release),
    ("has_pending_work", "scheduler thread, every idle step", _has_pending_work),
    ("Publisher.flush", "scheduler thread, every flush", _flush),
    ("EvictionPolicy.note_turn", "scheduler thread, per finished request", _note_turn),
    ("BlockIndex.touch", "scheduler thread, per hit block", _touch),
]


def _module(name: str) -> ModuleType | None:
    """``benchmarks/<name>.py`` (the registry's table, the engine start), if present."""
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def median_time(fn: Run | tuple[Run, Run], *, min_runs: int = 5, min_s: float = 0.3) -> float:
    """Median seconds of ``fn`` over at least ``min_runs`` calls and ``min_s`` seconds (a
    pair: the second is run, untimed, after each call of the first)."""
    run, undo = fn if isinstance(fn, tuple) else (fn, None)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        if undo is not None:
            undo()
        if len(times) >= 100_000:
            break
    return statistics.median(times)


def slope(sizes: list[int], times: list[float]) -> float:
    """k of time ~ N^k (least squares on logs)."""
    pts = [(math.log(n), math.log(t)) for n, t in zip(sizes, times, strict=True) if t > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else float("nan")


def rss() -> int:
    """Resident bytes of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _fmt(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e4, 1e5, 1e6])
    p.add_argument("--quick", action="store_true", help="sizes up to 1e4 (a smoke test)")
    p.add_argument("--only", nargs="+", default=None, help="operations whose name has one")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes]
    if args.quick:
        sizes = [s for s in sizes if s <= 10_000] or [1_000, 10_000]
    ops = [("scheduler", *op) for op in OPERATIONS]
    registry = _module("scale_registry")
    start = _module("scale_start")
    if args.only and not any("start" in s.lower() for s in args.only):
        start = None
    if registry is not None:
        ops += [("registry", *op) for op in registry.OPERATIONS]
    if args.only:
        ops = [op for op in ops if any(s.lower() in op[1].lower() for s in args.only)]
    results: dict[str, list[float | None]] = {op[1]: [] for op in ops}
    memory: list[tuple[int, float, float]] = []
    for n in sizes:
        if any(kind == "scheduler" for kind, *_ in ops):
            _worlds.clear()
            gc.collect()
            before, t0 = rss(), time.perf_counter()
            world(n)
            grown = rss() - before
            build = time.perf_counter() - t0
            memory.append((n, grown / n, grown / max(1, n // BLOCKS_PER_SESSION)))
            print(f"N={n}: scheduler side built in {build:.1f} s", file=sys.stderr)
        for _, name, _, setup in ops:
            try:
                results[name].append(median_time(setup(n)))
            except Exception as exc:  # a backend that is down: say so, go on
                print(f"{name} at N={n}: {exc!r}", file=sys.stderr)
                results[name].append(None)
        if registry is not None and hasattr(registry, "close_all"):
            registry.close_all()
    head = f"| operation | where it runs | {' | '.join(f'N={n:.0e}' for n in sizes)} | k |"
    if ops:
        print(head)
        print("|" + " --- |" * (len(sizes) + 3))
    for kind, name, where, _ in ops:
        ts = results[name]
        ok = [(n, t) for n, t in zip(sizes, ts, strict=True) if t is not None]
        k = slope([n for n, _ in ok], [t for _, t in ok])
        cells = " | ".join(_fmt(t) for t in ts)
        print(f"| {name} ({kind}) | {where} | {cells} | {k:.2f} |")
    if start is not None:  # last: it builds its own scheduler side per N, on real files
        _worlds.clear()
        gc.collect()
        figures = {n: start.measure(n, before=n <= 100_000) for n in sizes}
        print()
        print("\n".join(start.table(sizes, figures)))
    if memory:
        print()
        print("| N blocks | scheduler RSS per block | per session (4 blocks) |")
        print("| --- | --- | --- |")
        for n, per_block, per_session in memory:
            print(f"| {n:.0e} | {per_block:.0f} B | {per_session:.0f} B |")


if __name__ == "__main__":
    main()
