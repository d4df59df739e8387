"""The session registry at scale: each operation's time against the number of sessions held.

Issue 26: a node holds up to a million sessions, so no per-request, per-step or per-save
registry operation may cost more as the registry grows. For each N, a registry of N synthetic
sessions of one tenant (each with a shared system-prompt block and three blocks of its own;
half of them with a TTL that a purge "an hour later" finds expired, the other half far from
expiry) is built through the project's own classes: the SQLite :class:`Registry` (rows bulk
inserted into a fresh file, which its migrations then index and count) and
:class:`RedisSessions` (the layout of ``server/kv/registry/lua.py`` written in pipelines, in
db 12 under a namespace of its own, deleted at exit). Each operation then runs repeatedly on
it (at least 5 times and 0.3 s); its median is printed per N, with k, the slope of a
least-squares fit of log(time) against log(N) (time ~ N^k: 0 is flat, 1 linear).

``OPERATIONS`` lists (name, where it runs, setup): ``setup(N)`` returns a zero-argument callable
to time (``benchmarks/session_scale.py`` imports it). Built registries are cached per
(backend, N) until :func:`close_all` (run at exit).

Notes on what is timed: "purge one batch" deletes one bounded batch (the default limit of
each backend) of the N/2 expired sessions and then puts the purged sessions back, so N stays
N however often it runs (both halves are O(batch); the pure purge is about half the figure).
"snapshot first chunk" reads the first 1,000-session chunk of the streamed policy snapshot.
``--compat`` adds the OFFSET listing of the last page, which grows with N by design.

    python benchmarks/scale_registry.py [--sizes 1e3 1e4 1e5 1e6] [--only sqlite|redis]
        [--ops SUBSTRING ...] [--compat]
"""

from __future__ import annotations

import argparse
import atexit
import math
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.kv.registry.page import session_cursor  # noqa: E402
from server.kv.registry.sql import SCHEMA  # noqa: E402
from server.kv.registry.sqlite import Registry  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/12"
TENANT = "t"
SHARED = "0" * 16
"""The block every session starts with (a tenant's system prompt)."""
PAGE = 100
CHUNK = 1_000
POOL_TTL, LIVE_TTL = 3_600.0, 1e7
"""Odd sessions expire within the hour (the purge's pool), even ones much later."""

Setup = Callable[[int], Callable[[], object]]


def sid(i: int) -> str:
    return f"s{i:08d}"


def keys(i: int) -> list[str]:
    return [SHARED, *(f"{i:014x}{j:02x}" for j in range(1, 4))]


def ttl(i: int) -> float:
    return POOL_TTL if i % 2 else LIVE_TTL


class Store:
    """A registry of ``n`` synthetic sessions, last used 1 ms apart (session n-1 newest)."""

    kind = ""

    def __init__(self, n: int) -> None:
        self.n = n
        self.t0 = time.time() - 10.0
        self.purged = 0  # the pool's oldest odd sessions the purge op deleted so far
        self.reg: Any = None

    def last_used(self, i: int) -> float:
        return self.t0 - (self.n - i) * 1e-3

    def rows(self, ids: range) -> list[tuple]:
        return [
            (TENANT, sid(i), 8, 1, self.last_used(i), self.last_used(i), 0, ttl(i), 0, 0.0, 0)
            for i in ids
        ]

    def restore(self) -> None:
        """Put back the sessions the purge op deleted (odd ids, oldest first)."""
        if self.purged:
            self.insert(range(1, 2 * self.purged, 2))
            self.purged = 0

    def insert(self, ids: range) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SQLiteStore(Store):
    kind = "sqlite"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.dir = Path(tempfile.mkdtemp(prefix="lgkv-scale-"))
        path = self.dir / "sessions.sqlite3"
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)  # a file as older versions wrote it, filled in bulk...
        self._fill(db, range(n))
        db.close()
        self.reg = Registry(path)  # ...which its migrations then index and count

    def _fill(self, db: sqlite3.Connection, ids: range) -> None:
        for lo in range(0, len(ids), 50_000):
            part = ids[lo : lo + 50_000]
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO sessions (tenant, id, num_tokens, turns, created_at, "
                "last_used_at, pinned, ttl_seconds, gap_count, gap_mean, managed) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                self.rows(part),
            )
            db.executemany(
                "INSERT INTO session_blocks (tenant, session_id, idx, key) VALUES (?, ?, ?, ?)",
                [(TENANT, sid(i), j, k) for i in part for j, k in enumerate(keys(i))],
            )
            db.execute("COMMIT")

    def insert(self, ids: range) -> None:
        with self.reg._lock:
            self._fill(self.reg._db, ids)

    def close(self) -> None:
        self.reg.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisStore(Store):
    kind = "redis"

    def __init__(self, n: int) -> None:
        from server.kv.registry.redis import RedisSessions

        super().__init__(n)
        self.reg = RedisSessions(REDIS_URL, f"scale-bench-{uuid.uuid4().hex[:12]}", timeout_s=60)
        self.insert(range(n))

    def insert(self, ids: range) -> None:
        p, client = self.reg.prefix, self.reg._client
        for lo in range(0, len(ids), 5_000):
            pipe = client.pipeline(transaction=False)
            for row in self.rows(ids[lo : lo + 5_000]):
                tenant, s, tokens, turns, created, last, _, t, _, _, _ = row
                m = f"{tenant}\x1f{s}"
                pipe.hset(p + "s:" + m, mapping={
                    "num_tokens": tokens, "turns": turns, "created_at": repr(created),
                    "last_used_at": repr(last), "pinned": 0, "ttl": repr(t), "gap_count": 0,
                    "gap_mean": 0, "managed": 0,
                })  # fmt: skip
                block_keys = keys(int(s[1:]))
                pipe.rpush(p + "b:" + m, *block_keys)
                pipe.zadd(p + "t:" + tenant, {s: last})
                pipe.sadd(p + "all", m)
                pipe.zadd(p + "exp", {m: last + t})
                for k in block_keys:
                    pipe.hincrby(p + "refs", k, 1)
            pipe.execute()

    def close(self) -> None:
        names = self.reg._client.scan_iter(match=self.reg.prefix + "*", count=10_000)
        batch: list[str] = []
        for name in names:
            batch.append(name)
            if len(batch) == 5_000:
                self.reg._client.unlink(*batch)
                batch.clear()
        if batch:
            self.reg._client.unlink(*batch)
        self.reg.close()


_STORES: dict[tuple[str, int], Store] = {}


def store(kind: str, n: int) -> Store:
    """The registry of ``n`` sessions of ``kind``, built once (purged sessions restored)."""
    got = _STORES.get((kind, n))
    if got is None:
        t = time.perf_counter()
        got = _STORES[(kind, n)] = (SQLiteStore if kind == "sqlite" else RedisStore)(n)
        print(f"  built {kind} N={n:,} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    got.restore()
    return got


@atexit.register
def close_all() -> None:
    """Close and delete every built registry (files and Redis keys)."""
    while _STORES:
        _, s = _STORES.popitem()
        s.close()


def _cycle(n: int, count: int = 64) -> list[int]:
    """Even (never purged) ids spread over the newer half, for the per-request ops."""
    step = max(2, (n // 2) // count // 2 * 2)
    return [i for i in range(n - 2 - (n - 2) % 2, n // 2, -step)][:count] or [0]


def _rotating(fn: Callable[[int], object], ids: list[int]) -> Callable[[], object]:
    at = [0]

    def run() -> object:
        at[0] = (at[0] + 1) % len(ids)
        return fn(ids[at[0]])

    return run


def _get(s: Store) -> Callable[[], object]:
    return _rotating(lambda i: s.reg.get_session(TENANT, sid(i)), _cycle(s.n))


def _turn(s: Store) -> Callable[[], object]:
    def turn(i: int) -> None:
        s.reg.record_turn(TENANT, sid(i), keys(i), 8, default_ttl_s=None)

    return _rotating(turn, _cycle(s.n))


def _first_page(s: Store) -> Callable[[], object]:
    return lambda: s.reg.list_sessions(TENANT, PAGE)


def _last_page(s: Store) -> Callable[[], object]:
    # The page of the oldest sessions: after the row just newer than them.
    after = session_cursor(s.reg.get_session(TENANT, sid(min(PAGE, s.n - 1))))
    return lambda: s.reg.list_sessions(TENANT, PAGE, after=after)


def _last_page_offset(s: Store) -> Callable[[], object]:
    return lambda: s.reg.list_sessions(TENANT, PAGE, max(0, s.n - PAGE))


def _count(s: Store) -> Callable[[], object]:
    return lambda: (s.reg.count_sessions(), s.reg.count_sessions(TENANT))


def _create_delete(s: Store) -> Callable[[], object]:
    def run() -> object:
        s.reg.create_session(TENANT, "bench-new", ttl_seconds=None, pinned=False)
        return s.reg.delete_session(TENANT, "bench-new")

    return run


def _purge_nothing(s: Store) -> Callable[[], object]:
    return lambda: s.reg.purge_expired(now=s.t0 + 1)  # the pool expires an hour later


def _purge_batch(s: Store) -> Callable[[], object]:
    """One bounded purge batch, then the purged sessions put back (so N stays N however
    often it runs; the figure is both, each O(batch))."""

    def run() -> object:
        count = s.reg.count_sessions()
        freed, _more = s.reg.purge_expired_batch(s.t0 + 2 * POOL_TTL)
        s.purged += count - s.reg.count_sessions()
        s.restore()
        return freed

    return run


def _poll(s: Store) -> Callable[[], object]:
    """The engine's incremental poll after one session changed: version, drops, changes and
    the changed session's row and blocks."""
    seq, drop_seq = s.reg.change_seq(), s.reg.last_drop_seq()
    i = _cycle(s.n)[0]
    s.reg.record_turn(TENANT, sid(i), keys(i), 8, default_ttl_s=None)

    def run() -> object:
        s.reg.data_version()
        s.reg.drops_after(drop_seq)
        _, changed = s.reg.changes_after(seq)
        return [s.reg.session_state(t, x) for t, x in changed or []]

    return run


def _snapshot_chunk(s: Store) -> Callable[[], object]:
    return lambda: next(iter(s.reg.iter_policy_snapshot(chunk=CHUNK)))


_OPS: list[tuple[str, str, Callable[[Store], Callable[[], object]]]] = [
    ("get_session", "per request (API, engine)", _get),
    ("record_turn", "per request (engine)", _turn),
    ("list first page", "session API", _first_page),
    ("list last page", "session API (cursor)", _last_page),
    ("count_sessions", "metrics, quotas", _count),
    ("create+delete", "session API", _create_delete),
    ("purge nothing expired", "engine, every 10 s", _purge_nothing),
    ("purge one batch (+ re-insert)", "engine, N/2 expired", _purge_batch),
    ("engine poll", "engine, every 50 ms", _poll),
    ("snapshot first chunk", "engine start, reload", _snapshot_chunk),
]
_COMPAT = [("list last page (offset)", "session API (compat)", _last_page_offset)]


def _operations(table: list[tuple[str, str, Callable[[Store], Callable[[], object]]]]) -> list:
    def setup(kind: str, make: Callable[[Store], Callable[[], object]]) -> Setup:
        return lambda n: make(store(kind, n))

    return [
        (f"{kind} {name}", where, setup(kind, make))
        for kind in ("sqlite", "redis")
        for name, where, make in table
    ]


OPERATIONS: list[tuple[str, str, Setup]] = _operations(_OPS)
COMPAT_OPERATIONS: list[tuple[str, str, Setup]] = _operations(_COMPAT)


def median_time(fn: Callable[[], object], *, min_reps: int = 5, min_s: float = 0.3) -> float:
    """Median wall time of ``fn`` over at least ``min_reps`` runs and ``min_s`` (at most 200
    runs), after one warm-up run."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 200 and (len(times) < min_reps or time.perf_counter() - start < min_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def growth(sizes: list[int], times: list[float]) -> float:
    """k of time ~ N^k (least squares in log-log)."""
    xs, ys = [math.log(n) for n in sizes], [math.log(max(t, 1e-9)) for t in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _fmt(t: float) -> str:
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["1e3", "1e4", "1e5", "1e6"])
    ap.add_argument("--only", choices=["sqlite", "redis"])
    ap.add_argument("--ops", nargs="*", default=[], help="only operations naming one of these")
    ap.add_argument("--compat", action="store_true", help="also the OFFSET listing")
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes]
    ops = OPERATIONS + (COMPAT_OPERATIONS if args.compat else [])
    ops = [o for o in ops if not args.only or o[0].startswith(args.only + " ")]
    ops = [o for o in ops if not args.ops or any(w in o[0] for w in args.ops)]
    results: dict[str, list[float]] = {name: [] for name, _, _ in ops}
    for n in sizes:
        for name, _, setup in ops:
            results[name].append(median_time(setup(n)))
            print(f"  N={n:,} {name}: {_fmt(results[name][-1])}", file=sys.stderr)
        for key in [k for k in _STORES if k[1] == n]:  # this N is done: free it
            _STORES.pop(key).close()
    head = f"{'operation':38} {'where':28}" + "".join(f"{f'N={n:.0e}':>11}" for n in sizes)
    print(head + f"{'k':>7}")
    for name, where, _ in ops:
        cells = "".join(f"{_fmt(t):>11}" for t in results[name])
        print(f"{name:38} {where:28}{cells}{growth(sizes, results[name]):>7.2f}")


if __name__ == "__main__":
    main()
