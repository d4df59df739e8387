"""Expose ``SessionControl.metrics()`` on vLLM's ``/metrics``.

vLLM serves ``/metrics`` from a prometheus ``CollectorRegistry``; :class:`SessionMetricsCollector`
is registered there for the server's lifetime and turns each ``name{labels}: value`` sample of
``metrics()`` into a Prometheus sample at scrape time.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

_HELP = {
    "lgkv_hit_blocks_total": "KV blocks loaded from a tier instead of recomputed",
    "lgkv_hit_tails_total": "Partial tail blocks (a turn's last, partly filled block) loaded",
    "lgkv_hit_tail_tokens_total": "Tokens loaded from partial tail blocks",
    "lgkv_miss_blocks_total": "KV blocks looked up in no tier",
    "lgkv_saved_blocks_total": "KV blocks saved from the engine into the tiers",
    "lgkv_tier_bytes": "Bytes held by each tier",
    "lgkv_tier_blocks": "Blocks held by each tier",
    "lgkv_load_seconds_sum": "Seconds spent loading KV blocks",
    "lgkv_load_seconds_count": "KV load operations",
    "lgkv_save_seconds_sum": "Seconds spent saving KV blocks",
    "lgkv_save_seconds_count": "KV save operations",
    "lgkv_evicted_blocks_total": "Blocks evicted from each tier",
    "lgkv_sessions": "Sessions in the registry",
}


def parse_sample(key: str) -> tuple[str, dict[str, str]]:
    """Split ``'lgkv_tier_bytes{tier="ram"}'`` into its name and labels."""
    m = _SAMPLE.match(key.strip())
    if m is None:
        raise ValueError(f"not a Prometheus sample name: {key!r}")
    labels = dict(_LABEL.findall(m.group(2) or ""))
    return m.group(1), labels


class SessionMetricsCollector(Collector):
    """A prometheus collector reading ``source()`` (``SessionControl.metrics``) per scrape."""

    def __init__(self, source: Callable[[], dict[str, float]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        try:
            samples = self._source()
        except Exception:  # a scrape must not fail because the registry is busy
            log.exception("reading session KV metrics failed")
            return
        families: dict[str, Metric] = {}
        for key, value in sorted(samples.items()):
            try:
                name, labels = parse_sample(key)
            except ValueError:
                log.warning("skipping bad metric sample %r", key)
                continue
            family = families.get(name)
            if family is None:
                family = Metric(name, _HELP.get(name, name), "untyped")
                families[name] = family
            family.add_sample(name, labels, float(value))
        yield from families.values()

    def describe(self) -> list[Any]:
        return []  # collected lazily; nothing to check at registration
