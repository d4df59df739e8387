"""A short version of benchmarks/load.py in the suite: 8 conversations at once against the shared
server, session API calls during the load, every answer equal to a cache-off server's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from load import CONCURRENT_HEADER, HEADER, concurrent_summary, differing, run_load, summary

if TYPE_CHECKING:
    from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.vllm


def test_concurrent_conversations_with_session_churn_answer_as_cache_off(
    lgkv_server: ServerProcess, plain_server: ServerProcess
) -> None:
    ours = run_load(lgkv_server.base_url, lgkv_server.model, conversations=8, turns=3,
                    max_tokens=8, api_calls=6, session_prefix="load")  # fmt: skip
    plain = plain_server
    reference = run_load(plain.base_url, plain.model, conversations=8, turns=3, max_tokens=8,
                         session_prefix="load")  # fmt: skip
    print("\n" + HEADER)
    print(summary("langgraph-kvcache", ours, reference))
    print(summary("cache off", reference, None))
    print(CONCURRENT_HEADER)  # the figures of `load.py --mode concurrent` for the same runs
    print(concurrent_summary("langgraph-kvcache", ours, reference))
    print(concurrent_summary("cache off", reference, None))
    assert reference.errors == []
    assert ours.errors == [] and ours.server_errors == 0
    assert ours.api_errors == [] and ours.api_calls == 30
    assert ours.in_flight_at_end == 0
    assert len(ours.answers) == len(reference.answers) == 24
    assert differing(ours, reference) == []
    assert ours.cached_tokens > 0  # later turns loaded their history
    same = concurrent_summary("langgraph-kvcache", ours, reference).split("|")[-2].strip()
    assert same == "24/24"
