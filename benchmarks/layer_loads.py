"""Layer-wise RAM loads vs all layers before the forward: TTFT of a turn that loads N blocks.

One offline engine (the default model, float32) with the session KV connector, RAM tier only,
in this process. For each N and repetition a session's first turn (N full blocks of random
tokens) fills the RAM tier; then the second turn (the same N blocks plus ``--new`` tokens,
one output token) runs four ways, each after vLLM's prefix cache is reset (the load modes in
rotating order, each with its own new tokens, each compared with ``off`` on its prompt):

- ``off``: no session and ``skip_reading_prefix_cache``: the whole prompt is computed;
- ``at-once``: the N blocks copied from RAM, every layer, in ``start_load_kv``;
- ``layer-wise/1``, ``layer-wise/all``: copied layer by layer on a copy thread while the
  forward runs (``wait_for_layer_load`` waits for each layer), whose torch copies use one
  intra-op thread, or as many as the engine (2 OpenMP teams then share the cores).

The load modes switch on the same engine (the worker's copy thread is swapped), so all see the
same cores and load. It prints the median and p90 TTFT (the
wall time of ``generate``), the worker's load time and whether each answer's token and logprob
equal the ``off`` run's (``same``).

    python benchmarks/layer_loads.py                       # N = 4, 12; 7 repetitions
    python benchmarks/layer_loads.py --blocks 8 --reps 3 --bind "0 1"

``--bind`` sets ``GOMP_CPU_AFFINITY`` (what vLLM's multiprocessing executor sets for its worker
with ``VLLM_CPU_OMP_THREADS_BIND=auto``: the engine thread is then bound to the first core, and
the threads it starts, the copy thread too, inherit that core); without it OpenMP threads
float.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BLOCK = 128
DEFAULT_MODEL = Path.home() / ".cache/langgraph-kvcache/models/SmolLM2-135M-Instruct"
MODES = ("off", "at-once", "layer-wise/1", "layer-wise/all")


def block_bytes(model: Path) -> int:
    import json

    cfg = json.loads((model / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head * 4


def make_engine(model: Path, cache_dir: Path, max_blocks: int) -> Any:
    from vllm import LLM

    from server.kv.offline import transfer_config

    bb = block_bytes(model)
    extra = {
        "cache_dir": str(cache_dir),
        "ram_bytes": 2 * (max_blocks + 1) * bb,
        "disk_bytes": 0,  # no background writes while timing
        "model_id": "bench",
    }
    return LLM(
        model=str(model),
        dtype="float32",
        block_size=BLOCK,
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_cache_memory_bytes=(max_blocks + 4) * bb,
        max_model_len=(max_blocks + 2) * BLOCK,
        seed=0,
        kv_transfer_config=transfer_config(extra),
    )


def worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def run(llm: Any, prompt: list[int], session: str | None) -> tuple[float, int, float, int]:
    """(seconds, first token, its logprob, cached tokens) of one 1-token request."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logprobs=1,
        skip_reading_prefix_cache=session is None,
        extra_args={"session_id": session, "tenant": "bench"} if session else None,
    )
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    comp = out.outputs[0]
    token = comp.token_ids[0]
    return seconds, token, comp.logprobs[0][token].logprob, out.num_cached_tokens


def measure(llm: Any, blocks: int, reps: int, new: int) -> dict[str, Any]:
    """Each load mode's turn 2 gets its own new tokens: a turn saves its tail block, which a
    later prompt with the same tokens would load too. ``off`` runs on every mode's prompt."""
    import torch

    from server.kv.offline import reset_prefix_cache
    from server.kv.worker.layer_loads import LayerLoads

    w = worker()
    own = w.layer_loads
    assert own is not None and w.pool is not None, "no copy thread (CUDA, or no RAM tier)"
    copy = w._copy_layer
    loaders = {
        "layer-wise/1": LayerLoads(w.layers, copy, 1),
        "layer-wise/all": LayerLoads(w.layers, copy, torch.get_num_threads()),
    }
    times: dict[str, list[float]] = {m: [] for m in MODES}
    loads: dict[str, list[float]] = {m: [] for m in MODES}
    same = {m: 0 for m in MODES}
    observed: list[float] = []  # the worker's load durations (vLLM takes its stats each step)
    observe = w.stats.observe_load
    w.stats.observe_load = lambda seconds: (observed.append(seconds), observe(seconds))[-1]

    def timed(mode: str, prompt: list[int], session: str | None) -> tuple[int, float]:
        w.layer_loads = loaders.get(mode)
        reset_prefix_cache(llm)
        observed.clear()
        seconds, token, logprob, cached = run(llm, prompt, session)
        w.layer_loads = own
        loads[mode] += observed
        want = 0 if session is None else blocks * BLOCK
        assert cached == want, f"{mode}: {cached} cached tokens, expected {want}"
        times[mode].append(seconds)
        return token, logprob

    loading = MODES[1:]
    for rep in range(reps):
        rng = random.Random(blocks * 1000 + rep)
        history = [rng.randrange(200, 40000) for _ in range(blocks * BLOCK)]
        prompts = {m: history + [rng.randrange(200, 40000) for _ in range(new)] for m in loading}
        session = f"n{blocks}-r{rep}"
        reset_prefix_cache(llm)
        run(llm, history, session)  # turn 1: its N blocks go to the RAM tier
        refs = {m: timed("off", prompts[m], None) for m in loading}
        shift = rep % len(loading)
        for mode in loading[shift:] + loading[:shift]:
            token, logprob = timed(mode, prompts[mode], session)
            same[mode] += token == refs[mode][0] and abs(logprob - refs[mode][1]) < 1e-3
    w.stats.observe_load = observe
    for loader in loaders.values():
        loader.close()
    return {"times": times, "loads": loads, "same": same}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def affinity(tid: int | None) -> str:
    try:
        return str(sorted(os.sched_getaffinity(tid or 0)))
    except OSError as e:
        return f"? ({e})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 12])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--new", type=int, default=64, help="new tokens computed by the turn")
    p.add_argument("--bind", default=None, help='GOMP_CPU_AFFINITY, e.g. "0 1"')
    args = p.parse_args()
    if args.bind is not None and os.environ.get("GOMP_CPU_AFFINITY") != args.bind:
        env = {**os.environ, "GOMP_CPU_AFFINITY": args.bind}
        env["OMP_NUM_THREADS"] = str(len(args.bind.split()))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    # The server's engine worker gets OMP_NUM_THREADS = its cores (vLLM's multiprocessing
    # executor sets it); in-process vLLM would otherwise drop torch to 1 thread.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    print(f"before: {uptime()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="lgkv-layer-bench-") as tmp:
        llm = make_engine(args.model, Path(tmp), max(args.blocks))
        import torch

        loader = worker().layer_loads
        print(
            f"model {args.model.name}, float32, eager, {os.cpu_count()} cores, torch threads "
            f"{torch.get_num_threads()}, GOMP_CPU_AFFINITY={os.environ.get('GOMP_CPU_AFFINITY')!r}"
            "; affinity: "
            f"engine thread {affinity(None)}, copy thread "
            f"{affinity(loader.native_id if loader else None)}",
            flush=True,
        )
        measure(llm, 1, 1, args.new)  # warm-up
        print(f"\n{'blocks':>6} {'mode':>14} {'TTFT p50':>9} {'p90':>7} {'load p50':>9} same")
        for blocks in args.blocks:
            res = measure(llm, blocks, args.reps, args.new)
            for mode in MODES:
                t, loads = res["times"][mode], res["loads"][mode]
                load = f"{statistics.median(loads) * 1000:7.1f}ms" if loads else f"{'-':>9}"
                same = "ref" if mode == "off" else f"{res['same'][mode]}/{args.reps}"
                print(
                    f"{blocks:>6} {mode:>14} {statistics.median(t) * 1000:7.1f}ms "
                    f"{pct(t, 0.9) * 1000:5.0f}ms {load} {same}",
                    flush=True,
                )
        llm.llm_engine.engine_core.shutdown()
    print(f"\nafter: {uptime()}", flush=True)


if __name__ == "__main__":
    main()
