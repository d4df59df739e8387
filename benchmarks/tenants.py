"""Tenant fairness: what one key's load does to another key's turns and session API calls.

One server with two API keys (the same flags throughout). Tenant B runs a chat conversation
(streamed turns on its own session; TTFT to the first content token) and, after each turn,
four session API calls on another of its sessions (GET, PATCH of the TTL, pin with a lease,
unpin). It does so with tenant A idle, then while tenant A:

- (a) sends oversized JSON bodies: ``/v1/completions`` bodies just under ``--max-body-bytes``
  (2 MiB; a flat array of token ids), several in parallel, back to back;
- (b) pins to its quota: A first fills sessions and pins them (with leases) until the server
  answers 409 (``--tenant-pin-share``), then keeps renewing its pins, trying one more and
  listing its sessions;
- (c) runs long generations: a full batch (``--max-num-seqs`` streams of ``--gen-tokens``
  tokens each, ``ignore_eos``, re-sent as each ends), and the same with one slot left free.

Printed per phase: B's TTFT p50/p99 and its session API p50/p99, each with its ratio to the
idle phase (the goal is at most 1.5x), what A got done meanwhile (answers by status), and the
server's OpenMP core list (``VLLM_CPU_NUM_OF_RESERVED_CPU`` set, as every benchmark here).
Tenant A's loads are in ``benchmarks/tenant_a.py``; they run in a process of their own, as
another client's would (B's figures then never include waiting for A's threads' GIL).

    python benchmarks/tenants.py                   # tiny random Llama, about 4 minutes on 2 cores
    python benchmarks/tenants.py --quick           # about 2 minutes
    python benchmarks/tenants.py --model smollm2   # SmolLM2-135M-Instruct (slower)
    python benchmarks/tenants.py --plain           # then idle and (c) on plain vLLM too
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tenant_a import (  # noqa: E402
    KEY_A,
    KEY_B,
    MAX_NUM_SEQS,
    Load,
    client,
    long_generations,
    oversized_bodies,
    pin_churn,
    pin_cleanup,
    pin_setup,
)


def say(msg: str) -> None:
    print(f"[tenants] {msg}", flush=True)


@dataclass
class Figures:
    """What tenant B measured in one phase (seconds)."""

    ttft: list[float] = field(default_factory=list)
    api: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def quantile(values: list[float], q: float) -> float:
    """The ``q`` percentile (0.01..0.99) of ``values``, interpolated between samples."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


# --------------------------------------------------------------------------- tenant B


def b_probe(
    url: str, model: str, phase: str, turns: int, max_tokens: int, *, session_api: bool = True
) -> Figures:
    """Tenant B's conversation and (with ``session_api``) session API calls; returns what it
    measured."""
    out = Figures()
    chat_sid, api_sid = f"b-chat-{phase}", f"b-api-{phase}"
    opening = " ".join(f"Fact {i}: tenant B keeps notes about harbours." for i in range(30))
    messages = [{"role": "user", "content": f"{opening} Summarise the notes."}]
    with client(url, KEY_B) as c:
        if session_api:
            created = c.post("/v1/sessions", json={"id": api_sid, "ttl_seconds": 3600})
            if created.status_code not in (201, 409):
                out.errors.append(f"create {api_sid}: HTTP {created.status_code}")
        for t in range(turns):
            try:
                answer, ttft = _chat_turn(c, model, chat_sid, messages, max_tokens)
                out.ttft.append(ttft)
            except (httpx.HTTPError, RuntimeError) as exc:
                out.errors.append(f"turn {t + 1}: {exc!r}"[:200])
                answer = ""
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"Turn {t + 2}: one more detail, please."},
            ]
            calls = [
                ("GET", f"/v1/sessions/{api_sid}", None),
                ("PATCH", f"/v1/sessions/{api_sid}", {"ttl_seconds": 3600 + t}),
                ("POST", f"/v1/sessions/{api_sid}/pin", {"pin_ttl_seconds": 60}),
                ("POST", f"/v1/sessions/{api_sid}/unpin", None),
            ]
            for method, path, body in calls if session_api else []:
                start = time.perf_counter()
                try:
                    r = c.request(method, path, json=body)
                    out.api.append(time.perf_counter() - start)
                    if r.status_code != 200:
                        out.errors.append(f"{method} {path}: HTTP {r.status_code} {r.text[:80]}")
                except httpx.HTTPError as exc:
                    out.errors.append(f"{method} {path}: {exc!r}"[:200])
        if session_api:
            c.delete(f"/v1/sessions/{api_sid}")
    return out


def _chat_turn(
    c: httpx.Client, model: str, sid: str, messages: list[dict], max_tokens: int
) -> tuple[str, float]:
    """One streamed turn: (answer, seconds to the first content token)."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "session_id": sid, "stream": True,
    }  # fmt: skip
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:120]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece or choice.get("finish_reason"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(piece or "")
    return "".join(text), ttft if ttft is not None else time.perf_counter() - start


# --------------------------------------------------------------------------- phases


@dataclass
class Phase:
    name: str
    load: Load
    figures: Figures


def run_phase(
    name: str,
    probe: Callable[[], Figures],
    a_load: Callable[[threading.Event, Load], None] | None,
    load: Load | None = None,
    warmup_s: float = 2.0,
) -> Phase:
    """Tenant A's load in a process of its own (another client, as a real other tenant is:
    A's streaming threads in B's process made B wait for their GIL, up to seconds with one core
    left to the clients and the API server), B's probe here."""
    load = load or Load()
    fork = multiprocessing.get_context("fork")
    stop = fork.Event()
    results, sent = fork.Pipe(duplex=False)
    child = None
    if a_load is not None:
        child = fork.Process(target=_tenant_a, args=(a_load, stop, sent), daemon=True)
        child.start()
        time.sleep(warmup_s)  # A's load is running before B measures
    say(f"phase {name}: tenant B measuring")
    try:
        figures = probe()
    finally:
        stop.set()
        if child is not None:
            if results.poll(120):
                statuses, note, sample = results.recv()
                load.statuses.update(statuses)
                load.note = load.note or note
                load.sample = load.sample or sample
            child.join(timeout=30)
    return Phase(name, load, figures)


def _tenant_a(a_load: Callable[[threading.Event, Load], None], stop: Any, results: Any) -> None:
    """In A's process: run the load until ``stop``, then send back what A got."""
    load, done = Load(), threading.Event()
    threading.Thread(target=lambda: (stop.wait(), done.set()), daemon=True).start()
    a_load(done, load)
    results.send((dict(load.statuses), load.note, load.sample))


def table(phases: list[Phase]) -> list[str]:
    idle = phases[0].figures
    base = {
        kind: (quantile(v, 0.5), quantile(v, 0.99)) if v else (1.0, 1.0)
        for kind, v in (("ttft", idle.ttft), ("api", idle.api))
    }
    lines = [
        "| tenant A | B TTFT p50 / p99 (ms) | x idle | B session API p50 / p99 (ms) | x idle "
        "| B errors |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in phases:
        f = p.figures
        cells = []
        for kind, values in (("ttft", f.ttft), ("api", f.api)):
            if not values:
                cells += ["-", "-"]
                continue
            p50, p99 = quantile(values, 0.5), quantile(values, 0.99)
            b50, b99 = base[kind]
            cells += [f"{p50 * 1e3:.1f} / {p99 * 1e3:.1f}", f"{p50 / b50:.2f} / {p99 / b99:.2f}"]
        lines.append(f"| {p.name} | {' | '.join(cells)} | {len(f.errors)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from examples.server_process import ServerProcess, equal_cores_env

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer turns, shorter generations")
    ap.add_argument("--turns", type=int, default=None, help="B's turns per phase (24; quick 8)")
    ap.add_argument("--max-tokens", type=int, default=8, help="B's answer length")
    ap.add_argument("--gen-tokens", type=int, default=None, help="A's generations (768; quick 256)")
    ap.add_argument("--bodies", type=int, default=4, help="A's parallel oversized bodies")
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--reserved-cpus", type=int, default=0,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU of the server")  # fmt: skip
    ap.add_argument("--plain", action="store_true",
                    help="then phases idle and (c) on plain vLLM with prefix caching (same model, "
                         "resident KV, limits and cores; B's TTFT only)")  # fmt: skip
    args = ap.parse_args(argv)
    turns = args.turns or (8 if args.quick else 24)
    gen_tokens = args.gen_tokens or (256 if args.quick else 768)

    from server.model import build_default_model, build_tiny_model, default_cache_dir

    if args.model == "tiny":  # 128-token blocks of 128 KiB
        model_dir = build_tiny_model(
            default_cache_dir() / "models" / "tiny-llama-h32", tokenizer_from=build_default_model()
        )
        tiers = ["--kv-ram-bytes", "32MiB", "--kv-disk-bytes", "128MiB"]
        resident = "128MiB"
    else:  # SmolLM2: 5.9 MB blocks, the tiers scaled to about the same block counts
        model_dir = build_default_model()
        tiers = ["--kv-ram-bytes", "1536MiB", "--kv-disk-bytes", "6GiB"]
        resident = "768MiB"
    limits = [
        "--kv-cache-memory-bytes", resident, "--max-model-len", "2048",
        "--max-num-seqs", str(MAX_NUM_SEQS),
    ]  # fmt: skip
    flags = ["--api-key", KEY_A, "--api-key", KEY_B, *tiers, *limits]
    env = equal_cores_env(args.reserved_cpus)
    started = time.perf_counter()
    phases: list[Phase] = []
    with ServerProcess(flags=flags, model=model_dir, progress=say, env=env) as server:
        url = server.url
        with client(url, KEY_B) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
        say(f"server up in {time.perf_counter() - started:.0f}s; flags: {' '.join(flags[4:])}")

        def probe(phase: str) -> Callable[[], Figures]:
            return lambda: b_probe(url, model, phase, turns, args.max_tokens)

        b_probe(url, model, "warmup", 2, args.max_tokens)
        phases.append(run_phase("idle", probe("idle"), None))
        phases.append(
            run_phase(
                "(a) oversized bodies",
                probe("bodies"),
                lambda stop, load: oversized_bodies(url, model, stop, load, args.bodies),
            )
        )
        pin_load = Load()
        pinned = pin_setup(url, model, pin_load)
        phases.append(
            run_phase(
                "(b) pinned to its quota",
                probe("pins"),
                lambda stop, load: pin_churn(url, stop, load, pinned),
                pin_load,
            )
        )
        pin_cleanup(url, pinned)
        phases += generation_phases(url, model, probe, gen_tokens)
        if not args.quick:
            phases.append(run_phase("idle, again", probe("idle2"), None))
        cores = server.omp_cores()
    plain: list[Phase] = []
    if args.plain:
        plain = plain_phases(model_dir, limits, env, turns, args, gen_tokens)
    print()
    print(f"model {args.model}, {turns} B turns per phase ({args.max_tokens} tokens each), "
          f"4 session API calls after each; wall {time.perf_counter() - started:.0f}s")  # fmt: skip
    for line in table(phases):
        print(line)
    print()
    for p in phases[1:]:
        print(f"tenant A during {p.name}: {p.load.summary()}")
    for p in phases:
        for err in p.figures.errors[:3]:
            print(f"  B error in {p.name}: {err}")
    print(f"server: VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}; {cores}")
    if plain:
        print("\nplain vLLM (prefix caching on, one key, no session API), same flags otherwise:")
        for line in table(plain):
            print(line)
        for p in plain[1:]:
            print(f"tenant A during {p.name}: {p.load.summary()}")
    return 0


def plain_phases(
    model_dir: Path, flags: list[str], env: dict[str, str], turns: int, args: Any, gen: int
) -> list[Phase]:
    """Idle and phase (c) against plain vLLM: what a user would run instead. Every key may
    fill the batch there (no --tenant-generation-share)."""
    from examples.server_process import PlainVllmProcess

    flags = [f.removesuffix("iB") if f.endswith("MiB") else f for f in flags]  # vLLM: "128M"
    with PlainVllmProcess(flags=flags, model=model_dir, progress=say, env=env) as server:
        url = server.url
        with client(url, KEY_B) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]

        def probe(phase: str) -> Callable[[], Figures]:
            return lambda: b_probe(url, model, phase, turns, args.max_tokens, session_api=False)

        b_probe(url, model, "warmup", 2, args.max_tokens, session_api=False)
        phases = [run_phase("idle", probe("idle"), None)]
        phases += generation_phases(url, model, probe, gen)
        say(f"plain vLLM cores: {server.omp_cores()}")
    return phases


def generation_phases(
    url: str, model: str, probe: Callable[[str], Callable[[], Figures]], gen: int
) -> list[Phase]:
    """Phase (c): A runs a full batch of long generations, then the same with one slot free."""
    return [
        run_phase(
            f"(c) long generations, {label}",
            probe(f"gen{streams}"),
            lambda stop, load, s=streams: long_generations(url, model, stop, load, s, gen),
        )
        for streams, label in ((MAX_NUM_SEQS, "full batch"), (MAX_NUM_SEQS - 1, "batch - 1"))
    ]


if __name__ == "__main__":
    raise SystemExit(main())
