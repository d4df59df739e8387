"""What the keyed server's tests send: the two keys, the server's flags, a long private prompt
and how a response shows another key's KV (tests/integration/server/test_server_tenants.py)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    import httpx

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
PROMPT = "Tenant test. " + " ".join(f"Line {i} of a long private prefix." for i in range(60))
# Generation routes vLLM 0.32 serves besides the three rewritten ones; each must be refused.
VLLM_GENERATION_ROUTES = (
    "/v1/responses/{response_id}",
    "/v1/messages",
    "/v1/chat/completions/batch",
    "/invocations",
    "/generative_scoring",
    "/inference/v1/generate",
)

KEYED_FLAGS: tuple[str, ...] = (
    "--api-key", "key-alice", "--api-key", "key-bob",  # both kept
    "--kv-ram-bytes", "8MiB", "--kv-disk-bytes", "32MiB",  # 64 RAM slots, 240 files
    "--tenant-pin-share", "0.1", "--tenant-max-sessions", "40",
    "--tenant-max-unleased-pins", "2", "--max-pin-lease", "3600",
    "--tenant-body-rate", "256KiB",  # a second large body waits seconds
    "--max-model-len", "4096",  # alice's long streams (test_one_key_cannot_fill_the_batch)
)  # fmt: skip
"""The keyed server: two keys, small tiers, tight quotas."""


def route_table(model_dir: Path) -> list[tuple[str, str]]:
    """(method, path) of every route vLLM's own app declares for this server's settings."""
    from vllm.entrypoints.launchers.app import build_app

    from server.config import ServerConfig
    from server.engine import build_vllm_args

    args = build_vllm_args(ServerConfig(model=str(model_dir), api_keys=("k",)))
    app = build_app(args, supported_tasks=("generate",), model_config=None)
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def concrete(path: str) -> str:
    """A route's path with each ``{parameter}`` filled in."""
    return re.sub(r"\{[^}]+\}", "x", path)


def chat_body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            **extra}  # fmt: skip


BLOCK = 128
"""Tokens per block on CPU. A key's request may read a block of its own up to its last shared
token (server/kv/scheduler/continuations.py): the chat template and the first words its
earlier prompts share, less than a block here, since no two prompts of a test share a first
block. Another key's KV would show as whole blocks: the prompts below are 600 tokens that the
other key has cached (>= 256 read back)."""


def own_only(cached: int) -> bool:
    """No block of another key's: less than one block read (only the key's own prefix)."""
    return cached < BLOCK


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage["input_tokens_details"]  # responses
    return int(details["cached_tokens"])
