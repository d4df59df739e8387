"""Every call stream of an agent thread keeps its context (a session is a tree): a tool's own
model call, a summarizer, parallel ``Send`` branches, a rewind and a fork each read >= 99% of
the prompt + answer of the earlier call they extend. The scenarios are
benchmarks/agent_streams.py's, here on the shared SmolLM2 server with fewer turns (its answers
are text that the next prompt renders back token for token; a random-weight model's are not,
so only its prompts would count); the covers are printed (``pytest -s``)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from benchmarks.agent_streams import SCENARIOS, run_all, summary

pytestmark = pytest.mark.vllm

GOAL = 0.99


def test_every_stream_reads_the_call_it_extends(smollm2_server: Any, tmp_path: Path) -> None:
    server = smollm2_server
    results = run_all(server.base_url, server.model, tmp_path / "db", 3, 16, uuid.uuid4().hex)
    for kind in SCENARIOS:
        print(f"\n{kind}: {summary(results[kind])}")
    for kind in SCENARIOS:
        covers = results[kind].covers
        assert covers, f"{kind}: no call measured"
        assert min(covers) >= GOAL, f"{kind}: {summary(results[kind])}; calls {results[kind].calls}"
