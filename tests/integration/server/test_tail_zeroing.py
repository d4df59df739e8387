"""A saved tail block holds its own tokens only: the slots past its tokens are zeros.

vLLM hands a request paged blocks that earlier requests used, and the unused slots of a
request's partly filled last block still hold the KV those requests left there. Attention never
reads them, but a saved tail block keeps them in RAM, in its file and in Redis, past the
``DELETE`` of the session that wrote them. Here tenant A cycles its long prompts through every
paged block of a small KV cache and deletes its sessions; tenant B's short turn then gets one
of those blocks, and the tail it saves must hold B's tokens and zeros, nothing of A's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest

from tests.integration.conftest import TEST_ENGINE_ARGS, wait_until

if TYPE_CHECKING:
    from tests.integration.conftest import ServerFactory, ServerProcess

pytestmark = pytest.mark.vllm

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
PAGE = 4096  # the header page of a block file (server/kv/tiers/block_frame.py)
BOB_PROMPT = "Bob's short question about the weather in Lisbon, briefly."
BOB_ANSWER_TOKENS = 6


def _engine_args(**changes: str) -> list[str]:
    """:data:`TEST_ENGINE_ARGS` with some values changed (``max_model_len="1024"``)."""
    args = list(TEST_ENGINE_ARGS)
    for name, value in changes.items():
        args[args.index("--" + name.replace("_", "-")) + 1] = value
    return args


@pytest.fixture(scope="module")
def small_cache(start_server: ServerFactory) -> ServerProcess:
    # A paged cache of a few dozen blocks, so a few long prompts pass through all of them.
    return start_server(
        "--api-key", "key-alice", "--api-key", "key-bob",
        engine_args=_engine_args(kv_cache_memory_bytes="3MiB", max_model_len="1024"),
    )  # fmt: skip


def _num_gpu_blocks(c: httpx.Client, key: dict) -> int:
    text = c.get("/metrics", headers=key).text
    found = re.search(r'cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    assert found, "vLLM's /metrics has no cache_config_info"
    return int(found.group(1))


def _complete(
    c: httpx.Client,
    model: str,
    prompt: str | list[int],
    sid: str | None,
    max_tokens: int,
    key: dict,
) -> dict:
    body: dict[str, object] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True,
    }  # fmt: skip
    if sid is not None:
        body["session_id"] = sid
    r = c.post("/v1/completions", json=body, headers=key)
    assert r.status_code == 200, r.text
    return r.json()


def _tail_files(server: ServerProcess) -> dict[str, Path]:
    """Block files named by a tail key (longer than a full block's 64 hex characters)."""
    return {p.stem: p for p in (server.cache_dir / "blocks").rglob("*.kvb") if len(p.stem) > 64}


def _layers(server: ServerProcess, path: Path) -> list[np.ndarray]:
    """The payload of a block file, one flat array per layer in the engine's dtype."""
    manifest = json.loads((path.parents[2] / "manifest.json").read_text())
    assert manifest["offload_dtype"] == "auto"
    dtype = manifest["dtype"].removeprefix("torch.")
    raw = path.read_bytes()[PAGE:]
    out, offset = [], 0
    for size in manifest["layer_block_bytes"]:
        chunk = raw[offset : offset + size]
        if dtype == "bfloat16":  # numpy has no bfloat16: its bits are the high half of float32
            values = np.frombuffer(chunk, dtype=np.uint16).astype(np.uint32) << 16
            out.append(values.view(np.float32))
        else:
            out.append(np.frombuffer(chunk, dtype=np.dtype(dtype)))
        offset += size
    return out


def test_a_saved_tail_holds_no_other_tenants_kv(
    small_cache: ServerProcess, plain_server: ServerProcess
) -> None:
    model = small_cache.model
    with small_cache.client() as c:
        blocks = _num_gpu_blocks(c, ALICE)
        # Tenant A: distinct long prompts (no prefix hits) until every paged block held A's KV
        # twice over (vLLM hands out free blocks in the order they were freed).
        used, i = 0, 0
        while used < 2 * blocks * 128:
            prompt = f"Alice {i}: " + " ".join(f"secret line {i}.{j} of ours." for j in range(90))
            answer = _complete(c, model, prompt, f"alice-{i}", 1, ALICE)
            used += answer["usage"]["prompt_tokens"]
            i += 1
        for j in range(i):
            gone = c.delete(f"/v1/sessions/alice-{j}", headers=ALICE)
            assert gone.status_code == 200 and gone.json()["files_removed"], gone.text
        assert not _tail_files(small_cache), "tenant A's files outlived its DELETE"

        # Tenant B: one short turn; its only block is a tail.
        first = _complete(c, model, BOB_PROMPT, "bob", BOB_ANSWER_TOKENS, BOB)
        wait_until(lambda: _tail_files(small_cache), "Bob's tail block file", timeout_s=60)
        (key, path), = _tail_files(small_cache).items()  # fmt: skip
        tokens = int(key[-4:], 16)  # a tail key ends with its token count (server/kv/keys.py)
        assert tokens == first["usage"]["prompt_tokens"] + BOB_ANSWER_TOKENS - 1
        for layer in _layers(small_cache, path):
            per_token = layer.size // 128
            nonzero = int(np.count_nonzero(layer))
            # Bob's tokens are there (random weights: no exact zeros), and nothing else is.
            assert nonzero <= tokens * per_token, (nonzero, tokens * per_token)
            assert nonzero >= 0.99 * tokens * per_token, (nonzero, tokens * per_token)

        # Bob's next turn (token for token: its turn so far and more) loads the zeroed tail
        # and answers as a plain recompute does.
        ids = first["choices"][0]["prompt_token_ids"] + first["choices"][0]["token_ids"]
        ids += [1000, 2000, 3000]
        second = _complete(c, model, ids, "bob", 8, BOB)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens
        with plain_server.client() as p:
            plain = _complete(p, plain_server.model, ids, None, 8, {})
        assert second["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
