"""Our KV samples on vLLM's Prometheus registry, from a real SessionControl."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from server.api.metrics import SessionMetricsCollector, family_of, parse_sample
from server.kv.registry.control import SessionControl


def test_parse_sample() -> None:
    assert parse_sample('lgkv_tier_bytes{tier="ram"}') == ("lgkv_tier_bytes", {"tier": "ram"})
    assert parse_sample("lgkv_sessions") == ("lgkv_sessions", {})
    with pytest.raises(ValueError):
        parse_sample("not a metric!")


def test_collector_exposes_every_contract_sample(tmp_path: Path) -> None:
    control = SessionControl(tmp_path)
    try:
        control.create("m-1", "default")
        control.create("m-2", "default")
        registry = CollectorRegistry()
        registry.register(SessionMetricsCollector(control.metrics))
        text = generate_latest(registry).decode()
    finally:
        control.close()
    assert "lgkv_sessions 2.0" in text
    for name in (
        'lgkv_hit_blocks_total{tier="ram"}',
        'lgkv_hit_blocks_total{tier="disk"}',
        "lgkv_miss_blocks_total",
        'lgkv_tier_bytes{tier="disk"}',
        'lgkv_tier_blocks{tier="ram"}',
        'lgkv_evicted_blocks_total{tier="ram"}',
    ):
        assert name in text, name


def lgkv_families(text: str) -> dict[str, tuple[str, str]]:
    """``{family: (type, help)}`` of the ``lgkv_`` families in a Prometheus text scrape."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == "#" and parts[2].startswith("lgkv_"):
            (helps if parts[1] == "HELP" else types)[parts[2]] = parts[3]
    return {name: (types.get(name, ""), helps.get(name, "")) for name in helps | types}


def test_family_of() -> None:
    assert family_of("lgkv_hit_blocks_total") == ("lgkv_hit_blocks", "counter")
    assert family_of("lgkv_tier_bytes") == ("lgkv_tier_bytes", "gauge")


def test_every_family_is_typed_and_explained(tmp_path: Path) -> None:
    control = SessionControl(tmp_path)
    try:
        registry = CollectorRegistry()
        registry.register(SessionMetricsCollector(control.metrics))
        text = generate_latest(registry).decode()
    finally:
        control.close()
    families = lgkv_families(text)
    assert families["lgkv_hit_blocks_total"][0] == "counter"
    assert families["lgkv_tier_bytes"][0] == "gauge"
    for name, (kind, help_text) in families.items():
        assert kind in {"counter", "gauge"}, (name, kind)
        base = name.removesuffix("_total")
        assert help_text and help_text != base, f"{name} has no help text"


def test_a_failing_source_does_not_break_the_scrape() -> None:
    def broken() -> dict[str, float]:
        raise RuntimeError("registry locked")

    registry = CollectorRegistry()
    registry.register(SessionMetricsCollector(broken))
    assert "lgkv" not in generate_latest(registry).decode()
