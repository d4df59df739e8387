"""The registry's Prometheus samples for ``/metrics``: the engine's counters and tier gauges
(this replica's, from the local file) and the number of sessions. No torch, no vLLM."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from server.kv.registry.api import RegistryUnavailable

if TYPE_CHECKING:
    from server.kv.registry.api import EngineRegistry

log = logging.getLogger(__name__)

_COUNTERS = (
    'lgkv_hit_blocks_total{tier="ram"}',
    'lgkv_hit_blocks_total{tier="disk"}',
    'lgkv_hit_blocks_total{tier="redis"}',
    'lgkv_hit_tails_total{tier="ram"}',
    'lgkv_hit_tails_total{tier="disk"}',
    "lgkv_hit_tail_tokens_total",
    "lgkv_hit_shifted_blocks_total",
    "lgkv_hit_shifted_tokens_total",
    'lgkv_hit_shifted_sources_total{tier="ram"}',
    'lgkv_hit_shifted_sources_total{tier="disk"}',
    "lgkv_miss_blocks_total",
    'lgkv_evicted_blocks_total{tier="ram"}',
    'lgkv_evicted_blocks_total{tier="disk"}',
    'lgkv_evicted_blocks_total{tier="redis"}',
    'lgkv_tier_bytes{tier="ram"}',
    'lgkv_tier_bytes{tier="disk"}',
    'lgkv_tier_bytes{tier="redis"}',
    'lgkv_tier_blocks{tier="ram"}',
    'lgkv_tier_blocks{tier="disk"}',
    'lgkv_tier_blocks{tier="redis"}',
)

"""The samples every answer carries (0 before the engine published any)."""


def registry_samples(registry: EngineRegistry) -> dict[str, float]:
    """This replica's engine counters (local), and the number of sessions (of every replica
    with Redis; left out while Redis is unreachable)."""
    stored = registry.stats()
    out = {name: float(stored.get(name, 0.0)) for name in _COUNTERS}
    out.update({k: v for k, v in stored.items() if k.startswith("lgkv_kv_compression_ratio")})
    try:
        out["lgkv_sessions"] = float(registry.count_sessions())
    except RegistryUnavailable as exc:
        log.warning("lgkv_sessions left out of /metrics: %s", exc)
    return out
