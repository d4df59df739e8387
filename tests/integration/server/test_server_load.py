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


def test_session_api_answers_while_a_full_batch_generates(lgkv_server: ServerProcess) -> None:
    """The session API reads and writes the registry, never waiting behind generation: with
    every one of the engine's 8 sequences busy on a long generation, GET/PATCH/pin/unpin of a
    session answer at once (each waited for a slot in the batch through an engine barrier, up
    to 60 s), and prefetch within its bound. benchmarks/load.py --mode api carries the
    figures; the bound here is generous for CI."""
    import statistics
    import threading
    import time

    server = lgkv_server
    with server.client() as c:
        prompt = "Under load. " + " ".join(f"Fact {i} of this session." for i in range(60))
        body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "session_id": "api-load"}
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert c.get("/v1/sessions/api-load").json()["num_blocks"] >= 1  # its turn is seen

        def generate(i: int) -> None:
            body = {"model": server.model, "prompt": f"Long run {i}.", "max_tokens": 1900,
                    "ignore_eos": True, "session_id": f"api-load-long-{i}"}  # fmt: skip
            with server.client() as own:
                own.post("/v1/completions", json=body).raise_for_status()

        runs = [threading.Thread(target=generate, args=(i,)) for i in range(8)]
        for run in runs:
            run.start()
        time.sleep(2.0)  # the batch is full
        timings: dict[str, list[float]] = {"get": [], "patch": [], "pin": [], "prefetch": []}
        calls = {
            "get": lambda: c.get("/v1/sessions/api-load"),
            "patch": lambda: c.patch("/v1/sessions/api-load", json={"ttl_seconds": 3600}),
            "pin": lambda: c.post("/v1/sessions/api-load/pin", json={"pin_ttl_seconds": 60}),
            "prefetch": lambda: c.post("/v1/sessions/api-load/prefetch"),
        }
        rounds = 0
        while rounds < 4 and all(run.is_alive() for run in runs):  # calls while the batch is full
            for name, call in calls.items():
                t0 = time.perf_counter()
                r = call()
                timings[name].append(time.perf_counter() - t0)
                assert r.status_code == 200, (name, r.text)
            rounds += 1
        for run in runs:
            run.join()
        for name, values in timings.items():
            print(f"{name}: p50 {statistics.median(values) * 1e3:.1f} ms, "
                  f"max {max(values) * 1e3:.1f} ms")  # fmt: skip
        assert rounds >= 2, "the generations ended before the calls: make them longer"
        for name in ("get", "patch", "pin"):
            assert max(timings[name]) < 5.0, (name, timings[name])
        assert max(timings["prefetch"]) < 10.0, timings["prefetch"]
