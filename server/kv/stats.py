"""The worker's own measurements, on vLLM's KV connector stats path.

What a worker measures (how long each load and each save took, how many blocks it copied into
RAM) is not state: it travels the way vLLM's own connectors report transfers. Each step the
model runner asks the worker side for :class:`SessionKVStats` (``get_kv_connector_stats``),
vLLM adds the stats of every rank into the step's ``KVConnectorOutput`` and the scheduler's
``SchedulerStats``, and in the API process vLLM's stat loggers rebuild them
(``build_kv_connector_stats``), log a summary every interval and hand them to
:class:`SessionKVPromMetrics` (``build_prom_metrics``), which observes them into histograms and
a counter on vLLM's ``/metrics``, labelled by model and engine like vLLM's own.

The scheduler side's counters (hits and misses per tier, evictions) and the tiers' gauges stay
in the replica's registry file: they are state that offline tools and tests read without an
API server, and they survive an engine restart.

Payload (``data``, plain lists and numbers, so it crosses processes as is)::

    {"load_seconds": [0.003, ...], "save_seconds": [...], "saved_blocks": 12}

With ``--disable-log-stats`` vLLM records no stats, and these metrics stay at zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

LOAD_SECONDS = "lgkv_load_seconds"
SAVE_SECONDS = "lgkv_save_seconds"
SAVED_BLOCKS = "lgkv_saved_blocks"

HELP = {
    LOAD_SECONDS: "Seconds the worker spent loading KV blocks from the tiers, per load",
    SAVE_SECONDS: "Seconds the worker spent per step's RAM copies and per disk write",
    SAVED_BLOCKS: "KV blocks the worker copied from the engine into the RAM tier",
}
"""Help text of each metric family this module exposes."""

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _empty() -> dict[str, Any]:
    return {"load_seconds": [], "save_seconds": [], "saved_blocks": 0}


@dataclass
class SessionKVStats(KVConnectorStats):
    """Durations and block counts of one interval, from one worker or added over several."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Forget every observation."""
        self.data = _empty()

    def observe_load(self, seconds: float) -> None:
        """One finished load job took ``seconds``."""
        self.data["load_seconds"].append(seconds)

    def observe_save(self, seconds: float, blocks: int = 0) -> None:
        """One step's RAM copy of ``blocks`` blocks, or one disk write, took ``seconds``."""
        self.data["save_seconds"].append(seconds)
        self.data["saved_blocks"] += blocks

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s observations to these (another rank's, or a later step's)."""
        if not other.is_empty():
            data = other.data
            self.data["load_seconds"].extend(data.get("load_seconds", ()))
            self.data["save_seconds"].extend(data.get("save_seconds", ()))
            self.data["saved_blocks"] += int(data.get("saved_blocks", 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few numbers, for vLLM's periodic log line."""
        loads, saves = self.data["load_seconds"], self.data["save_seconds"]
        return {
            "loads": len(loads),
            "load_ms_avg": round(1000 * sum(loads) / len(loads), 3) if loads else 0.0,
            "saves": len(saves),
            "save_ms_avg": round(1000 * sum(saves) / len(saves), 3) if saves else 0.0,
            "saved_blocks": self.data["saved_blocks"],
        }

    def is_empty(self) -> bool:
        """True when nothing was observed."""
        d = self.data
        return not (d.get("load_seconds") or d.get("save_seconds") or d.get("saved_blocks"))

    def take(self) -> SessionKVStats | None:
        """The observations so far (None when there are none); this object starts empty."""
        if self.is_empty():
            return None
        taken = SessionKVStats(data=self.data)
        self.reset()
        return taken


class SessionKVPromMetrics(KVConnectorPromMetrics):
    """``lgkv_load_seconds``, ``lgkv_save_seconds`` (histograms) and ``lgkv_saved_blocks_total``
    on vLLM's Prometheus registry, one labelled child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_ours()  # a second app in one process (tests) re-creates them

        def histogram(name: str) -> Any:
            metric = self._histogram_cls(
                name=name, documentation=HELP[name], buckets=list(_BUCKETS), labelnames=labelnames
            )
            return {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

        self._load = histogram(LOAD_SECONDS)
        self._save = histogram(SAVE_SECONDS)
        saved = self._counter_cls(
            name=SAVED_BLOCKS, documentation=HELP[SAVED_BLOCKS], labelnames=labelnames
        )
        self._saved = {i: saved.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's stats (every rank's, added) of engine ``engine_idx``."""
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self._load[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("save_seconds", ()):
            self._save[engine_idx].observe(seconds)
        if blocks := transfer_stats_data.get("saved_blocks", 0):
            self._saved[engine_idx].inc(blocks)


def _unregister_ours() -> None:
    from prometheus_client import REGISTRY

    names = {LOAD_SECONDS, SAVE_SECONDS, SAVED_BLOCKS, SAVED_BLOCKS + "_total"}
    # As vLLM's own ``unregister_vllm_metrics``: the registry has no public lookup by name.
    for collector, registered in list(REGISTRY._collector_to_names.items()):
        if names & set(registered):
            REGISTRY.unregister(collector)
