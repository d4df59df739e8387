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
are loaded: every seam here recomputes 0 tokens.

    python benchmarks/shifted_reuse.py                   # SmolLM2-135M, 100 + 30 conversations
    python benchmarks/shifted_reuse.py --quick           # 10 conversations, one window
    python benchmarks/shifted_reuse.py --model tiny      # a 2-layer random-weight Llama
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


def conversation(http: httpx.Client, model: str, rng: random.Random, window: int,
                 tag: str, index: int) -> dict[str, Any]:  # fmt: skip
    """One conversation's turn 1, then turn 2 three ways; its figures."""
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
    first = tokenize(messages(history, history[0]))
    second = tokenize(messages(history[-kept:], asked))
    session = f"shift-{tag}-{window}-{index}"
    shifted = {"session_id": session, "vllm_xargs": {"lgkv_reuse": "shifted"}}
    complete(http, model, first, 1, **shifted)
    on = complete(http, model, second, **shifted)
    # exact reuse can read only the prefix turn 2 shares with turn 1 (the system prompt), as
    # any other conversation's turn 1 holds it too (no salt): its own turn 1 is not run
    exact = complete(http, model, second, session_id=f"exact-{tag}-{window}-{index}")
    salt = uuid.uuid4().hex
    off = complete(http, model, second, cache_salt=salt)
    # the answer begun for the model: each way's own turn-2 KV (vLLM's prefix cache, the salt)
    start = {"model": model, "prompt": f"The code of {asked[0]} {asked[1]} is",
             "add_special_tokens": False}  # fmt: skip
    begun = list(http.post("/tokenize", json=start).json()["tokens"])
    probe_on = complete(http, model, second + begun, 6, **shifted)
    probe_off = complete(http, model, second + begun, 6, cache_salt=salt)
    reusable = _shared_runs(first, second)
    pairs = enumerate(zip(on.tokens, off.tokens, strict=False))
    diverge = next((i for i, (a, b) in pairs if a != b), min(len(on.tokens), len(off.tokens)))
    same = zip(on.logprobs[:diverge], off.logprobs[:diverge], strict=False)
    diffs = [abs(a - b) for a, b in same]
    code = str(asked[2])
    return {"prompt": len(second), "reusable": reusable, "cached": on.cached,
            "exact_cached": exact.cached, "ttft": on.ttft_s, "ttft_exact": exact.ttft_s,
            "ttft_off": off.ttft_s, "same": on.tokens == off.tokens, "diverge": diverge,
            "lp": statistics.fmean(diffs) if diffs else 0.0,
            "right": code in on.text, "right_off": code in off.text,
            "probe": code in probe_on.text, "probe_off": code in probe_off.text}  # fmt: skip


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
    ap.add_argument("--reserved-cpus", type=int, default=0)
    args = ap.parse_args(argv)
    windows = args.windows or ([1000] if args.quick else [2000, 500])
    counts = args.conversations or ([10] if args.quick else [100, 30])
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
                runs.append(conversation(http, name, rng, window, tag, i))
                if (i + 1) % 10 == 0:
                    say(f"window {window}: {i + 1}/{count} conversations")
            rows.append((window, runs))
        cores = server.omp_cores()
    print()
    print(f"{args.model}, float32, wall {time.perf_counter() - started:.0f}s; {cores}")
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
              f"{sum(r['same'] for r in runs) / len(runs):.2f} | "
              f"{statistics.fmean(r['diverge'] for r in runs):.1f} | "
              f"{statistics.fmean(r['lp'] for r in runs):.3f} | "
              f"{sum(r['right'] for r in runs) / len(runs):.2f} / "
              f"{sum(r['right_off'] for r in runs) / len(runs):.2f} | "
              f"{sum(r['probe'] for r in runs) / len(runs):.2f} / "
              f"{sum(r['probe_off'] for r in runs) / len(runs):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
