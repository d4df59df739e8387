"""OpenMP's wait policy on CPU: what the model's spinning threads cost everyone else.

vLLM's CPU worker runs the forward pass on OpenMP threads (PyTorch's libgomp, bound to the
cores vLLM picks). Between parallel regions libgomp's threads spin (unless
``OMP_WAIT_POLICY`` says otherwise) before they sleep; on a machine whose cores the API
server (HTTP, tokenizing, streaming) and vLLM's scheduler share with them, the spinning takes
the cores those processes need. ``--omp-wait-policy`` (``passive`` by default,
server/config.py) sets the policy of the server's processes.

One invocation, two servers in turn, the same model, flags, cores and workload; only the
policy differs (``vllm``: the variable left unset, libgomp's spin, as plain vLLM runs):

- one stream: decode tokens per second of a 256-token greedy answer (``ignore_eos``), 3 times;
- a full batch: ``--max-num-seqs`` streams at once, their tokens per second together;
- another client's first token (a short prompt, 1 token) idle, and while ``--max-num-seqs``
  - 1 long streams run: p50 and p99 of 12 requests each.

    python benchmarks/wait_policy.py                  # SmolLM2-135M-Instruct, ~4 minutes
    python benchmarks/wait_policy.py --model tiny     # a 2-layer random-weight Llama
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SEQS = 8
"""``--max-num-seqs`` of both servers."""


def say(msg: str) -> None:
    print(f"[wait_policy] {msg}", flush=True)


def stream(http: httpx.Client, model: str, prompt: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
    started, first, n = time.perf_counter(), float("nan"), 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if first != first:
                    first = time.perf_counter() - started
                n += 1
    return first, n


def measure(url: str, model: str) -> dict[str, float]:
    http = httpx.Client(base_url=url, timeout=600)
    long_prompt = "Tell me a long story about a lighthouse keeper and the ships. " * 8
    out: dict[str, float] = {}
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        _, n = stream(http, model, long_prompt, 256)
        rates.append(n / (time.perf_counter() - t0))
    out["one stream tok/s"] = statistics.median(rates)

    def batch(count: int, stop: threading.Event | None = None) -> list[int]:
        done: list[int] = []

        def run() -> None:
            while True:
                done.append(stream(http, model, long_prompt, 256)[1])
                if stop is None or stop.is_set():
                    return

        threads = [threading.Thread(target=run) for _ in range(count)]
        for t in threads:
            t.start()
        if stop is None:
            for t in threads:
                t.join()
        else:
            out["_threads"] = threads  # type: ignore[assignment]
        return done

    t0 = time.perf_counter()
    tokens = sum(batch(SEQS))
    out["full batch tok/s"] = tokens / (time.perf_counter() - t0)
    probes = [stream(http, model, "Hello there, how are you?", 1)[0] for _ in range(12)]
    out["first token idle p50 ms"] = statistics.median(probes) * 1000
    out["first token idle p99 ms"] = max(probes) * 1000
    stop = threading.Event()
    batch(SEQS - 1, stop)
    time.sleep(3)  # the streams are decoding
    busy = []
    for _ in range(12):
        busy.append(stream(http, model, "Hello there, how are you?", 1)[0])
        time.sleep(0.3)
    stop.set()
    for t in out.pop("_threads"):  # type: ignore[union-attr]
        t.join()
    out["first token busy p50 ms"] = statistics.median(busy) * 1000
    out["first token busy p99 ms"] = max(busy) * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from examples.server_process import ServerProcess, equal_cores_env
    from server.model import build_default_model, build_tiny_model, default_cache_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--reserved-cpus", type=int, default=0)
    args = ap.parse_args(argv)
    if args.model == "tiny":
        model = build_tiny_model(default_cache_dir() / "models" / "tiny-llama-std01",
                                 tokenizer_from=build_default_model(), std=0.1)  # fmt: skip
    else:
        model = build_default_model()
    flags = ["--kv-cache-memory-bytes", "256MiB", "--max-model-len", "2048",
             "--max-num-seqs", str(SEQS)]  # fmt: skip
    rows: list[tuple[str, str, dict[str, float]]] = []
    for policy in ("vllm", "passive"):
        env = equal_cores_env(args.reserved_cpus)
        policy_flags = [*flags, "--omp-wait-policy", policy]
        with ServerProcess(flags=policy_flags, model=model, progress=say, env=env) as server:
            say(f"--omp-wait-policy {policy}: measuring")
            rows.append((policy, server.omp_cores(), measure(server.url, server.model_name)))
    print()
    names = list(rows[0][2])
    print("| --omp-wait-policy | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for policy, _, figures in rows:
        print(f"| {policy} | " + " | ".join(f"{figures[n]:.1f}" for n in names) + " |")
    for policy, cores, _ in rows:
        print(f"{policy}: {cores}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
