"""End to end at scale: the real server with a disk tier of 10^5 block files against 10^3.

Issue 26's proof on the real server (``python -m server``, the tiny random-weight Llama the
tests build): two cache folders are filled the way a server leaves them, one with the small
count of block files and one with the large (the disk tier's layout: its manifest, written
by a first short run of the server, and files of that size in its fan-out folders) and a
registry that lists them (N/4 sessions of 4 blocks, recorded through the registry's own
``record_turn``: the SQLite file, or with ``--kv-redis-url`` sessions in Redis). Then a
server starts on each, with the same flags, one after the other; the figures:

- start: from launching the server to its first answer, and to the log line saying every
  block file is indexed (the scan and the index build run while it serves);
- TTFT of new turns: C conversations x T turns sent round-robin, one request at a time,
  alternating between the two servers (same machine load for both); p50 of each server's
  turns after the first (they resume a session) and of all turns; the ratio large/small
  (goal <= 1.1);
- the scheduler's steps: vLLM's ``Scheduler.schedule`` plus ``update_from_output`` of each
  step, timed inside the engine process by a ``sitecustomize`` hook this script installs in
  the servers' environment (``LGKV_STEP_LOG_DIR``): the longest and p99 while the turns ran
  (goal: none over 50 ms), the most CPU time the scheduler thread spent in one step (its
  work; the rest of a step is time it waited for a core or the GIL), and the longest while the
  files were coming in. ``--why-slow 0.05`` also writes every thread's stack when a step runs
  past 50 ms and each garbage collection over 10 ms, to the kept work folder.

Then the same with sessions in Redis (``--kv-redis-url``, database 5; ``--no-redis`` skips).

    python benchmarks/scale_e2e.py                 # 10^3 vs 10^5 files, SQLite then Redis
    python benchmarks/scale_e2e.py --quick         # a smoke run: 100 vs 3,000 files, SQLite
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from scale_start import block_keys, sparse_files  # noqa: E402

from benchmarks.step_hook import PROBE, STEP_HOOK  # noqa: E402
from examples.managed import free_port  # noqa: E402
from examples.server_process import ServerProcess, ServerStartError  # noqa: E402
from server.kv.registry.sqlite import Registry  # noqa: E402
from server.kv.tiers.disk import MANIFEST_FILE, rank_file_bytes  # noqa: E402
from server.kv.tiers.manifest import Manifest  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/5"
MARGIN_FILES = 5_000
"""Disk budget room beyond the large count, for the blocks the runs save."""
INDEXED = "block files indexed in"
"""The log line of a server whose start-up files are all indexed."""


@dataclass
class Server:
    """One server of a comparison and its measurements."""

    name: str
    files: int
    proc: ServerProcess
    steps_dir: Path
    started: float = 0.0
    serving_s: float = 0.0
    connector_s: float = 0.0
    indexed_s: float = 0.0
    indexed_at: float = 0.0
    ttft: dict[int, list[float]] = field(default_factory=dict)
    cached: int = 0
    prompt: int = 0


def tiny_model() -> Path:
    """The tests' tiny random-weight Llama (built once, as ``tests/conftest.py`` builds it)."""
    from server.model import build_default_model, build_tiny_model, default_cache_dir

    return build_tiny_model(
        default_cache_dir() / "models" / "tiny-llama-h32", tokenizer_from=build_default_model()
    )


def engine_flags(disk_bytes: int) -> list[str]:
    """The engine flags of every server here (the test suite's, with a small resident KV
    cache so conversations push each other out of vLLM's own cache)."""
    return [
        "--kv-cache-memory-bytes", "8MiB", "--max-model-len", "4096", "--max-num-seqs", "8",
        "--enforce-eager", "--distributed-executor-backend", "uni", "--kv-ram-bytes", "256MiB",
        "--kv-disk-bytes", str(disk_bytes),
    ]  # fmt: skip


def words(rng: random.Random, count: int) -> str:
    """Filler text (letters the tokenizer splits into a few tokens per word)."""
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(count)
    )


def chat(server: ServerProcess, model: str, session: str, messages: list[dict]) -> tuple:
    """One streamed turn: (TTFT s, prompt tokens, cached tokens, answer)."""
    body = {
        "model": model, "messages": messages, "max_tokens": 8, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "prompt_cache_key": session,
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, "", {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{session}: HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta and not ttft:
                    ttft = time.perf_counter() - t0
                text += delta or ""
            usage = chunk.get("usage") or usage
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return ttft or time.perf_counter() - t0, usage.get("prompt_tokens", 0), cached, text


def launch(proc: ServerProcess, tries: int = 3) -> None:
    """Start the server; on a start that failed (a port taken meanwhile), again on another."""
    for attempt in range(tries):
        try:
            proc.start()
            return
        except ServerStartError:
            if attempt == tries - 1:
                raise
            proc.port = free_port()


def layout(work: Path, model: Path, flags: list[str]) -> Path:
    """The disk tier's manifest for these flags: a short run of the server writes one."""
    proc = ServerProcess(work / "layout", flags, model=model, log_dir=work, log_name="layout.log")
    launch(proc)
    with proc:
        rng = random.Random(0)
        chat(proc, proc.model_name, "layout", [{"role": "user", "content": words(rng, 400)}])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = list((work / "layout" / "blocks").glob(f"*/{MANIFEST_FILE}"))
            if found and any(found[0].parent.rglob("*.kvb")):
                return found[0]
            time.sleep(0.2)
    raise RuntimeError(f"the server wrote no block file; see {work / 'layout.log'}")


def prefill(cache: Path, manifest: Path, n: int) -> list[str]:
    """N block files of the layout in ``cache`` and an empty registry file; the keys."""
    folder = cache / "blocks" / manifest.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(manifest, folder / MANIFEST_FILE)
    size = rank_file_bytes(Manifest(**json.loads(manifest.read_text())))
    keys = block_keys(n)
    t = time.perf_counter()
    sparse_files(folder, keys, size)
    Registry(cache / "sessions.sqlite3").close()
    print(f"  {n:,} block files in {cache} made in {time.perf_counter() - t:.1f} s", flush=True)
    return keys


def record_sessions(cache: Path, keys: list[str], redis_ns: str | None) -> None:
    """N/4 sessions of 4 of ``keys`` through the registry's own ``record_turn``."""
    if redis_ns is None:
        reg = Registry(cache / "sessions.sqlite3")
    else:
        from server.kv.registry.redis import RedisSessions

        reg = RedisSessions(REDIS_URL, redis_ns, timeout_s=30)
    now = time.time()
    for i in range(len(keys) // 4):
        reg.record_turn("default", f"prefill-{i}", keys[4 * i : 4 * i + 4], 512,
                        default_ttl_s=None, now=now - 3600 + i * 1e-3)  # fmt: skip
    reg.close()


def start(s: Server) -> None:
    """Launch, time the first answer and, in the background log, the files indexed."""
    s.started = time.perf_counter()
    launch(s.proc)
    rng = random.Random(1)
    chat(s.proc, s.proc.model_name, "probe", [{"role": "user", "content": words(rng, 20)}])
    s.serving_s = time.perf_counter() - s.started
    built = next(x for x in s.proc.log_path.read_text(errors="replace").splitlines()
                 if "SessionKVConnector: " in x and "RAM slots" in x)  # fmt: skip
    stamp = time.strptime(f"{time.gmtime().tm_year} {built.split(' [')[0][-14:]}",
                          "%Y %m-%d %H:%M:%S")  # fmt: skip
    s.connector_s = time.time() - time.mktime(stamp)  # the log's local time
    print(f"  {s.name}: serving {s.serving_s:.1f} s after launch, "
          f"{s.connector_s:.0f} s after the connector was built", flush=True)  # fmt: skip


def wait_indexed(s: Server, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while INDEXED not in s.proc.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{s.name}: start-up files not indexed in {timeout_s:.0f} s")
        time.sleep(0.2)
    line = next(x for x in s.proc.log_path.read_text(errors="replace").splitlines() if INDEXED in x)
    s.indexed_s = float(line.split(INDEXED)[1].split()[0])  # from the engine's start
    s.indexed_at = time.time()
    print(f"  {s.name}: every block file indexed {s.indexed_s:.1f} s after the engine started")


def steps(s: Server, since: float, until: float, *, cpu: bool = False) -> list[float]:
    """Durations of the engine's scheduler steps (schedule + update_from_output) in a window:
    wall clock, or with ``cpu`` the scheduler thread's CPU time (its own work, without the
    time it waited for a core or the GIL)."""
    out: list[float] = []
    col = 3 if cpu else 2
    for path in s.steps_dir.glob("*.txt"):
        pending: tuple[float, float] | None = None
        for line in path.read_text().splitlines():
            fields = line.split()
            t, tag, took = float(fields[0]), fields[1], float(fields[col])
            if tag == "s":
                pending = (t, took)
            elif pending is not None:
                if since <= pending[0] <= until:
                    out.append(pending[1] + took)
                pending = None
    return out


def converse(servers: list[Server], conversations: int, turns: int, seed: int) -> None:
    """Round-robin turns, one request at a time, alternating between the servers."""
    models = {s.name: s.proc.model_name for s in servers}
    history: dict[tuple[str, int], list[dict]] = {}
    for turn in range(turns):
        for c in range(conversations):
            order = servers if (turn + c) % 2 == 0 else servers[::-1]
            for s in order:
                rng = random.Random(f"{seed}-{c}-{turn}")  # the same text for both servers
                msgs = history.setdefault((s.name, c), [])
                msgs.append({"role": "user", "content": words(rng, 100)})
                ttft, prompt, cached, text = chat(s.proc, models[s.name], f"c{seed}-{c}", msgs)
                msgs.append({"role": "assistant", "content": text})
                s.ttft.setdefault(turn, []).append(ttft)
                s.prompt += prompt
                s.cached += cached


def compare(work: Path, label: str, sizes: list[int], model: Path, manifest: Path, *,
            redis: bool, conversations: int, turns: int, seed: int) -> list[str]:  # fmt: skip
    """Start a server per size on its pre-filled folder, run the turns, print the figures."""
    size = rank_file_bytes(Manifest(**json.loads(manifest.read_text())))
    flags = engine_flags((max(sizes) + MARGIN_FILES) * size)
    spaces: list[str] = []
    servers: list[Server] = []
    try:
        for n in sizes:
            ns = f"scale-e2e-{uuid.uuid4().hex[:10]}" if redis else None  # one per server
            extra = ["--kv-redis-url", REDIS_URL, "--kv-redis-namespace", str(ns)] if ns else []
            spaces += [ns] if ns else []
            cache = work / f"cache-{n}"
            keys = block_keys(n) if cache.exists() else prefill(cache, manifest, n)
            record_sessions(cache, keys, ns)
            steps_dir = work / f"steps-{label}-{n}"
            steps_dir.mkdir()
            env = {"LGKV_STEP_LOG_DIR": str(steps_dir),
                   "PYTHONPATH": os.pathsep.join([str(work / "hook"), str(ROOT)])}  # fmt: skip
            proc = ServerProcess(cache, flags + extra, model=model, log_dir=work,
                                 log_name=f"server-{label}-{n}.log", env=env)  # fmt: skip
            s = Server(f"{n:.0e} files", n, proc, steps_dir)
            servers.append(s)
            start(s)
            wait_indexed(s)
        t0 = time.time()
        converse(servers, conversations, turns, seed)
        t1 = time.time()
        lines = report(label, servers, t0, t1)
        note = machine_stalls(work, servers, t0, t1)
        if note:
            print(note, flush=True)
        return [*lines, note] if note else lines
    finally:
        for s in servers:
            s.proc.stop()
        for ns in spaces:
            _clear_redis(ns)


def report(label: str, servers: list[Server], t0: float, t1: float) -> list[str]:
    lines = [
        f"### {label}",
        "",
        "| block files | launch to serving | connector built to serving (+-1 s) "
        "| engine start to every file indexed | TTFT p50 resumed "
        "turns | TTFT p50 all turns | cached share | steps | p99 step | longest step "
        "| most CPU time in a step | longest step while indexing |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    p50: dict[str, float] = {}
    for s in servers:
        resumed = [t for turn, ts in s.ttft.items() if turn > 0 for t in ts]
        every = [t for ts in s.ttft.values() for t in ts]
        p50[s.name] = statistics.median(resumed)
        run = sorted(steps(s, t0, t1))
        warm = steps(s, 0.0, s.indexed_at)
        cpu = max(steps(s, t0, t1, cpu=True), default=0.0)
        p99 = run[int(0.99 * (len(run) - 1))] if run else 0.0
        lines.append(
            f"| {s.files:,} | {s.serving_s:.1f} s | {s.connector_s:.0f} s | {s.indexed_s:.1f} s | "
            f"{p50[s.name] * 1e3:.1f} ms | {statistics.median(every) * 1e3:.1f} ms | "
            f"{s.cached / max(1, s.prompt):.0%} | {len(run)} | {p99 * 1e3:.1f} ms | "
            f"{(run[-1] if run else 0) * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | "
            f"{max(warm, default=0) * 1e3:.1f} ms |"
        )
    small, large = servers[0], servers[-1]
    lines += ["", f"TTFT p50 of resumed turns, {large.files:,} / {small.files:,} files: "
              f"{p50[large.name] / p50[small.name]:.2f} (goal <= 1.1)", ""]  # fmt: skip
    print("\n".join(lines), flush=True)
    return lines


def machine_stalls(work: Path, servers: list[Server], t0: float, t1: float) -> str:
    """With ``--why-slow``: how many steps over 50 ms overlapped a wake-up of the probe process
    (:data:`PROBE`) that came more than 20 ms late, i.e. a moment the machine itself stalled."""
    path = work / "probe.log"
    if not path.exists():
        return ""
    stalls = [tuple(map(float, line.split())) for line in path.read_text().splitlines()]
    long_steps = 0
    shared = 0
    for s in servers:
        for f in s.steps_dir.glob("[0-9]*.txt"):
            for line in f.read_text().splitlines():
                end, _tag, took = line.split()[:3]
                start, stop = float(end) - float(took), float(end)
                if float(took) > 0.05 and t0 <= start <= t1:
                    long_steps += 1
                    shared += any(e - late <= stop and e >= start for e, late in stalls)
    return (
        f"Steps (schedule or update) over 50 ms: {long_steps}, of which {shared} overlapped a "
        f"moment another process, sleeping 2 ms at a time, woke more than 20 ms late."
    )


def _clear_redis(ns: str) -> None:
    """Delete what the runs put in database 5: the namespace's sessions and block values."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for pattern in (f"lgkv:reg:{{{ns}}}:*", "lgkv:[0-9a-f]*:*"):
        batch = list(client.scan_iter(match=pattern, count=5_000))
        for lo in range(0, len(batch), 5_000):
            client.unlink(*batch[lo : lo + 5_000])
    client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs=2, type=float, default=[1e3, 1e5], metavar=("SMALL", "LARGE"))
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="100 vs 3,000 files, 3 x 3 turns, SQLite")
    p.add_argument("--no-redis", action="store_true", help="skip the run with sessions in Redis")
    p.add_argument("--only-redis", action="store_true", help="skip the run with SQLite")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, files)")
    p.add_argument("--why-slow", type=float, default=0.0, metavar="SECONDS",
                   help="write every thread's stack when a scheduler step runs past SECONDS, "
                   "and each garbage collection over 10 ms (steps-*/why-*.log, gc-*.log; "
                   "implies --keep)")  # fmt: skip
    args = p.parse_args()
    if args.why_slow:
        os.environ["LGKV_STEP_WHY_S"] = str(args.why_slow)
        args.keep = True
    sizes = [int(s) for s in args.sizes]
    if args.quick:
        sizes, args.conversations, args.turns, args.no_redis = [100, 3000], 3, 3, True
    work = Path(tempfile.mkdtemp(prefix="lgkv-scale-e2e-"))
    (work / "hook").mkdir()
    (work / "hook" / "sitecustomize.py").write_text(STEP_HOOK)
    print(f"work folder: {work}", flush=True)
    t = time.perf_counter()
    probe = None
    if args.why_slow:
        import subprocess

        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(work / "probe.log")])
    try:
        model = tiny_model()
        manifest = layout(work, model, engine_flags(1 << 30))
        out: list[str] = []
        if not args.only_redis:
            out += compare(work, "sessions in SQLite", sizes, model, manifest, redis=False,
                           conversations=args.conversations, turns=args.turns, seed=1)  # fmt: skip
        if not args.no_redis:
            out += compare(work, "sessions in Redis (--kv-redis-url)", sizes, model, manifest,
                           redis=True, conversations=args.conversations, turns=args.turns,
                           seed=2)  # fmt: skip
        print(f"\n(run took {time.perf_counter() - t:.0f} s)\n")
        print("\n".join(out))
    finally:
        if probe is not None:
            probe.kill()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
