"""The connector's scheduler side: on vLLM's scheduler thread, never imports torch, never blocks.

- :mod:`.scheduler`: ``SessionKVScheduler``, which decides each step (``StepPlan``);
- :mod:`.requests`, :mod:`.index`, :mod:`.policy`, :mod:`.tails`: what it knows (requests,
  which blocks live in which tier, eviction order, tail blocks);
- :mod:`.registry_sync`, :mod:`.redis_lookups`, :mod:`.publisher`, :mod:`.control_ops`: its
  background threads and bookkeeping (registry, Redis existence checks, counters, held
  prefetch/sync requests);
- :mod:`.ranks`, :mod:`.usage`, :mod:`.recovery`: tensor-parallel reports, cached-token
  accounting, start-up checks and full-disk handling.

It reaches the worker only through :mod:`server.kv.metadata`; it imports the registry
(:mod:`server.kv.registry`) and, for lookups and start-up scans, the tiers' plain parts.
"""
