"""``python benchmarks/compression.py capacity``: the multi-turn workload on one server per
configuration, the RAM tier too small, in each offload format (see ``compression.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path


def _human(n: int) -> str:
    if n % (1 << 20):
        return f"{n}B"
    return f"{n / (1 << 30):g}GiB" if n >= 1 << 30 else f"{n >> 20}MiB"


_GAUGE = re.compile(r"^(lgkv_(?:tier_bytes|tier_blocks|kv_compression_ratio)\{[^}]*\}) (\S+)$")
RAM_BLOCKS, RAM_BYTES = 'lgkv_tier_blocks{tier="ram"}', 'lgkv_tier_bytes{tier="ram"}'


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = _GAUGE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def capacity(model: Path, formats: list[str], args: argparse.Namespace) -> None:
    import httpx
    from multi_turn import _free_port, _start, _stop, _user_turns, run_workload

    users = _user_turns(args.conversations, args.turns)
    ram = args.ram_bytes
    configs = [("auto", ram), ("auto", 4 * ram)] + [(f, ram) for f in formats if f != "auto"]
    from examples.server_process import equal_cores_env, omp_cores

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.update(equal_cores_env(args.reserved_cpus))
    print(
        f"capacity: {args.conversations} conversations x {args.turns} turns, resident "
        f"{_human(args.resident_bytes)}, disk off, VLLM_CPU_NUM_OF_RESERVED_CPU="
        f"{args.reserved_cpus} for every server"
    )
    rows = []
    for fmt, ram_bytes in configs:
        name = f"{fmt}@{_human(ram_bytes)}"
        port = _free_port()
        log = args.out / f"capacity-{fmt}-{_human(ram_bytes)}.log"
        with tempfile.TemporaryDirectory(prefix="lgkv-capacity-") as tmp:
            cmd = [
                sys.executable, "-m", "server", "--model", str(model), "--dtype", "float32",
                "--max-model-len", str(args.max_model_len), "--served-model-name", "bench",
                "--enforce-eager",
                "--kv-cache-memory-bytes", str(args.resident_bytes),
                "--kv-ram-bytes", str(ram_bytes), "--kv-disk-bytes", "0",
                "--kv-offload-dtype", fmt, "--cache-dir", tmp, "--port", str(port),
            ]  # fmt: skip
            print(f"starting {name}", flush=True)
            proc = _start(cmd, port, log, env)
            try:
                url = f"http://127.0.0.1:{port}"
                turns = run_workload(url, "bench", users, args.answer_tokens, name)
                gauges = _gauges(httpx.get(f"{url}/metrics", timeout=30).text)
            finally:
                _stop(proc)
        print(f"  {name}: {omp_cores(log)}")
        late = [t for t in turns if t.turn >= args.late_from]
        rows.append(
            {
                "name": name,
                "hit_rate": sum(t.cached_tokens for t in turns)
                / max(1, sum(t.prompt_tokens for t in turns)),
                "late_hit_rate": sum(t.cached_tokens for t in late)
                / max(1, sum(t.prompt_tokens for t in late)),
                "late_p50": statistics.median(t.ttft_s for t in late),
                "gauges": gauges,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression_capacity.json").write_text(json.dumps(rows, indent=1))
    print(f"\nturns {args.late_from}+: hit rate = cached/prompt tokens; RAM tier at the end")
    print("config              hit(all)  hit(late)  TTFT p50 late  RAM blocks  RAM bytes  ratio")
    for r in rows:
        g = r["gauges"]
        ratio = next((v for k, v in g.items() if k.startswith("lgkv_kv_compression")), 1.0)
        print(
            f"{r['name']:<18} {r['hit_rate']:>9.1%} {r['late_hit_rate']:>10.1%} "
            f"{r['late_p50']:>13.3f}s {g.get(RAM_BLOCKS, 0):>11.0f} "
            f"{g.get(RAM_BYTES, 0):>10.0f} {ratio:>6.2f}x"
        )
    big = next(r for r in rows if r["name"] == f"auto@{_human(4 * ram)}")
    for r in rows[2:]:
        print(
            f"  {r['name']} vs {big['name']}: late hit rate {r['late_hit_rate']:.1%} vs "
            f"{big['late_hit_rate']:.1%}, TTFT p50 {r['late_p50'] / big['late_p50']:.2f}x"
        )
