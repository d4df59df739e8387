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

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

_HELP = {
    "lgkv_hit_blocks": "KV blocks loaded from a tier instead of recomputed, by tier",
    "lgkv_hit_tails": "Partial tail blocks (a turn's last, partly filled block) loaded, by tier",
    "lgkv_hit_tail_tokens": "Tokens loaded from partial tail blocks, by tier",
    "lgkv_hit_shifted_blocks": "KV blocks filled by shifted reuse (lgkv_reuse: shifted)",
    "lgkv_hit_shifted_tokens": "Tokens loaded by shifted reuse at another position than stored",
    "lgkv_hit_shifted_sources": "Stored blocks shifted reuse read, by tier (disk: read first)",
    "lgkv_miss_blocks": "KV blocks looked up in no tier (computed by prefill)",
    "lgkv_evicted_blocks": "Blocks evicted from each tier",
    "lgkv_tier_bytes": "Bytes each tier holds now (stored, i.e. compressed, bytes)",
    "lgkv_tier_blocks": "Blocks each tier holds now",
    "lgkv_kv_compression_ratio": "Engine bytes per stored byte of a block (--kv-offload-dtype)",
    "lgkv_sessions": "Sessions in the registry",
}
"""Help text per metric family; every sample ``metrics()`` returns belongs to one of these."""


def family_of(name: str) -> tuple[str, str]:
    """The Prometheus family and type of a sample name.

    ``*_total`` samples are counters of the family without the suffix, anything else a gauge.
    (The worker's durations are histograms on vLLM's stats path: :mod:`server.kv.stats`.)
    """
    if name.endswith("_total"):
        return name[: -len("_total")], "counter"
    return name, "gauge"


def parse_sample(key: str) -> tuple[str, dict[str, str]]:
    """Split ``'lgkv_tier_bytes{tier="ram"}'`` into its name and labels."""
    m = _SAMPLE.fullmatch(key.strip())
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
            fname, kind = family_of(name)
            family = families.get(fname)
            if family is None:
                family = Metric(fname, _HELP.get(fname, fname), kind)
                families[fname] = family
            family.add_sample(name, labels, float(value))
        yield from families.values()

    def describe(self) -> list[Any]:
        return []  # collected lazily; nothing to check at registration
