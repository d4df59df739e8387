"""SessionKVConnector on a real vLLM engine: hits from RAM and disk, restarts, corruption,
budgets, pins, isolation, delete and prefetch. Greedy outputs must equal a cache-off run.

Tests run in file order and share one engine and cache folder (conftest.py); each states the
tier state it starts from. Sessions use random token prompts, so no two share a block. The
engine records turns and stats on its registry thread, so a turn ends with ``settle(llm)``
before the test reads the registry, and so do pins set through a ``SessionControl``.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kv_engine import (
    BLOCK,
    DISK_BLOCKS,
    RAM_BLOCKS,
    engine_kwargs,
    run_engine_script,
    settle,
)

from server.kv.offline import reset_prefix_cache
from server.kv.registry import Registry
from server.kv.registry.control import SessionControl
from server.kv.tiers.disk import MANIFEST_FILE

pytestmark = pytest.mark.vllm
TENANT = "t"


@dataclass
class Turn:
    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


def turn(
    llm: Any,
    prompt: list[int],
    session: str | None,
    *,
    cache: bool = True,
    reset: bool = True,
    max_tokens: int = 8,
) -> Turn:
    from vllm import SamplingParams

    if reset:
        assert llm.reset_prefix_cache()  # the hit must come from our tiers, not vLLM's cache
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=1,
        skip_reading_prefix_cache=not cache,
        extra_args={"session_id": session, "tenant": TENANT} if session else None,
    )
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    settle(llm)
    comp = out.outputs[0]
    lps = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)]
    return Turn(list(comp.token_ids), lps, out.num_cached_tokens)


def same_answer(got: Turn, ref: Turn) -> None:
    assert got.tokens == ref.tokens
    assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-3)


def hits(registry: Registry, tier: str, kind: str = "blocks") -> float:
    """``lgkv_hit_<kind>_total`` of ``tier``: full ``blocks`` or partial ``tails`` loaded."""
    return registry.stats().get(f'lgkv_hit_{kind}_total{{tier="{tier}"}}', 0.0)


def block_files(cache_dir: Path) -> list[Path]:
    return list((cache_dir / "blocks").glob("*/*/*/*.kvb"))


def tier_blocks(llm: Any, registry: Registry, session: str, **expected: int) -> dict[str, int]:
    """The session's blocks per tier once the registry shows ``expected`` (or after 30 s).
    A block counts on disk once the worker's I/O thread has written its file and an engine
    step has reported it, so on a busy machine the registry may show it a few steps after the
    turn: each poll runs one more step (:func:`settle`)."""
    deadline = time.monotonic() + 30
    while True:
        usage = registry.tier_usage(TENANT, session)
        got = {tier: usage[tier].blocks for tier in expected}
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.05)
        settle(llm)


def file_of(cache_dir: Path, key: str) -> Path:
    (path,) = (cache_dir / "blocks").glob(f"*/{key[:2]}/{key[2:4]}/{key}.kvb")
    return path


# Session A: 3 full blocks of history, then a second turn that adds 60 tokens.
PROMPT_A = tokens(1, 3 * BLOCK + 40)
STATE: dict[str, Any] = {}


def test_ram_hit_matches_cache_off(llm: Any, registry: Registry) -> None:
    first = turn(llm, PROMPT_A, "A")
    assert first.num_cached_tokens == 0
    prompt2 = PROMPT_A + first.tokens + tokens(2, 60)
    ref = turn(llm, prompt2, None, cache=False)
    before = hits(registry, "ram")
    got = turn(llm, prompt2, "A")
    same_answer(got, ref)
    # 3 blocks and the tail block of turn 1 (its prompt end and answer, but the last token)
    assert got.num_cached_tokens == len(PROMPT_A) + len(first.tokens) - 1
    assert hits(registry, "ram") - before == 3
    row = registry.get_session(TENANT, "A")
    assert row is not None and row.turns == 2 and row.num_blocks == 4  # 3 blocks + a tail
    STATE.update(prompt2=prompt2, ref=ref)


def test_disk_hit_after_ram_eviction(llm: Any, registry: Registry) -> None:
    turn(llm, tokens(3, RAM_BLOCKS * BLOCK + 10), "B")  # 8 new blocks push A out of RAM
    assert tier_blocks(llm, registry, "A", ram=0, disk=4) == {"ram": 0, "disk": 4}  # 3 + a tail
    before = hits(registry, "disk")
    got = turn(llm, STATE["prompt2"], "A")  # the same turn again
    same_answer(got, STATE["ref"])
    # its own tail is longer than the prompt: used up to the prompt's last token (continuations)
    assert got.num_cached_tokens == len(STATE["prompt2"]) - 1
    assert hits(registry, "disk") - before == 3


def test_corrupt_block_file_is_a_miss(llm: Any, registry: Registry, kv_cache_dir: Path) -> None:
    turn(llm, tokens(4, RAM_BLOCKS * BLOCK + 10), "C")  # A out of RAM again
    assert registry.tier_usage(TENANT, "A")["ram"].blocks == 0
    key = registry.session_keys(TENANT, "A")[0]
    path = file_of(kv_cache_dir, key)
    data = bytearray(path.read_bytes())
    data[-100:] = bytes(100)  # damage the payload, keep the size
    path.write_bytes(bytes(data))
    got = turn(llm, STATE["prompt2"], "A")
    same_answer(got, STATE["ref"])  # recomputed, not served from the bad file
    # The bad file is removed and the recomputed block written again, both on the I/O thread
    # after the answer: wait for the new file (its writer renames it in place when complete).
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.read_bytes() != bytes(data)  # the recomputed block was written again
    got = turn(llm, STATE["prompt2"], "A")
    same_answer(got, STATE["ref"])
    assert got.num_cached_tokens == len(STATE["prompt2"]) - 1


def test_restart_reuses_disk_files(
    llm: Any, kv_model_dir: Path, kv_cache_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "cache"
    shutil.copytree(kv_cache_dir, copy)
    spec = {
        "engine": engine_kwargs(kv_model_dir, copy),
        "turns": [{"prompt": STATE["prompt2"], "session": "A"}],
    }
    (got,) = run_engine_script(spec, tmp_path)
    assert got["tokens"] == STATE["ref"].tokens
    assert got["logprobs"] == pytest.approx(STATE["ref"].logprobs, abs=1e-3)
    # a restarted engine learns each block file's token ids from its header page: the turn
    # reads its tail up to the last shared token, as before the restart (whole blocks only,
    # 3 * BLOCK, when the files did not keep them)
    assert got["num_cached_tokens"] == len(STATE["prompt2"]) - 1
    reg = Registry(copy / "sessions.sqlite3")
    assert reg.stats()['lgkv_hit_blocks_total{tier="disk"}'] >= 3
    reg.close()


def test_budgets_hold_and_pinned_session_survives(
    llm: Any, registry: Registry, kv_cache_dir: Path
) -> None:
    control = SessionControl(kv_cache_dir)
    control.update("A", TENANT, pinned=True)
    settle(llm)  # the engine knows the pin
    for i in range(4):  # 32 new blocks: more than RAM (8) and disk (24) together
        turn(llm, tokens(10 + i, RAM_BLOCKS * BLOCK + 10), f"D{i}")
        stats = registry.stats()
        assert stats['lgkv_tier_blocks{tier="ram"}'] <= RAM_BLOCKS
        files = block_files(kv_cache_dir)
        sizes = sum(p.stat().st_size for p in files)
        assert len(files) <= DISK_BLOCKS and sizes <= llm_disk_budget(kv_cache_dir)
    assert registry.stats()['lgkv_evicted_blocks_total{tier="disk"}'] > 0
    for key in registry.session_keys(TENANT, "A"):
        assert file_of(kv_cache_dir, key).exists()
    got = turn(llm, STATE["prompt2"], "A")
    same_answer(got, STATE["ref"])
    assert got.num_cached_tokens == len(STATE["prompt2"]) - 1  # its tail, pinned too
    control.update("A", TENANT, pinned=False)
    control.close()


def test_concurrent_sessions_keep_their_own_kv(llm: Any, registry: Registry) -> None:
    from vllm import SamplingParams

    prompts = {"E": tokens(20, 2 * BLOCK + 30), "F": tokens(21, 2 * BLOCK + 30)}
    refs = {s: turn(llm, p, None, cache=False) for s, p in prompts.items()}

    def batch() -> dict[str, Any]:
        reset_prefix_cache(llm)  # the second batch must load from the tiers
        params = [
            SamplingParams(
                max_tokens=8,
                temperature=0.0,
                logprobs=1,
                extra_args={"session_id": s, "tenant": TENANT},
            )
            for s in prompts
        ]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts.values()], params, use_tqdm=False
        )
        return dict(zip(prompts, outs, strict=True))

    batch()  # first turns, saved side by side
    second = batch()  # both load their own blocks in the same step
    for sid, out in second.items():
        # the same prompt again: its blocks and its tail up to the prompt's last token
        assert out.num_cached_tokens == len(prompts[sid]) - 1
        assert list(out.outputs[0].token_ids) == refs[sid].tokens
        lps = [
            lp[t].logprob
            for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)
        ]
        assert lps == pytest.approx(refs[sid].logprobs, abs=1e-3)


def test_prefetch_moves_session_to_ram(llm: Any, registry: Registry, kv_cache_dir: Path) -> None:
    from vllm import SamplingParams

    control = SessionControl(kv_cache_dir)
    control.update("E", TENANT, pinned=True)  # keeps E on disk whatever the policy thinks
    settle(llm)
    turn(llm, tokens(30, RAM_BLOCKS * BLOCK + 10), "G")  # E out of RAM
    assert tier_blocks(llm, registry, "E", ram=0, disk=3) == {"ram": 0, "disk": 3}  # 2 + a tail
    params = SamplingParams(
        max_tokens=1, extra_args={"lgkv_op": "prefetch", "session_id": "E", "tenant": TENANT}
    )  # the request SessionControl.prefetch sends through the engine client
    llm.generate([{"prompt_token_ids": [0]}], params, use_tqdm=False)
    assert registry.tier_usage(TENANT, "E")["ram"].blocks == 3
    control.update("E", TENANT, pinned=False)
    control.close()


def test_delete_removes_files_and_hits(llm: Any, registry: Registry, kv_cache_dir: Path) -> None:
    keys = registry.session_keys(TENANT, "A")
    control = SessionControl(kv_cache_dir)
    assert control.delete("A", TENANT) == 4  # 3 blocks + a tail

    def files() -> list[str]:
        return [k for k in keys if list((kv_cache_dir / "blocks").glob(f"*/*/*/{k}.kvb"))]

    assert files()  # recorded only: the engine owns the files
    turn(llm, tokens(9, 10), "other")  # its next step applies the drop; the worker unlinks
    deadline = time.monotonic() + 60
    while files() and time.monotonic() < deadline:
        turn(llm, tokens(9, 10), "other")
    assert not files()
    got = turn(llm, STATE["prompt2"], "A")
    assert got.num_cached_tokens == 0  # RAM copies were dropped too
    same_answer(got, STATE["ref"])
    control.close()


def llm_disk_budget(cache_dir: Path) -> int:
    manifest = json.loads(next((cache_dir / "blocks").glob(f"*/{MANIFEST_FILE}")).read_text())
    block = sum(manifest["layer_block_bytes"])
    return DISK_BLOCKS * (block + 256)
