"""Run-scoped pins: an agent's next call after a sleeping tool, with pins on and off.

The workload of ``examples/sleeping_tool.py``: an agent thread calls the model, then its tool
sleeps while ten other threads (managed sessions, as another checkpointer's) pass their KV
through a server whose resident cache (20 blocks) and RAM tier (16 blocks) hold a few
contexts only; then the agent calls the model again. With the saver's run pins (the default)
its session stays pinned in RAM for the run; with ``run_pins=False`` the eviction policy moves
it to disk, and the next call loads it from there. Runs alternate on and off, each a fresh
thread, on one server (the tiny random Llama, 128-token blocks of 128 KiB; ``--smollm2``:
SmolLM2-135M, 5.9 MB blocks, the budgets scaled to the same block counts).

Printed per setting: the agent's blocks in RAM when the tool ended, the blocks its next call
loaded from RAM and from disk, its cached share of the prompt, and its time to first token
(the call's wall time with a 1-token answer; median and range over the runs).

    python benchmarks/pins.py [--runs 5] [--smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.server_process import ServerProcess  # noqa: E402
from examples.sleeping_tool import (  # noqa: E402
    SMOLLM2_BLOCK_BYTES,
    SleepFigure,
    server_flags,
    sleeping_tool_run,
    tiny_model,
)
from langgraph_kvcache import ChatKVCache  # noqa: E402
from langgraph_kvcache.checkpoint import SQLAlchemySaver  # noqa: E402
from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions  # noqa: E402


def run(runs: int, smollm2: bool) -> dict[bool, list[SleepFigure]]:
    """``runs`` sleeping-tool runs with pins on and as many off, alternating."""
    figures: dict[bool, list[SleepFigure]] = {True: [], False: []}
    work = Path(tempfile.mkdtemp(prefix="lgkv-pins-"))
    if smollm2:
        from server.model import build_default_model

        model_dir, flags = build_default_model(), server_flags(SMOLLM2_BLOCK_BYTES)
    else:
        model_dir, flags = tiny_model(), server_flags()
    with ServerProcess(work / "cache", flags, model=model_dir) as server:
        model = ChatKVCache(base_url=server.url + "/v1", model=server.model_name, timeout=120)
        for i in range(runs):
            for pins in (True, False) if i % 2 == 0 else (False, True):
                options = KVSessionOptions(server.url, ttl_seconds=600, run_pins=pins)
                url = f"sqlite:///{work / 'checkpoints.db'}"
                with SQLAlchemySaver.from_conn_string(url, kv_server=options) as saver:
                    saver.setup()
                    tag = f"bench-{'on' if pins else 'off'}-{i}"
                    figure = sleeping_tool_run(saver, model, server.url, tag, pins=pins)
                print(f"  run {i + 1}: {figure.line()}")
                figures[pins].append(figure)
    return figures


def print_table(figures: dict[bool, list[SleepFigure]]) -> None:
    print("\n| run pins | blocks in RAM after the tool | next call: RAM / disk loads "
          "| cached share | TTFT median (min-max) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for pins, runs in figures.items():
        ttft = [f.ttft_s for f in runs]
        ram = sum(f.ram_blocks for f in runs) / len(runs)
        blocks = sum(f.num_blocks for f in runs) / len(runs)
        loads = [(f.hits.get("ram", 0), f.hits.get("disk", 0)) for f in runs]
        share = sum(f.cached_tokens / f.prompt_tokens for f in runs) / len(runs)
        print(
            f"| {'on' if pins else 'off'} | {ram:.1f} / {blocks:.1f} "
            f"| {sum(r for r, _ in loads) / len(runs):.1f} / "
            f"{sum(d for _, d in loads) / len(runs):.1f} | {share:.1%} "
            f"| {statistics.median(ttft) * 1000:.0f} ms ({min(ttft) * 1000:.0f}-"
            f"{max(ttft) * 1000:.0f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per setting (default 5)")
    parser.add_argument(
        "--smollm2", action="store_true", help="SmolLM2-135M (5.9 MB blocks), not the tiny model"
    )
    args = parser.parse_args()
    print_table(run(args.runs, args.smollm2))


if __name__ == "__main__":
    main()
