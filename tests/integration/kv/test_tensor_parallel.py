"""The connector under tensor parallelism: ``tensor_parallel_size=2`` on vLLM's CPU engine
(two worker processes of vLLM's multiprocessing executor, one KV head each of the tiny
Llama's two).

One conversation, three engines on one cache folder, each in its own process:

1. TP=2: turn 1 (a miss), turn 2 (prompt + answer + new tokens) hits from the RAM tier.
2. TP=2 again (a restart): turn 3 hits turn 2's blocks and tail from the files each rank wrote.
3. TP=1 on the same folder: the TP=2 files are another layout (the manifest records the TP
   size), so turn 3 is a miss, and the answers of turns 1 and 3 are the TP=2 answers, token
   for token.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from kv_engine import BLOCK, engine_kwargs, run_engine_script

from server.kv.registry import Registry
from server.kv.tiers.disk import MANIFEST_FILE

pytestmark = pytest.mark.vllm

TP_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""One OpenMP thread per worker: the two ranks share the test machine's two cores."""


def stats(cache: Path) -> dict[str, float]:
    reg = Registry(cache / "sessions.sqlite3")
    try:
        return reg.stats()
    finally:
        reg.close()


def hit(counters: dict[str, float], tier: str, kind: str = "blocks") -> float:
    return counters.get(f'lgkv_hit_{kind}_total{{tier="{tier}"}}', 0.0)


def layouts(cache: Path) -> dict[int, Path]:
    """TP size -> layout folder under the cache's block folder."""
    found = {}
    for manifest in (cache / "blocks").glob(f"*/{MANIFEST_FILE}"):
        found[int(json.loads(manifest.read_text()).get("tp_size", 1))] = manifest.parent
    return found


def same_answer(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert got["tokens"] == ref["tokens"]
    assert got["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-3)


def test_tp2_hits_restarts_and_tp1_misses_with_the_same_answers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    tp1 = engine_kwargs(tiny_model_dir, cache)
    tp2 = {**tp1, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    rng = random.Random(11)
    first = [rng.randrange(200, 40000) for _ in range(3 * BLOCK + 20)]
    more = [rng.randrange(200, 40000) for _ in range(30)]
    more3 = [rng.randrange(200, 40000) for _ in range(30)]
    turns = [
        {"prompt": first, "session": "A"},
        {"continue": more, "session": "A", "reset": True},
        {"settle": True},
    ]
    started = time.monotonic()
    one, two = run_engine_script({"engine": tp2, "turns": turns}, tmp_path, env=TP_ENV)
    assert one["num_cached_tokens"] == 0
    # Turn 2 loads turn 1's 3 blocks and its tail (all but turn 1's last, uncomputed token).
    prior = len(first) + len(one["tokens"])
    assert two["num_cached_tokens"] == prior - 1
    after_a = stats(cache)
    print(f"\nTP=2 engine, turns 1 and 2: {time.monotonic() - started:.0f} s")
    assert hit(after_a, "ram") == 3 and hit(after_a, "ram", "tails") == 1

    (tp2_dir,) = layouts(cache).values()
    manifest = json.loads((tp2_dir / MANIFEST_FILE).read_text())
    assert manifest["tp_size"] == 2
    files = sorted(p.name.split(".")[1] for p in tp2_dir.glob("*/*/*.kvb"))
    assert files and files.count("r0") == files.count("r1") == len(files) // 2  # a file a rank

    # A restarted TP=2 engine serves turn 3 from the files both ranks wrote: turn 2's three
    # blocks and its tail (turn 2 superseded turn 1's tail).
    third = {"prompt": [*two["prompt"], *two["tokens"], *more3], "session": "A"}
    (three,) = run_engine_script(
        {"engine": tp2, "turns": [third, {"settle": True}]}, tmp_path, env=TP_ENV
    )
    assert three["num_cached_tokens"] == len(two["prompt"]) + len(two["tokens"]) - 1
    after_b = stats(cache)
    print(f"TP=2 restart, turn 3: {time.monotonic() - started:.0f} s")
    assert hit(after_b, "disk") - hit(after_a, "disk") == 3
    assert hit(after_b, "disk", "tails") - hit(after_a, "disk", "tails") == 1

    # TP=1 on the TP=2 folder: a miss (another layout), and the same answers as TP=2.
    ref_one = {"prompt": first, "cache": False}
    # (turn 3 first: any request's full blocks are saved, turn 1's too, in the TP=1 layout)
    results = run_engine_script(
        {"engine": tp1, "turns": [third, ref_one, {"settle": True}]}, tmp_path
    )
    miss, ref = results
    same_answer(ref, one)
    assert miss["num_cached_tokens"] == 0
    same_answer(miss, three)
    after_c = stats(cache)
    print(f"TP=1 on the TP=2 folder: {time.monotonic() - started:.0f} s")
    for tier in ("ram", "disk"):
        for kind in ("blocks", "tails"):
            assert hit(after_c, tier, kind) == hit(after_b, tier, kind)
    assert set(layouts(cache)) == {1, 2}
