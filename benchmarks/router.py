"""Threads through ``vllm-router`` across two replicas sharing Redis; one replica killed mid-run.

T threads (half hashed to replica-a, half to replica-b: their session ids are picked by asking
the router where each candidate goes) run N turns each, all threads of a turn at once, greedy,
every answer a fixed length (``ignore_eos``). During turn ``--kill-turn`` replica-a is killed
(``kill -9`` of its process group) as soon as it has requests running. The same threads then run
on a cache-off server (``--no-kv-offload --no-enable-prefix-caching``) and every answer is
compared. Printed: each thread's replica and cached tokens per turn; whether every thread stayed
on one replica before the kill and every replica-a thread moved to replica-b after it; the
cached share of the moved threads' first turn on replica-b and replica-b's Redis block hits;
requests in flight at the kill, the router's retries, the failed attempts the client saw and
its errors; answers that differ from the cache-off run.

    python benchmarks/router.py                       # 8 threads x 4 turns, SmolLM2
    python benchmarks/router.py --model tiny --threads 4 --turns 3

The suite runs a short version (tests/integration/cluster/test_router.py). The threads and
what they record are in ``benchmarks/router_run.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.router_run import Run, run_threads  # noqa: E402
from examples.cluster import REPLICA_FLAGS, Cluster, ensure_redis  # noqa: E402
from examples.router_process import RouterProcess  # noqa: E402
from examples.server_process import ServerProcess  # noqa: E402
from langgraph_kvcache.contract import REPLICA_HEADER, SESSION_HEADER  # noqa: E402

KILL_TURN_TOKENS = 256
"""Answer length of the kill turn: its requests decode long enough (ignore_eos) that the hook
sees one running on the victim and kills it mid-answer; with the short answers of the other
turns a request could start and end between two looks at the replica's metrics."""


def running_requests(server_url: str, timeout_s: float = 2.0) -> float:
    """``vllm:num_requests_running`` of a server (0 when it does not answer in ``timeout_s``)."""
    try:
        text = httpx.get(server_url + "/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return 0.0
    found = re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+(\S+)$", text, re.M)
    return sum(float(v) for v in found)


def redis_hit_blocks(server_url: str) -> float:
    """The server's ``lgkv_hit_blocks_total{tier="redis"}``."""
    text = httpx.get(server_url + "/metrics", timeout=10).text
    found = re.findall(r'^lgkv_hit_blocks_total\{[^}]*tier="redis"[^}]*\}\s+(\S+)$', text, re.M)
    return sum(float(v) for v in found)


GRACE_S = 0.3
"""How long a victim request must have been out before the kill hook takes it as running
without seeing it in the replica's metrics (the router forwards in milliseconds)."""


def _turn_answered(run: Run, turn: int, name: str) -> bool:
    """Whether every thread of replica ``name`` has sent turn ``turn`` and got its answer."""
    mine = [t for (t, n) in run.calls if n == 0 and run.replicas(t)[0] == name]
    return all((t, turn) in run.calls and run.calls[(t, turn)].ended for t in mine)


def kill_when_busy(
    url: str, kill: Callable[[], None], name: str, at_turn: int, router: RouterProcess
) -> Callable[[int, Run], None]:
    """A ``before_turn`` hook: at ``at_turn``, call ``kill`` (a kill -9 of the replica at
    ``url``, named ``name``) once that replica runs a request and a request of its threads
    has not come back to the client, and time how long ``router`` takes to list it as
    unhealthy (on a side thread)."""

    def watch(run: Run) -> None:
        assert run.killed_at is not None
        router.wait_worker_health(url, healthy=False, timeout_s=120)
        run.marked_down_s = time.monotonic() - run.killed_at

    def hook(turn: int, run: Run) -> None:
        if turn != at_turn:
            return

        def out_since() -> float | None:  # when the oldest unanswered victim request was sent
            calls = list(run.calls.values())
            mine = [c for c in calls if c.turn == turn and run.replicas(c.thread)[0] == name]
            starts = [c.started for c in mine if not c.ended]
            return min(starts) if starts else None

        # Kill once the victim's metrics show a request running while one of its threads waits
        # for an answer. The metrics are a hint, not a condition: under load /metrics can answer
        # slower than a request decodes, so a request out for GRACE_S counts as running too.
        # The check and the kill hold ``run.ends``: a call seen unanswered is in flight at the
        # kill. If every victim request of the turn comes back first, the kill waits no more.
        while True:
            since = out_since()
            if since is None and _turn_answered(run, turn, name):
                run.killed_at, run.killed = time.monotonic(), name  # missed: kill between turns
                kill()
                break
            busy = since is not None and (
                time.monotonic() - since > GRACE_S or running_requests(url, timeout_s=0.5) >= 1
            )
            with run.ends:
                if busy and out_since() is not None:
                    run.killed_at, run.killed = time.monotonic(), name
                    kill()
                    break
            time.sleep(0.01)
        threading.Thread(target=watch, args=(run,), daemon=True).start()

    return hook


def pick_sessions(
    router_url: str, model: str, per_replica: dict[str, int], prefix: str
) -> list[str]:
    """Session ids, ``per_replica[name]`` of them hashed to each replica: each candidate is
    sent once through the router without a session (one token, nothing recorded) and the
    ``X-LGKV-Replica`` header says where its ``X-Session-ID`` went. Interleaved a, b, a, b..."""
    wanted = dict(per_replica)
    chosen: dict[str, list[str]] = {name: [] for name in wanted}
    with httpx.Client(base_url=router_url, timeout=120) as http:
        for i in range(200):
            if not any(wanted.values()):
                break
            candidate = f"{prefix}-{i}"
            r = http.post(
                "/v1/chat/completions",
                headers={SESSION_HEADER: candidate},
                json={
                    "model": model,
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            r.raise_for_status()
            name = r.headers[REPLICA_HEADER]
            if wanted.get(name, 0) > 0:
                wanted[name] -= 1
                chosen[name].append(candidate)
    if any(wanted.values()):
        raise RuntimeError(f"the router sent too few of 200 candidates to {wanted}")
    columns = list(chosen.values())
    return [s for row in zip(*columns, strict=False) for s in row] + [
        s for col in columns for s in col[len(min(columns, key=len)) :]
    ]


# ----------------------------------------------------------------------------- the report
def differing(ours: Run, reference: Run) -> list[tuple[str, int]]:
    """(thread, turn) whose answer differs from the reference's (or is missing)."""
    return [
        key
        for key, call in reference.calls.items()
        if key not in ours.calls or ours.calls[key].answer != call.answer
    ]


def report(run: Run, reference: Run, *, victim: str, kill_turn: int, redis_hits: float,
           router_retries: float) -> list[str]:  # fmt: skip
    """The printed figures, one string per line."""
    threads = sorted({t for t, _ in run.calls}, key=lambda t: list(run.calls).index((t, 0)))
    lines = ["thread | replica per turn | cached / prompt tokens per turn"]
    for t in threads:
        calls = [c for (tt, _), c in sorted(run.calls.items()) if tt == t]
        reps = " ".join(c.replica.removeprefix("replica-") if not c.error else "ERR" for c in calls)
        toks = "  ".join(f"{c.cached_tokens}/{c.prompt_tokens}" for c in calls)
        lines.append(f"{t} | {reps} | {toks}")
    before = [t for t in threads if len(set(run.replicas(t)[:kill_turn])) == 1]
    on_victim = [t for t in threads if run.replicas(t)[0] == victim]
    moved = [t for t in on_victim if set(run.replicas(t)[kill_turn:]) - {victim}]
    first_moved = [run.calls[(t, kill_turn)] for t in on_victim if (t, kill_turn) in run.calls]
    prompt = sum(c.prompt_tokens for c in first_moved)
    cached = sum(c.cached_tokens for c in first_moved)
    in_flight = run.in_flight_at_kill(victim)
    errors = [c for c in run.calls.values() if c.error]
    wrong = differing(run, reference)
    lines += [
        f"threads on one replica before the kill: {len(before)}/{len(threads)}",
        f"{victim}'s threads moved after the kill: {len(moved)}/{len(on_victim)}",
        f"moved threads' first turn after the kill: {cached}/{prompt} prompt tokens cached "
        f"({cached / max(prompt, 1):.1%}); the surviving replica's Redis block hits: "
        f"{redis_hits:.0f}",
        f"in flight on {victim} at the kill: {len(in_flight)}; router retries: "
        f"{router_retries:.0f}; failed attempts seen by the client: "
        f"{len(run.failed_attempts())}; client errors: {len(errors)}",
        f"router marked {victim} down {run.marked_down_s:.1f} s after the kill"
        if run.marked_down_s is not None else "router did not mark a killed replica down",
        f"answers differing from the cache-off run: {len(wrong)}/{len(reference.calls)}",
    ]  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python benchmarks/router.py``: the full scenario with figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--kill-turn", type=int, default=3, help="1-based turn during which "
                   "replica-a is killed (0: never)")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kill-turn-tokens", type=int, default=KILL_TURN_TOKENS,
                   help="answer length in the kill turn: long enough that the kill finds "
                   "requests running on replica-a")  # fmt: skip
    p.add_argument("--model", default=None, help="model folder, or 'tiny' (default SmolLM2)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--ports", type=int, nargs=3, default=None,
                   help="replica-a, replica-b and the cache-off server's ports")  # fmt: skip
    p.add_argument("--router-port", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    args = p.parse_args(argv)
    model: str | None = args.model
    if model == "tiny":
        from server.model import build_tiny_model, default_cache_dir, default_model_dir

        model = str(build_tiny_model(default_cache_dir() / "models" / "tiny-llama-h32",
                                     tokenizer_from=default_model_dir()))  # fmt: skip
    flags = [*REPLICA_FLAGS, "--served-model-name", "bench-model"]
    run_id = uuid.uuid4().hex[:8]
    ports = args.ports or [None, None, None]
    plain = ServerProcess(None, [*flags, "--no-kv-offload", "--no-enable-prefix-caching"],
                          model=model, port=ports[2])  # fmt: skip
    with ensure_redis(args.redis_url), Cluster(
        args.redis_url, model=model, flags=flags, ports=ports[:2],
        router_port=args.router_port, metrics_port=args.metrics_port,
    ) as cluster:  # fmt: skip
        plain.start()
        try:
            half = args.threads // 2
            sessions = pick_sessions(cluster.url, "bench-model",
                                     {"replica-a": args.threads - half, "replica-b": half},
                                     f"bench-{run_id}")  # fmt: skip
            victim, survivor = cluster.replica("replica-a"), cluster.replica("replica-b")
            hits0, retries0 = (
                redis_hit_blocks(survivor.url),
                cluster.router.metric("vllm_router_retries_total"),
            )
            hook = (
                kill_when_busy(
                    victim.url, victim.kill, "replica-a", args.kill_turn - 1, cluster.router
                )
                if args.kill_turn
                else None
            )
            t0 = time.monotonic()
            long_turn = {args.kill_turn - 1: args.kill_turn_tokens} if args.kill_turn else {}
            run = run_threads(cluster.url, "bench-model", sessions, args.turns, run_id=run_id,
                              max_tokens=args.max_tokens, turn_tokens=long_turn,
                              before_turn=hook)  # fmt: skip
            wall = time.monotonic() - t0
            hits = redis_hit_blocks(survivor.url) - hits0
            retries = cluster.router.metric("vllm_router_retries_total") - retries0
            reference = run_threads(plain.url, "bench-model", sessions, args.turns,
                                    run_id=run_id, max_tokens=args.max_tokens,
                                    turn_tokens=long_turn)  # fmt: skip
        finally:
            plain.stop()
    print(f"\n{args.threads} threads x {args.turns} turns through vllm-router, kill -9 of "
          f"replica-a during turn {args.kill_turn}; {wall:.0f} s")  # fmt: skip
    for line in report(run, reference, victim="replica-a", kill_turn=max(args.kill_turn - 1, 0),
                       redis_hits=hits, router_retries=retries):  # fmt: skip
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
