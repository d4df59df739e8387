"""Shifted reuse on the real server: a trimmed history is loaded from the session's stored
blocks at new positions, and its approximate KV never reaches a request that did not ask.

The server runs a one-layer random-weight Llama (weights at a standard deviation of 0.1, so
the text depends on the context): with one layer a token's KV depends only on the token and
its position, so KV moved to other positions with its keys re-rotated is what recompute
gives, and greedy outputs must be identical to a cache-off run. (With more layers shifted KV
is approximate: ``benchmarks/context_edits.py --shifted`` measures how far.)
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import ServerFactory, ServerProcess

pytestmark = pytest.mark.vllm

rng = random.Random(7)
SYSTEM = [rng.randrange(100, 40000) for _ in range(40)]
OLD = [rng.randrange(100, 40000) for _ in range(300)]
KEPT = [rng.randrange(100, 40000) for _ in range(500)]
NEW = [rng.randrange(100, 40000) for _ in range(30)]
RAM_SLOTS = 32
"""RAM tier blocks (2 MiB of 64 KiB blocks: one layer, 2 KV heads of 32, 128 tokens, float32)."""


@pytest.fixture(scope="module")
def one_layer_server(start_server: ServerFactory, smollm2_dir: Path) -> ServerProcess:
    from server.model import build_tiny_model, default_cache_dir

    model = build_tiny_model(
        default_cache_dir() / "models" / "tiny-llama-1layer",
        tokenizer_from=smollm2_dir,
        layers=1,
        std=0.1,
    )
    return start_server("--kv-reuse", "shifted", "--kv-ram-bytes", "2MiB", model_dir=model)


def _complete(c: httpx.Client, model: str, prompt: list[int], **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
    return c.post("/v1/completions", json=body)


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _shifted_tokens(
    c: httpx.Client, at_least: float, sample: str = "lgkv_hit_shifted_tokens_total"
) -> float:
    """``sample`` (a counter) once it reaches ``at_least`` (the engine publishes its counters
    every few milliseconds), or its value after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        line = rf"^{re.escape(sample)} (\S+)$"
        found = re.search(line, c.get("/metrics").text, re.M)
        value = float(found.group(1)) if found else 0.0
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_a_trimmed_history_is_loaded_shifted_and_answers_as_recompute(
    one_layer_server: ServerProcess,
) -> None:
    server = one_layer_server
    exact = {"lgkv_reuse": "exact"}
    with server.client() as c:
        first = _complete(c, server.model, SYSTEM + OLD + KEPT, session_id="trim")
        assert _cached(first) == 0
        # the next turn drops OLD: its KEPT tokens now sit 300 positions earlier
        trimmed = SYSTEM + KEPT + NEW
        shifted = _complete(c, server.model, trimmed, session_id="trim")
        # everything before NEW: the system prompt in place, KEPT 300 positions earlier (its
        # last block in part: vLLM computes the rest of it, NEW)
        assert _cached(shifted) == len(SYSTEM) + len(KEPT)
        moved = len(KEPT)
        assert shifted.json()["kv_transfer_params"] == {"lgkv_shifted_tokens": moved}
        assert _shifted_tokens(c, moved) == moved
        reference = _complete(c, server.model, trimmed, cache_salt="ref", vllm_xargs=exact)
        assert _cached(reference) == 0
        assert shifted.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]

        # An exact request with the same text and session never finds the shifted blocks.
        after = _complete(c, server.model, trimmed, session_id="trim", vllm_xargs=exact)
        assert _cached(after) == 0
        assert after.json().get("kv_transfer_params") is None
        assert after.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_a_history_pushed_out_of_ram_is_loaded_shifted_from_disk(
    one_layer_server: ServerProcess,
) -> None:
    """The session's blocks left RAM for disk (other sessions filled the RAM tier): the
    shifted hit reads its sources from disk first, then answers as recompute."""
    server = one_layer_server
    old = [rng.randrange(100, 40000) for _ in range(300)]
    kept = [rng.randrange(100, 40000) for _ in range(500)]
    disk = 'lgkv_hit_shifted_sources_total{tier="disk"}'
    with server.client() as c:
        first = _complete(c, server.model, SYSTEM + old + kept, session_id="far")
        assert _cached(first) <= len(SYSTEM)  # the first test's system prompt, if it ran
        before = _shifted_tokens(c, 0, disk)
        for n in range(2):  # 2 x 15 blocks: with the others saved since, more than RAM holds
            filler = [rng.randrange(100, 40000) for _ in range(1900)]
            assert _cached(_complete(c, server.model, filler, session_id=f"filler{n}")) == 0
        assert RAM_SLOTS < 2 * 15 + 7
        trimmed = SYSTEM + kept + NEW
        shifted = _complete(c, server.model, trimmed, session_id="far")
        assert _cached(shifted) == len(SYSTEM) + len(kept)
        assert shifted.json()["kv_transfer_params"] == {"lgkv_shifted_tokens": len(kept)}
        assert _shifted_tokens(c, before + 1, disk) > before  # sources were read from disk
        exact = {"lgkv_reuse": "exact"}
        reference = _complete(c, server.model, trimmed, cache_salt="ref2", vllm_xargs=exact)
        assert _cached(reference) == 0
        assert shifted.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_an_unknown_reuse_mode_is_refused(one_layer_server: ServerProcess) -> None:
    with one_layer_server.client() as c:
        r = _complete(c, one_layer_server.model, NEW, vllm_xargs={"lgkv_reuse": "fuzzy"})
    assert r.status_code == 400
    assert "lgkv_reuse must be one of exact, shifted" in r.text


def test_after_a_restart_the_history_on_disk_is_loaded_shifted(
    one_layer_server: ServerProcess,
) -> None:
    """The token ids of the session's blocks come back from their files' header pages after
    a restart: the trimmed turn reads its history from disk at new positions, as recompute.
    The seam lies 2 tokens into a block: that block's 2 shared tokens, too few to be worth a
    disk read alone, lead the shifted hit."""
    server = one_layer_server
    system = SYSTEM + [rng.randrange(100, 40000) for _ in range(90)]  # 130: 2 into block 1
    old = [rng.randrange(100, 40000) for _ in range(300)]
    kept = [rng.randrange(100, 40000) for _ in range(500)]
    with server.client() as c:
        first = _complete(c, server.model, system + old + kept, session_id="restarted")
        assert _cached(first) <= len(SYSTEM)
    server.restart()
    trimmed = system + kept + NEW
    with server.client() as c:
        shifted = _complete(c, server.model, trimmed, session_id="restarted")
        assert _cached(shifted) == len(system) + len(kept)
        assert shifted.json()["kv_transfer_params"] == {"lgkv_shifted_tokens": len(kept)}
        exact = {"lgkv_reuse": "exact"}
        reference = _complete(c, server.model, trimmed, cache_salt="ref3", vllm_xargs=exact)
        assert _cached(reference) == 0
        assert shifted.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]


def test_a_seam_inside_a_block_and_tokens_recomputed_after_it_by_an_earlier_request(
    one_layer_server: ServerProcess,
) -> None:
    """The exact match's last block in part leads the shifted hit. A seam 2 tokens into a
    128-token block (fewer than ``--kv-shift-min-run``) is found: the block's first tokens are
    read in place, the kept history after them shifted. And tokens an earlier request computed
    after the seam (a prefill of the trimmed prompt's start under another session: its tail)
    are read exactly, only the rest shifted."""
    server = one_layer_server
    system = SYSTEM + [rng.randrange(100, 40000) for _ in range(90)]  # 130: 2 into block 1
    exact = {"lgkv_reuse": "exact"}
    with server.client() as c:
        for session, recomputed in (("seam", 0), ("seam-recomputed", 20)):
            old = [rng.randrange(100, 40000) for _ in range(300)]
            kept = [rng.randrange(100, 40000) for _ in range(500)]
            _complete(c, server.model, system + old + kept, session_id=session)
            if recomputed:
                pre = _complete(c, server.model, system + kept[:recomputed], max_tokens=1,
                                session_id=f"{session}-pre")  # fmt: skip
                assert _cached(pre) == len(system)  # turn 1's block 1 shared up to the seam
            trimmed = system + kept + NEW
            shifted = _complete(c, server.model, trimmed, session_id=session)
            assert _cached(shifted) == len(system) + len(kept), session
            moved = {"lgkv_shifted_tokens": len(kept) - recomputed}
            assert shifted.json()["kv_transfer_params"] == moved, session
            ref = _complete(c, server.model, trimmed, cache_salt=session, vllm_xargs=exact)
            assert _cached(ref) == 0
            assert shifted.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
