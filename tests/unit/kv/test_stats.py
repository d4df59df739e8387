"""The worker's stats on vLLM's connector stats path: payload, aggregation, Prometheus."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from server.kv.connector import SessionKVConnector
from server.kv.stats import SessionKVPromMetrics, SessionKVStats


def test_payload_aggregates_and_reduces() -> None:
    a, b = SessionKVStats(), SessionKVStats()
    assert a.is_empty() and a.take() is None
    a.observe_load(0.002)
    a.observe_save(0.004, blocks=3)
    b.observe_save(0.010)  # a disk write: no RAM copy counted
    total = a.aggregate(b)
    want = {"load_seconds": [0.002], "save_seconds": [0.004, 0.010], "saved_blocks": 3}
    assert total.data == want
    assert total.reduce() == {
        "loads": 1, "load_ms_avg": 2.0, "saves": 2, "save_ms_avg": 7.0, "saved_blocks": 3,
    }  # fmt: skip
    # What crosses the process boundary is the plain dict; the API process rebuilds the stats.
    rebuilt = SessionKVConnector.build_kv_connector_stats(total.to_dict())
    assert isinstance(rebuilt, SessionKVStats) and rebuilt.data == total.data
    assert SessionKVConnector.build_kv_connector_stats(None).is_empty()


def _sample(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_prom_metrics_observe_per_engine() -> None:
    config = SimpleNamespace(kv_transfer_config=None)
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    names, labels = ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}
    for _ in range(2):  # built twice in one process (a second app): no duplicate error
        prom = SessionKVConnector.build_prom_metrics(config, types, names, labels)
    assert isinstance(prom, SessionKVPromMetrics)
    prom.observe({"load_seconds": [0.002, 0.3], "save_seconds": [0.01], "saved_blocks": 4}, 1)
    one = {"model_name": "m", "engine": "1"}
    assert _sample("lgkv_load_seconds_count", one) == 2
    assert _sample("lgkv_load_seconds_sum", one) == pytest.approx(0.302)
    assert _sample("lgkv_load_seconds_bucket", {**one, "le": "0.0025"}) == 1
    assert _sample("lgkv_save_seconds_count", one) == 1
    assert _sample("lgkv_saved_blocks_total", one) == 4
    assert _sample("lgkv_saved_blocks_total", {"model_name": "m", "engine": "0"}) == 0
