"""What the KV tiers cost a request that can reuse nothing: fresh prompts, back to back.

Each server variant gets the same model, flags and cores (``equal_cores_env``) and answers the
same fresh prompts one at a time (a Wikipedia passage each, a new session each, greedy); nothing
can come from a cache, so the difference between variants is what saving costs: the copies to
the RAM tier on vLLM's step, and the disk tier's file writes on the worker's I/O thread, which
share the cores with the forward on a CPU server. Printed per variant: the latency p50 and mean
of the requests after the warm-up, vLLM's own mean prefill time (``/metrics``) and the OpenMP
cores from its log.

    python benchmarks/tier_cost.py                     # first token only (max_tokens 1)
    python benchmarks/tier_cost.py --max-tokens 16     # answers that hide writes in decoding

Variants: ``vllm`` (plain vLLM's own OpenAI server, ``python -m
vllm.entrypoints.openai.api_server``, prefix caching on: what this server's API layer and
connector are measured against), ``no-offload`` (``--no-kv-offload``: vLLM's engine and prefix
cache behind this server's API, no connector), ``ram`` (``--kv-disk-bytes 0``), ``ram+disk``
(the defaults). Every variant gets the engine flags of ``benchmarks/multi_turn.py`` (float32,
eager). docs/operations.md ("What the disk
tier costs on CPU") has a run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "vllm": [],
    "no-offload": ["--no-kv-offload"],
    "ram": ["--kv-disk-bytes", "0"],
    "ram+disk": [],
}


def _metric_mean(text: str, name: str) -> float:
    """Mean of a vLLM histogram from ``/metrics`` text (NaN when it has no samples)."""
    total = sum(float(x) for x in re.findall(rf"^vllm:{name}_sum{{[^}}]*}} (\S+)", text, re.M))
    count = sum(float(x) for x in re.findall(rf"^vllm:{name}_count{{[^}}]*}} (\S+)", text, re.M))
    return total / count if count else float("nan")


def run(url: str, model: str, prompts: list[str], max_tokens: int, warmup: int) -> list[float]:
    """Send each prompt as a new session, one at a time; return the latencies after warm-up."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=300) as client:
        for i, text in enumerate(prompts):
            body = {
                "model": model, "max_tokens": max_tokens, "temperature": 0.0,
                "session_id": f"fresh-{i}", "messages": [{"role": "user", "content": text}],
            }  # fmt: skip
            start = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - start)
    return latencies[warmup:]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from multi_turn import _wiki_paragraphs

    from examples.server_process import PlainVllmProcess, ServerProcess, equal_cores_env

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4, help="first requests left out")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--chars", type=int, default=1200, help="characters of passage per prompt")
    ap.add_argument(
        "--resident", default=str(512 << 20), help="--kv-cache-memory-bytes of all, in bytes"
    )
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--reserved-cpus", type=int, default=0,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server")  # fmt: skip
    args = ap.parse_args(argv)

    paragraphs = _wiki_paragraphs()
    prompts = [
        f"{i}: {paragraphs[i % len(paragraphs)][: args.chars]}" for i in range(args.requests)
    ]
    common = [
        "--max-model-len", "8192", "--kv-cache-memory-bytes", args.resident,
        "--dtype", "float32", "--enforce-eager", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    say = lambda m: print(f"[tier_cost] {m}", flush=True)  # noqa: E731
    rows: list[str] = []
    for name in args.variants:
        flags = [*common, *VARIANTS[name]]
        env = equal_cores_env(args.reserved_cpus)
        process = PlainVllmProcess if name == "vllm" else ServerProcess
        with process(flags=flags, progress=say, env=env) as server:
            lat = run(server.url, server.model_name, prompts, args.max_tokens, args.warmup)
            prefill = _metric_mean(httpx.get(f"{server.url}/metrics").text,
                                   "request_prefill_time_seconds")  # fmt: skip
            rows.append(
                f"{name:>10}  p50 {statistics.median(lat) * 1e3:6.0f} ms  "
                f"mean {statistics.mean(lat) * 1e3:6.0f} ms  "
                f"vLLM prefill mean {prefill * 1e3:6.0f} ms  {server.omp_cores()}"
            )
    print(f"{args.requests - args.warmup} fresh prompts of {args.chars} characters each, "
          f"max_tokens {args.max_tokens}, one at a time")  # fmt: skip
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
