"""Engine start with N block files: how soon the scheduler side serves, how long until every
file is indexed, and its longest step meanwhile (issue 26; ``benchmarks/session_scale.py``
prints it with its table).

For each N, a cache folder is filled the way a server leaves it: N block files of the disk
tier's layout (``DiskStore``'s fan-out folders and manifest; sparse files of the right size,
as the start-up scan checks names and sizes, not contents) under keys spread like vLLM's
block hashes, and a SQLite registry of N/4 sessions of 4 of those blocks (one in a hundred
pinned). Then the real :class:`SessionKVScheduler` starts on it as the connector starts it
(a :class:`FileScan` on a background thread, the registry thread streaming the snapshot), and
a loop plays vLLM's engine: each step asks one lookup (a request for a session's 4 blocks),
builds the step's plan (an idle step: the warm-up's larger budget and the idle sleep) and
applies an empty worker report. Printed: the time from the scheduler's construction to the
first lookup answered (serving), to every file indexed and the snapshot applied, the longest
step, and, up to 10^5, the one-step start the server had before (scan, then index every file
in the constructor, then the whole snapshot in one call).

    python benchmarks/scale_start.py [--sizes 1e3 1e4 1e5 1e6]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.kv.keys import block_path  # noqa: E402
from server.kv.metadata import WorkerReport  # noqa: E402
from server.kv.registry.sql import SCHEMA  # noqa: E402
from server.kv.registry.sqlite import Registry  # noqa: E402
from server.kv.scheduler.scheduler import SessionKVScheduler  # noqa: E402
from server.kv.scheduler.warm_up import FileScan  # noqa: E402
from server.kv.settings import ConnectorSettings  # noqa: E402
from server.kv.tiers.disk import DiskStore, rank_file_bytes  # noqa: E402
from server.kv.tiers.manifest import Manifest  # noqa: E402

BS = 16
MANIFEST = Manifest(
    model_id="scale-start", dtype="torch.float16", block_size=BS, layers=("l0",),
    layer_block_bytes=(64,), hash_scheme="sha256:scale",
)  # fmt: skip
RAM_SLOTS = 1024
PER_SESSION = 4


@dataclass
class Probe:
    """A request for the 4 blocks of one session (what ``track`` and a lookup read)."""

    request_id: str
    block_hashes: list[bytes]
    num_tokens: int = PER_SESSION * BS + 1
    sampling_params: Any = None


def block_keys(n: int) -> list[str]:
    """N keys spread like vLLM's (sha256) block hashes over the fan-out folders."""
    return [hashlib.sha256(b"%d" % i).hexdigest() for i in range(n)]


def sparse_files(store_root: Path, keys: list[str], size: int) -> None:
    """Block files of ``keys`` under a layout folder (``DiskStore.root``): sparse files of
    ``size`` bytes in the fan-out folders (the start-up scan checks names and sizes; a read
    of one would find no valid header: a miss, as for any damaged file)."""
    made: set[Path] = set()
    for key in keys:
        path = block_path(store_root, key)
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)


def prefill(root: Path, keys: list[str]) -> None:
    """The block files of ``keys`` and a registry of N/4 sessions of 4 of them."""
    sparse_files(DiskStore(root / "blocks", MANIFEST).root, keys, rank_file_bytes(MANIFEST))
    db = sqlite3.connect(root / "sessions.sqlite3", isolation_level=None)
    db.executescript(SCHEMA)
    rng, now = random.Random(len(keys)), time.time()
    sessions = len(keys) // PER_SESSION
    for lo in range(0, sessions, 50_000):
        part = range(lo, min(sessions, lo + 50_000))
        db.execute("BEGIN IMMEDIATE")
        db.executemany(
            "INSERT INTO sessions (tenant, id, num_tokens, turns, created_at, last_used_at, "
            "pinned, ttl_seconds, gap_count, gap_mean, managed) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            [
                ("t", f"s{i}", PER_SESSION * BS, 3, now, now - rng.uniform(0, 86400),
                 int(i % 100 == 0), None, 2, rng.uniform(1, 3600), int(i % 10 == 0))
                for i in part
            ],
        )  # fmt: skip
        db.executemany(
            "INSERT INTO session_blocks (tenant, session_id, idx, key) VALUES (?, ?, ?, ?)",
            [("t", f"s{i}", j, keys[i * PER_SESSION + j]) for i in part for j in range(4)],
        )
        db.execute("COMMIT")
    db.close()
    Registry(root / "sessions.sqlite3").close()  # its migrations index and count


def _scheduler(root: Path, n: int, files: dict[str, int] | None) -> SessionKVScheduler:
    settings = ConnectorSettings.from_extra_config({
        "cache_dir": str(root), "ram_bytes": RAM_SLOTS * MANIFEST.block_bytes,
        "disk_bytes": n * rank_file_bytes(MANIFEST), "stats_flush_s": 1.0,
    })  # fmt: skip
    store = DiskStore(settings.disk_dir, MANIFEST)
    scan = FileScan(store, settings.registry_path) if files is None else files
    return SessionKVScheduler(
        settings, block_size=BS, block_bytes=MANIFEST.block_bytes, file_bytes=store.file_bytes,
        disk_files=scan,
    )  # fmt: skip


def _lookup(sched: SessionKVScheduler, keys: list[str], i: int, step: int) -> int | None:
    s = i % max(1, len(keys) // PER_SESSION)
    hashes = [bytes.fromhex(k) for k in keys[s * PER_SESSION : (s + 1) * PER_SESSION]]
    probe = Probe(f"probe-{step}", hashes)
    got, _ = sched.get_num_new_matched_tokens(probe, 0)
    sched._tracked.pop(probe.request_id, None)  # never scheduled: the probe only asks
    sched._lookups.pop(probe.request_id, None)
    return got


def measure(n: int, *, before: bool) -> dict[str, float]:
    """The figures of one N (see the module doc); ``before``: time the old start too."""
    root = Path(tempfile.mkdtemp(prefix="lgkv-start-"))
    try:
        keys = block_keys(n)
        t = time.perf_counter()
        prefill(root, keys)
        print(f"N={n}: {n} block files and the registry made in "
              f"{time.perf_counter() - t:.1f} s", file=sys.stderr)  # fmt: skip
        t0 = time.perf_counter()
        sched = _scheduler(root, n, None)
        built = time.perf_counter() - t0
        serving = indexed = 0.0
        durations: list[float] = []
        while not indexed:
            steps = len(durations)
            s0 = time.perf_counter()
            got = _lookup(sched, keys, len(durations) * 7919, len(durations))
            sched.build_plan([], {})
            sched.on_report(WorkerReport())
            durations.append(time.perf_counter() - s0)
            if not serving and got is not None:
                serving = time.perf_counter() - t0
            if not sched._warm.pending():
                indexed = time.perf_counter() - t0
            if time.perf_counter() - t0 > 1800 or steps > 10**7:
                raise TimeoutError(f"N={n}: not indexed in 30 minutes")
        assert _lookup(sched, keys, 1, -1) == PER_SESSION * BS, "a session's blocks must hit"
        assert len(sched.index.blocks) == n and sched.policy.keys_of("t", "s1")
        sched.shutdown()
        durations.sort()
        out = {"built": built, "serving": serving, "indexed": indexed,
               "longest": durations[-1], "p99": durations[int(0.99 * (len(durations) - 1))],
               "steps": float(len(durations))}  # fmt: skip
        if before:
            t0 = time.perf_counter()
            files = DiskStore(root / "blocks", MANIFEST).scan()
            old = _scheduler(root, n, files)  # indexes every file in the constructor
            reg = Registry(root / "sessions.sqlite3")
            old.policy.load(*reg.policy_snapshot())
            reg.close()
            out["before"] = time.perf_counter() - t0
            old.shutdown()
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(sizes: list[int], results: dict[int, dict[str, float]]) -> list[str]:
    """The printed table."""
    lines = [
        "| N block files (N/4 sessions) | start to serving | every file indexed | steps "
        "| p99 step | longest step | one-step start (before) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in sizes:
        r = results[n]
        before = f"{r['before']:.2f} s" if "before" in r else "-"
        lines.append(
            f"| {n:.0e} | {r['serving']:.2f} s | {r['indexed']:.1f} s | {r['steps']:.0f} | "
            f"{r['p99'] * 1e3:.1f} ms | {r['longest'] * 1e3:.0f} ms | {before} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=float, default=[1e3, 1e4, 1e5, 1e6])
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes]
    results = {n: measure(n, before=n <= 100_000) for n in sizes}
    print("\n".join(table(sizes, results)))


if __name__ == "__main__":
    main()
