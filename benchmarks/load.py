"""Load scenarios: many conversations at once, answers checked.

C conversations run T turns each, all at once, from K client threads (each conversation's turns
in order, with its real answers appended, greedy; TTFT from the first streamed token).

``--mode churn`` (default): meanwhile a churn thread calls the session API (copy, pin, prefetch,
unpin, delete of the copies) on the conversations in flight. The same conversations then run on
a cache-off server (``--no-kv-offload --no-enable-prefix-caching``, plain recompute) and every
answer is compared. Printed: requests, errors, 5xx, answers that differ, requests/s, cached
share of prompt tokens, TTFT p50/p95, session API calls and their errors, and whether anything
was still in flight at the end.

``--mode concurrent``: no session API calls; three servers in one invocation: vLLM with its
prefix cache at the resident budget (``--no-kv-offload``, prefix caching on), this server at the
same budget, and vLLM with a budget that holds every conversation (``--full``), whose answers
are the reference. Printed: requests, errors, requests/s, prompt tokens/s, cached share, TTFT
p50/p95 of the turns after the first, and how many greedy answers equal the reference's.

    python benchmarks/load.py                          # churn: 32 conversations x 5 turns
    python benchmarks/load.py --conversations 96 --clients 3
    python benchmarks/load.py --conversations 8 --turns 3 --model tiny   # quick
    python benchmarks/load.py --mode concurrent --conversations 16 --turns 6 --resident 384MiB

Every server gets the same model, dtype, flags and cores (``examples.server_process``'s
``equal_cores_env``: vLLM's automatic OpenMP binding and ``VLLM_CPU_NUM_OF_RESERVED_CPU`` from
``--reserved-cpus`` for all); each server's OMP core list is printed from its log. The suite runs
a short version against its shared server (tests/integration/server/test_server_load.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ("rivers", "volcanoes", "libraries", "trains", "bees", "glaciers", "chess", "bread")


@dataclass
class LoadResult:
    """What one load run measured."""

    answers: dict[tuple[int, int], str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    server_errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    api_calls: int = 0
    api_errors: list[str] = field(default_factory=list)
    in_flight_at_end: int = 0

    @property
    def requests(self) -> int:
        return len(self.answers) + len(self.errors)

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def first_message(conversation: int) -> str:
    """A conversation's opening, long enough to span KV blocks."""
    topic = TOPICS[conversation % len(TOPICS)]
    facts = " ".join(f"Note {i}: {topic} matter to conversation {conversation}." for i in range(40))
    return f"We are talking about {topic}. {facts} Tell me one thing about {topic}."


def _conversation(
    client: httpx.Client, model: str, c: int, turns: int, max_tokens: int, out: LoadResult,
    lock: threading.Lock, session_prefix: str, in_flight: list[int],
) -> None:  # fmt: skip
    messages = [{"role": "user", "content": first_message(c)}]
    for t in range(turns):
        body = {
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "session_id": f"{session_prefix}-{c}", "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        start = time.perf_counter()
        ttft, text, usage = None, [], None
        with lock:
            in_flight[0] += 1
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise _HTTPError(r.status_code, r.text[:200])
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = httpx.Response(200, content=line[6:]).json()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            ttft = ttft or time.perf_counter() - start
                            text.append(piece)
        except (httpx.HTTPError, _HTTPError) as exc:
            with lock:
                out.errors.append(f"conversation {c} turn {t + 1}: {exc!r}")
                out.server_errors += isinstance(exc, _HTTPError) and exc.status >= 500
            return
        finally:
            with lock:
                in_flight[0] -= 1
        answer = "".join(text)
        with lock:
            out.answers[(c, t)] = answer
            if ttft is not None and t > 0:
                out.ttft_s.append(ttft)
            if usage:
                out.prompt_tokens += int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens += int(details.get("cached_tokens") or 0)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Turn {t + 2}: and what else about it?"},
        ]


class _HTTPError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


def _churn(
    client: httpx.Client, conversations: int, prefix: str, stop: threading.Event,
    calls: int, out: LoadResult, lock: threading.Lock,
) -> None:  # fmt: skip
    """Session API calls on live conversations: copy, pin, prefetch, unpin, delete the copy.
    Runs all ``calls`` rounds (a fast load may end first); ``stop`` only cuts the pauses."""
    i = 0
    while i < calls:
        sid = f"{prefix}-{i % conversations}"
        copy = f"{sid}.fork{i}"
        for method, path, body in (
            ("POST", f"/v1/sessions/{sid}/copy", {"target_id": copy}),
            ("POST", f"/v1/sessions/{sid}/pin", None),
            ("POST", f"/v1/sessions/{sid}/prefetch", None),
            ("POST", f"/v1/sessions/{sid}/unpin", None),
            ("DELETE", f"/v1/sessions/{copy}", None),
        ):
            r = client.request(method, path, json=body)
            with lock:
                out.api_calls += 1
                # 404/409: the conversation has not started yet, or its copy is not there.
                if r.status_code >= 500 or r.status_code not in (200, 201, 404, 409):
                    out.api_errors.append(f"{method} {path}: {r.status_code} {r.text[:120]}")
        i += 1
        if not stop.is_set():
            time.sleep(0.05)


def run_load(
    base_url: str, model: str, *, conversations: int, turns: int, clients: int = 1,
    max_tokens: int = 16, api_calls: int = 0, session_prefix: str = "load",
    headers: dict[str, str] | None = None, timeout_s: float = 600.0,
) -> LoadResult:  # fmt: skip
    """Run the scenario against one server (see the module doc); never raises on HTTP errors."""
    out, lock, stop, in_flight = LoadResult(), threading.Lock(), threading.Event(), [0]
    per_client = -(-conversations // clients)
    http = [
        httpx.Client(base_url=base_url, headers=headers or {}, timeout=timeout_s)
        for _ in range(clients + 1)
    ]
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=conversations + 1) as pool:
            churn = None
            if api_calls:
                churn = pool.submit(
                    _churn, http[-1], conversations, session_prefix, stop, api_calls, out, lock
                )
            shared = (turns, max_tokens, out, lock, session_prefix, in_flight)
            jobs = [
                pool.submit(_conversation, http[c // per_client], model, c, *shared)
                for c in range(conversations)
            ]
            for job in jobs:
                job.result()
            stop.set()
            if churn is not None:
                churn.result()
        out.wall_s = time.perf_counter() - start
        out.in_flight_at_end = in_flight[0]
    finally:
        for client in http:
            client.close()
    return out


def differing(a: LoadResult, b: LoadResult) -> list[tuple[int, int]]:
    """Turns whose answers differ between two runs of the same conversations."""
    return sorted(k for k in a.answers if k in b.answers and a.answers[k] != b.answers[k])


def _ttft(r: LoadResult) -> str:
    p = sorted(r.ttft_s)
    p50 = statistics.median(p) if p else float("nan")
    p95 = p[min(len(p) - 1, int(0.95 * len(p)))] if p else float("nan")
    return f"{p50:.2f} / {p95:.2f} s"


def summary(name: str, r: LoadResult, reference: LoadResult | None) -> str:
    """A row of :data:`HEADER` (``churn`` mode)."""
    diff = "-" if reference is None else f"{len(differing(r, reference))}/{len(r.answers)}"
    return (
        f"| {name} | {r.requests} | {len(r.errors)} | {r.server_errors} | {diff} | "
        f"{r.requests / r.wall_s:.2f} | {r.cached_share:.0%} | {_ttft(r)} | "
        f"{r.api_calls} | {len(r.api_errors)} | {r.in_flight_at_end} |"
    )


HEADER = (
    "| server | requests | errors | 5xx | answers differ | req/s | cached | TTFT p50 / p95 "
    "(turns 2+) | session API calls | API errors | in flight at end |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def concurrent_summary(name: str, r: LoadResult, reference: LoadResult | None) -> str:
    """A row of :data:`CONCURRENT_HEADER`: answers compared with the hold-everything run's."""
    if reference is None:
        same = "(reference)"
    else:
        both = [k for k in r.answers if k in reference.answers]
        same = f"{len(both) - len(differing(r, reference))}/{len(both)}"
    return (
        f"| {name} | {r.requests} | {len(r.errors)} | {r.requests / r.wall_s:.2f} | "
        f"{r.prompt_tokens / r.wall_s:.0f} | {r.cached_share:.0%} | {_ttft(r)} | {same} |"
    )


CONCURRENT_HEADER = (
    "| server | requests | errors | req/s | prompt tokens/s | cached | TTFT p50 / p95 "
    "(turns 2+) | answers = reference (last row) |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


@dataclass(frozen=True)
class _Run:
    name: str
    flags: list[str]
    resident: str
    api_calls: int = 0


def _runs(args: argparse.Namespace) -> list[_Run]:
    """The servers of a mode, the reference (what the others' answers are compared with) last."""
    if args.mode == "churn":
        return [
            _Run("langgraph-kvcache", [], args.resident, args.api_calls),
            _Run("cache off (recompute)", ["--no-kv-offload", "--no-enable-prefix-caching"],
                 args.resident),
        ]  # fmt: skip
    return [
        _Run(f"vLLM prefix caching, resident {args.resident}", ["--no-kv-offload"], args.resident),
        _Run(f"langgraph-kvcache, resident {args.resident}", [], args.resident),
        _Run(f"vLLM prefix caching, resident {args.full} (holds all)", ["--no-kv-offload"],
             args.full),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from examples.server_process import ServerProcess, equal_cores_env

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["churn", "concurrent"], default="churn")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--api-calls", type=int, default=60, help="churn rounds (5 calls each)")
    ap.add_argument("--resident", default="256MiB", help="--kv-cache-memory-bytes of the servers")
    ap.add_argument("--full", default="2GiB", help="concurrent: the hold-everything budget")
    ap.add_argument("--max-model-len", default="4096")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="requests running at once, every server (default: the conversations, "
                         "8 to 64)")  # fmt: skip
    ap.add_argument("--model", default=None, help="model folder, or 'tiny' for the test model")
    ap.add_argument("--reserved-cpus", type=int, default=0,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server")  # fmt: skip
    args = ap.parse_args(argv)

    model_dir = None
    if args.model == "tiny":
        from server.model import build_default_model, build_tiny_model, default_cache_dir

        model_dir = build_tiny_model(
            default_cache_dir() / "models" / "tiny-llama-h32", tokenizer_from=build_default_model()
        )
    elif args.model:
        model_dir = Path(args.model)
    max_num_seqs = args.max_num_seqs or max(8, min(args.conversations, 64))
    common = ["--max-model-len", args.max_model_len, "--max-num-seqs", str(max_num_seqs)]
    results: dict[str, LoadResult] = {}
    cores: dict[str, str] = {}
    say: Callable[[str], None] = lambda m: print(f"[load] {m}", flush=True)  # noqa: E731
    for run in _runs(args):
        flags = [*common, "--kv-cache-memory-bytes", run.resident, *run.flags]
        env = equal_cores_env(args.reserved_cpus)
        with ServerProcess(flags=flags, model=model_dir, progress=say, env=env) as server:
            say(f"{run.name}: {args.conversations} conversations x {args.turns} turns")
            results[run.name] = run_load(
                server.url, server.model_name, conversations=args.conversations,
                turns=args.turns, clients=args.clients, max_tokens=args.max_tokens,
                api_calls=run.api_calls,
            )  # fmt: skip
            cores[run.name] = server.omp_cores()
    *names, ref_name = results
    reference = results[ref_name]
    row = summary if args.mode == "churn" else concurrent_summary
    print(HEADER if args.mode == "churn" else CONCURRENT_HEADER)
    for name in [*names, ref_name]:
        r = results[name]
        print(row(name, r, None if r is reference else reference))
    for name, line in cores.items():
        print(f"{name}: VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}; {line}")
    for name, r in results.items():
        for line in (r.errors + r.api_errors)[:5]:
            print(f"  {name}: {line}")
    ours = next(r for name, r in results.items() if name.startswith("langgraph-kvcache"))
    bad = ours.errors or ours.api_errors or differing(ours, reference) or ours.in_flight_at_end
    return 1 if bad or reference.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
