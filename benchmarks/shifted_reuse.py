"""Shifted reuse after a trim: what it saves and what it changes, against recompute.

Each conversation is a system prompt and a history of short notes (``The code of locker 17 is
4821.``, answered ``Noted.``). Turn 1 sends the whole history and a question; turn 2 is the
edit: the history trimmed to its last ``--windows`` tokens (at message boundaries, the system
prompt kept, as ``trim_messages(strategy="last", include_system=True)`` does) and a question
about a note the trim kept. Turn 2 runs three ways on the same server, greedy, 32 tokens:

- **shifted**: the session asks for shifted reuse (``vllm_xargs.lgkv_reuse: "shifted"``): its
  kept history is loaded from turn 1's blocks at new positions;
- **exact**: a session with exact reuse (what the server does by default: only the prompt's
  exact prefix, here what it shares with any earlier turn 1: the system prompt's whole blocks);
- **recompute**: nothing cached (a fresh ``cache_salt``, no session).

Per window: the tokens of turn 2 that turn 1 held (``reusable``), the share of them read from
the cache, TTFT p50 of each way, and against recompute: greedy continuations identical, the
mean first divergence (32 when identical), the mean absolute logprob difference of the chosen
tokens before it, and retrieval accuracy: the answer names the note's number, and (a probe this
model can pass: it rarely answers such questions itself) the greedy continuation of the answer
begun for it, ``The code of locker 17 is``, does. vLLM computes a
prompt's tokens as a prefix, so the tokens after a seam cannot be recomputed while later ones
are loaded: in the table above the seam recomputes 0 tokens.

``--seam-tokens K ...`` measures what recomputing the first K tokens after the seam would
give, in two passes per turn 2 (a client-side stand-in for a runner that recomputes them in
the same forward): first the prompt up to the seam and K tokens past it, one token generated,
under a session of its own (no history: it loads nothing shifted, and turn 1 stays the
session's last path), which reads the exact prefix and computes the K tokens with the new
context before them; then turn 2 whole, which reads those K tokens exactly (the first pass's
blocks and tail) and the rest of the kept history shifted. Each K gets its own turn 1 under
its own ``cache_salt`` (turn 2's blocks of one K never feed another). One table row per
(window, K): greedy identity,
first divergence, logprob difference and retrieval against recompute, the tokens read
shifted, and TTFT of turn 2 alone and of both passes together.

    python benchmarks/shifted_reuse.py                   # SmolLM2-135M, 100 + 30 conversations
    python benchmarks/shifted_reuse.py --quick           # 10 conversations, one window
    python benchmarks/shifted_reuse.py --model tiny      # a 2-layer random-weight Llama
    python benchmarks/shifted_reuse.py --windows 2000 --conversations 30 --seam-tokens 0 1 4 16 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a careful assistant. Answer with the number the notes give, nothing else."
THINGS = ["locker", "room", "box", "door", "safe", "cabinet", "drawer", "gate", "vault", "shelf"]
TOKENS = 32


def say(msg: str) -> None:
    print(f"[shifted_reuse] {msg}", flush=True)


@dataclass
class Answer:
    """One streamed completion: its tokens, their logprobs, TTFT and cached tokens."""

    tokens: list[str]
    logprobs: list[float]
    ttft_s: float
    cached: int

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def notes(rng: random.Random, count: int) -> list[tuple[str, str, int]]:
    """``count`` (thing, number, code) notes with distinct names."""
    names = rng.sample([(t, n) for t in THINGS for n in range(1, 100)], count)
    return [(t, str(n), rng.randrange(1000, 9999)) for t, n in names]


def messages(history: list[tuple[str, str, int]], question: tuple[str, str, int]) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": SYSTEM}]
    for thing, name, code in history:
        out.append({"role": "user", "content": f"Note: the code of {thing} {name} is {code}."})
        out.append({"role": "assistant", "content": "Noted."})
    thing, name, _ = question
    out.append({"role": "user", "content": f"What is the code of {thing} {name}?"})
    return out


def complete(
    http: httpx.Client, model: str, prompt: list[int], tokens: int = TOKENS, **extra: Any
) -> Answer:
    """Stream a greedy completion of ``tokens`` tokens of ``prompt`` (token ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, **extra}  # fmt: skip
    tokens: list[str] = []
    logprobs: list[float] = []
    cached, first = 0, float("nan")
    started = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                lp = choice.get("logprobs") or {}
                if lp.get("tokens") and first != first:
                    first = time.perf_counter() - started
                tokens += lp.get("tokens") or []
                logprobs += lp.get("token_logprobs") or []
            usage = chunk.get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Answer(tokens, logprobs, first, cached)


@dataclass
class Case:
    """One conversation: turn 1 (every note and a question) and turn 2 (the trimmed history
    and a question about a kept note), as token ids; the note asked and its begun answer."""

    first: list[int]
    second: list[int]
    asked: tuple[str, str, int]
    begun: list[int]

    @property
    def seam(self) -> int:
        """Tokens turn 2 shares with turn 1 from the start (the system prompt, the template)."""
        pairs = zip(self.first, self.second, strict=False)
        return next((i for i, (a, b) in enumerate(pairs) if a != b), len(self.second))


def make_case(http: httpx.Client, model: str, rng: random.Random, window: int) -> Case:
    """Draw a conversation whose turn 2 keeps the last notes that fit ``window`` tokens."""
    history = notes(rng, 80)

    def tokenize(msgs: list[dict]) -> list[int]:
        body = {"model": model, "messages": msgs, "add_generation_prompt": True}
        return list(http.post("/tokenize", json=body).json()["tokens"])

    # keep the last notes that fit the window (whole messages, the system prompt kept)
    kept = 1
    while kept < len(history):
        if len(tokenize(messages(history[-kept - 1 :], history[-1]))) > window:
            break
        kept += 1
    asked = rng.choice(history[-kept:])
    # the answer begun for the model, a probe of retrieval it can pass
    start = {"model": model, "prompt": f"The code of {asked[0]} {asked[1]} is",
             "add_special_tokens": False}  # fmt: skip
    begun = list(http.post("/tokenize", json=start).json()["tokens"])
    first = tokenize(messages(history, history[0]))
    return Case(first, tokenize(messages(history[-kept:], asked)), asked, begun)


def against(on: Answer, off: Answer, probe_on: Answer, probe_off: Answer, code: str) -> dict:
    """``on`` against recompute's ``off``: identity, first divergence, logprob difference;
    and whether each (and each begun answer, ``probe_*``) names the note's ``code``."""
    pairs = enumerate(zip(on.tokens, off.tokens, strict=False))
    diverge = next((i for i, (a, b) in pairs if a != b), min(len(on.tokens), len(off.tokens)))
    same = zip(on.logprobs[:diverge], off.logprobs[:diverge], strict=False)
    diffs = [abs(a - b) for a, b in same]
    return {"same": on.tokens == off.tokens, "diverge": diverge,
            "lp": statistics.fmean(diffs) if diffs else 0.0, "right": code in on.text,
            "right_off": code in off.text, "probe": code in probe_on.text,
            "probe_off": code in probe_off.text}  # fmt: skip


def conversation(http: httpx.Client, model: str, case: Case, tag: str) -> dict[str, Any]:
    """One conversation's turn 1, then turn 2 three ways; its figures."""
    first, second, code = case.first, case.second, str(case.asked[2])
    shifted = {"session_id": f"shift-{tag}", "vllm_xargs": {"lgkv_reuse": "shifted"}}
    complete(http, model, first, 1, **shifted)
    on = complete(http, model, second, **shifted)
    # exact reuse can read only the prefix turn 2 shares with turn 1 (the system prompt), as
    # any other conversation's turn 1 holds it too (no salt): its own turn 1 is not run
    exact = complete(http, model, second, session_id=f"exact-{tag}")
    salt = uuid.uuid4().hex
    off = complete(http, model, second, cache_salt=salt)
    # the answer begun for the model: each way's own turn-2 KV (vLLM's prefix cache, the salt)
    probe_on = complete(http, model, second + case.begun, 6, **shifted)
    probe_off = complete(http, model, second + case.begun, 6, cache_salt=salt)
    return {"prompt": len(second), "reusable": _shared_runs(first, second), "cached": on.cached,
            "exact_cached": exact.cached, "ttft": on.ttft_s, "ttft_exact": exact.ttft_s,
            "ttft_off": off.ttft_s, **against(on, off, probe_on, probe_off, code)}  # fmt: skip


def seam_runs(http: httpx.Client, model: str, case: Case, ks: list[int], tag: str) -> list[dict]:
    """Turn 2 with the first ``k`` tokens after the seam recomputed, for each ``k`` of ``ks``
    (two passes; module docstring); one figure dict per ``k``, against one recompute."""
    salt = uuid.uuid4().hex
    off = complete(http, model, case.second, cache_salt=salt)
    probe_off = complete(http, model, case.second + case.begun, 6, cache_salt=salt)
    code, out = str(case.asked[2]), []
    for k in ks:
        own = {"cache_salt": uuid.uuid4().hex, "vllm_xargs": {"lgkv_reuse": "shifted"}}
        session = f"seam-{tag}-k{k}"
        complete(http, model, case.first, 1, session_id=session, **own)
        pre_s = 0.0
        if k:
            started = time.perf_counter()
            complete(http, model, case.second[: case.seam + k], 1, session_id=f"{session}-pre",
                     **own)  # fmt: skip
            pre_s = time.perf_counter() - started
        before = shifted_tokens(http)
        on = complete(http, model, case.second, session_id=session, **own)
        moved = shifted_tokens(http) - before
        probe = complete(http, model, case.second + case.begun, 6, session_id=session, **own)
        out.append({"k": k, "cached": on.cached, "moved": moved, "ttft": on.ttft_s,
                    "ttft_both": pre_s + on.ttft_s, "ttft_off": off.ttft_s,
                    **against(on, off, probe, probe_off, code)})  # fmt: skip
    return out


def shifted_tokens(http: httpx.Client) -> float:
    """The server's ``lgkv_hit_shifted_tokens_total``: tokens loaded at moved positions."""
    from examples.managed import metric_sum

    return metric_sum(http.get("/metrics").text, "lgkv_hit_shifted_tokens_total")


def _shared_runs(first: list[int], second: list[int], ngram: int = 16) -> int:
    """Tokens of ``second`` inside runs of ``ngram`` or more that ``first`` holds."""
    known = {tuple(first[i : i + ngram]) for i in range(len(first) - ngram + 1)}
    covered = [False] * len(second)
    for i in range(len(second) - ngram + 1):
        if tuple(second[i : i + ngram]) in known:
            covered[i : i + ngram] = [True] * ngram
    return sum(covered)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from examples.server_process import ServerProcess, equal_cores_env
    from server.model import build_default_model, build_tiny_model, default_cache_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 conversations, one window")
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--windows", type=int, nargs="+", default=None,
                    help="kept history in tokens (2000 500)")  # fmt: skip
    ap.add_argument("--conversations", type=int, nargs="+", default=None,
                    help="conversations per window (100 30)")  # fmt: skip
    ap.add_argument("--seam-tokens", type=int, nargs="+", default=None, metavar="K",
                    help="tokens recomputed after the seam: a curve (0 1 4 16 64)")  # fmt: skip
    ap.add_argument("--reserved-cpus", type=int, default=0)
    args = ap.parse_args(argv)
    windows = args.windows or ([1000] if args.quick else [2000, 500])
    counts = args.conversations or ([10] if args.quick else [100, 30])
    ks = sorted(set(args.seam_tokens or ()))
    if args.model == "tiny":
        model = build_tiny_model(default_cache_dir() / "models" / "tiny-llama-std01",
                                 tokenizer_from=build_default_model(), std=0.1)  # fmt: skip
    else:
        model = build_default_model()
    flags = ["--kv-cache-memory-bytes", "256MiB", "--max-model-len", "4096", "--max-num-seqs",
             "4", "--kv-ram-bytes", "2GiB", "--kv-disk-bytes", "4GiB"]  # fmt: skip
    started = time.perf_counter()
    rows = []
    with ServerProcess(flags=flags, model=model, progress=say,
                       env=equal_cores_env(args.reserved_cpus)) as server:  # fmt: skip
        name = server.model_name
        http = httpx.Client(base_url=server.url, timeout=300)
        tag = uuid.uuid4().hex[:6]
        for window, count in zip(windows, counts * len(windows), strict=False):
            rng = random.Random(window)
            runs = []
            for i in range(count):
                case = make_case(http, name, rng, window)
                if ks:
                    runs += seam_runs(http, name, case, ks, f"{tag}-{window}-{i}")
                else:
                    runs.append(conversation(http, name, case, f"{tag}-{window}-{i}"))
                if (i + 1) % 10 == 0:
                    say(f"window {window}: {i + 1}/{count} conversations")
            rows.append((window, runs))
        cores = server.omp_cores()
    print()
    print(f"{args.model}, float32, wall {time.perf_counter() - started:.0f}s; {cores}; "
          f"flags {' '.join(flags)}")  # fmt: skip
    if ks:
        print_curve(rows, ks)
    else:
        print_windows(rows)
    return 0


def _share(runs: list[dict], key: str) -> str:
    return f"{sum(r[key] for r in runs) / len(runs):.2f}"


def _quality(runs: list[dict]) -> str:
    """Identical, first divergence, logprob difference, retrieval and begun-answer cells."""
    return (f"{_share(runs, 'same')} | {statistics.fmean(r['diverge'] for r in runs):.1f} | "
            f"{statistics.fmean(r['lp'] for r in runs):.3f} | "
            f"{_share(runs, 'right')} / {_share(runs, 'right_off')} | "
            f"{_share(runs, 'probe')} / {_share(runs, 'probe_off')} |")  # fmt: skip


def print_windows(rows: list[tuple[int, list[dict]]]) -> None:
    print("| kept window | conversations | prompt (mean) | reusable | read shifted | read exact | "
          "TTFT p50 shifted / exact / recompute | speed-up | identical | first divergence | "
          "mean abs logprob diff | retrieval shifted / recompute | "
          "begun answer right, shifted / recompute |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for window, runs in rows:
        reusable = sum(r["reusable"] for r in runs)
        p50 = {k: statistics.median(r[k] for r in runs) for k in ("ttft", "ttft_exact", "ttft_off")}
        print(f"| {window} | {len(runs)} | {statistics.fmean(r['prompt'] for r in runs):.0f} | "
              f"{reusable / sum(r['prompt'] for r in runs):.2f} | "
              f"{sum(r['cached'] for r in runs) / reusable:.2f} | "
              f"{sum(r['exact_cached'] for r in runs) / reusable:.2f} | "
              f"{p50['ttft'] * 1000:.0f} / {p50['ttft_exact'] * 1000:.0f} / "
              f"{p50['ttft_off'] * 1000:.0f} ms | {p50['ttft_off'] / p50['ttft']:.1f}x | "
              f"{_quality(runs)}")  # fmt: skip


def print_curve(rows: list[tuple[int, list[dict]]], ks: list[int]) -> None:
    print("| kept window | K recomputed after the seam | conversations | read (mean) | "
          "read shifted (mean) | TTFT p50 turn 2 / both passes / recompute | identical | "
          "first divergence | mean abs logprob diff | retrieval shifted / recompute | "
          "begun answer right, shifted / recompute |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for window, all_runs in rows:
        for k in ks:
            runs = [r for r in all_runs if r["k"] == k]
            p50 = {key: statistics.median(r[key] for r in runs)
                   for key in ("ttft", "ttft_both", "ttft_off")}  # fmt: skip
            print(f"| {window} | {k} | {len(runs)} | "
                  f"{statistics.fmean(r['cached'] for r in runs):.0f} | "
                  f"{statistics.fmean(r['moved'] for r in runs):.0f} | "
                  f"{p50['ttft'] * 1000:.0f} / {p50['ttft_both'] * 1000:.0f} / "
                  f"{p50['ttft_off'] * 1000:.0f} ms | {_quality(runs)}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
