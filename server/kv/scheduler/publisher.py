"""What the engine tells the registry: block locations, counters and gauges, throttled.

:class:`Publisher` collects the scheduler side's counters and the blocks this engine put in
Redis, and at most every ``stats_flush_s`` (or when forced) turns the index's changed blocks
and the current gauges into one :meth:`RegistrySync.publish` job. In memory only: the
registry thread does the writing, and merges publishes that wait behind a busy registry.
"""

from __future__ import annotations

import heapq
import time

from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.registry_sync import RegistrySync


class Publisher:
    """Counters, Redis presence and throttled publishes of one engine's scheduler side."""

    def __init__(
        self,
        sync: RegistrySync,
        *,
        block_bytes: int,
        stats_flush_s: float,
        redis_ttl_s: float,
        offload_dtype: str,
        compression_ratio: float,
    ) -> None:
        self.sync = sync
        self.block_bytes = block_bytes
        self.stats_flush_s = stats_flush_s
        self.redis_ttl_s = redis_ttl_s
        self.offload_dtype = offload_dtype
        self.compression_ratio = compression_ratio
        """Engine bytes over stored bytes of a block (``--kv-offload-dtype``), a gauge."""
        self.redis_until: dict[str, float] = {}
        """Blocks this engine put in Redis and when their TTL ends (for tier counts). Others
        may delete entries (a dropped block); the deadline queue skips what changed."""
        self._expiry: list[tuple[float, str]] = []
        """(TTL end, key) of ``redis_until``, a heap: a flush pops only what expired."""
        self._counters: dict[str, float] = {}
        self._last_flush = 0.0

    def count(self, name: str, value: float) -> None:
        """Add ``value`` to a counter (published as a delta)."""
        if value:
            self._counters[name] = self._counters.get(name, 0.0) + value

    def redis_written(self, key: str) -> None:
        """The worker wrote the block to Redis (its TTL starts now)."""
        until = self.redis_until[key] = time.time() + self.redis_ttl_s
        heapq.heappush(self._expiry, (until, key))
        if len(self._expiry) > 2 * len(self.redis_until) + 1024:  # drops left stale entries
            self._expiry = [(u, k) for k, u in self.redis_until.items()]
            heapq.heapify(self._expiry)

    def flush(self, index: BlockIndex, *, force: bool = False) -> None:
        """Queue the changed blocks' locations, the counters and the gauges (throttled unless
        ``force``). O(changed blocks + expired Redis entries)."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.stats_flush_s:
            return
        self._last_flush = now
        wall = time.time()
        expiry = self._expiry
        while expiry and expiry[0][0] < wall:
            until, key = heapq.heappop(expiry)
            if self.redis_until.get(key) == until:
                del self.redis_until[key]  # expired in Redis by now
                index.dirty.add(key)
        dirty, index.dirty = index.dirty, set()
        updates = {k: (*index.location(k), k in self.redis_until, self.block_bytes) for k in dirty}
        gauges = index.gauges(self.block_bytes, redis_blocks=len(self.redis_until))
        fmt = self.offload_dtype
        gauges[f'lgkv_kv_compression_ratio{{format="{fmt}"}}'] = self.compression_ratio
        counters = dict(self._counters)
        for tier, n in index.evicted.items():
            counters[f'lgkv_evicted_blocks_total{{tier="{tier}"}}'] = float(n)
        self.sync.publish(updates, counters, gauges)
        self._counters.clear()
        index.evicted = {"ram": 0, "disk": 0}
