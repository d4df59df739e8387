"""Scheduler side of the connector: lookups, load/save/prefetch plans, session bookkeeping.

Runs in vLLM's scheduler (engine-core process). No torch: it sees requests only through
``request_id``, ``block_hashes``, ``num_tokens``, ``num_computed_tokens`` and
``sampling_params.extra_args``, and talks to the worker through :class:`StepPlan` and
:class:`WorkerReport`.

Verbs, per request:
- ``get_num_new_matched_tokens``: longest run of the request's next full blocks found in RAM
  or on disk (never the whole prompt: vLLM must compute at least one token). All-RAM hits
  load synchronously; any disk block makes the load asynchronous.
- ``update_state_after_alloc``: turns the lookup into a :class:`LoadJob` on the blocks vLLM
  allocated, locking the RAM slots read.
- ``build_plan`` (each step): saves of every block a scheduled request completes this step,
  with RAM slots and disk space reserved (evicting by :class:`EvictionPolicy`).
- ``request_finished``: records the session's turn in the registry (block list, tokens, gap).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from langgraph_kvcache.contract import (
    DEFAULT_TENANT,
    PREFETCH_OP,
    SYNC_OP,
    XARG_OP,
    XARG_SESSION,
    XARG_TENANT,
)
from server.kv.index import BlockIndex, BlockState
from server.kv.keys import block_key
from server.kv.metadata import NO_SLOT, LoadItem, LoadJob, SaveItem, StepPlan, WorkerReport
from server.kv.policy import EvictionPolicy
from server.kv.registry import Registry
from server.kv.settings import ConnectorSettings
from server.kv.tiers.redis import RedisStore

log = logging.getLogger(__name__)

_NO_STATE = BlockState("")
_PURGE_EVERY_S = 10.0
_IDLE_POLL_S = 0.002


@dataclass
class _Tracked:
    """A request the scheduler side follows until it finishes."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0
    session: tuple[str, str] | None = None
    op: str | None = None


@dataclass
class _Lookup:
    start: int
    keys: list[str]
    tiers: list[str]
    misses: int


class SessionKVScheduler:
    """Decides what moves where; the worker only executes its plans."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        block_size: int,
        block_bytes: int,
        file_bytes: int,
        disk_files: dict[str, int],
        registry: Registry | None = None,
        redis: RedisStore | None = None,
        compression_ratio: float = 1.0,
    ) -> None:
        self.settings = settings
        self.compression_ratio = compression_ratio
        """Engine bytes over stored bytes of a block (``--kv-offload-dtype``), a gauge."""
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.file_bytes = file_bytes
        # The engine never waits long on the API process: a busy registry is skipped (logged).
        self.registry = registry or Registry(settings.registry_path, busy_timeout_s=2.0)
        self.redis = redis
        self._redis_until: dict[str, float] = {}
        """Blocks this engine put in Redis and when their TTL ends (for tier counts)."""
        self.policy = EvictionPolicy(settings.default_gap_s, settings.min_gap_s)
        num_slots = settings.ram_bytes // block_bytes if block_bytes else 0
        self.index = BlockIndex(
            num_slots=num_slots,
            file_bytes=file_bytes,
            disk_bytes=settings.disk_bytes if num_slots else 0,
            policy=self.policy,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._held: dict[str, set[str]] = {}
        """Control requests (prefetch, sync) held until these keys' reads or removals finish."""
        self._removing: set[str] = set()
        """Keys whose file removal was planned and not yet confirmed by the worker."""
        self._plan = StepPlan()
        self._counters: dict[str, float] = {}
        self._last_flush = 0.0
        self._last_purge = 0.0
        self._data_version = -1
        self._drop_seq = self.registry.last_drop_seq()
        self._load_snapshot()
        self.registry.reset_block_tiers()
        for key, size in sorted(disk_files.items()):
            if size != file_bytes or not self.index.add_disk_file(key):
                self.index.removes.append(key)  # wrong size or over budget
        self.flush(force=True)

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` and whether the load is async."""
        self._sync_registry()
        tracked = self._track(request)
        if tracked.op == PREFETCH_OP:
            return self._prefetch_step(request.request_id, tracked)
        if tracked.op == SYNC_OP:
            return self._sync_step(request.request_id)
        hashes = request.block_hashes
        start = num_computed_tokens // self.block_size
        end = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        keys: list[str] = []
        tiers: list[str] = []
        for i in range(start, end):
            key = block_key(hashes[i])
            tier = self.index.tier_of(key)
            if tier is None:
                break
            keys.append(key)
            tiers.append(tier)
        if self.redis is not None and start + len(keys) < end:
            rest = [block_key(h) for h in hashes[start + len(keys) : end]]
            for key, found in zip(rest, self.redis.exists_many(rest), strict=True):
                if not found:
                    break
                keys.append(key)
                tiers.append("redis")
        misses = max(0, end - start - len(keys))
        self._lookups[request.request_id] = _Lookup(start, keys, tiers, misses)
        if not keys:
            return 0, False
        return len(keys) * self.block_size, any(t != "ram" for t in tiers)

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Turn the request's lookup into a load job on the blocks vLLM allocated."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        count = num_external_tokens // self.block_size
        self._count("lgkv_miss_blocks_total", lookup.misses + len(lookup.keys) - count)
        if count == 0:
            return
        keys, tiers = lookup.keys[:count], lookup.tiers[:count]
        unslotted = [
            k
            for k, t in zip(keys, tiers, strict=True)
            if t != "ram" and self.index.blocks.get(k, _NO_STATE).slot == NO_SLOT
        ]
        promote = self.index.alloc_slots(len(unslotted), protect=set(keys))
        items: list[LoadItem] = []
        for offset, (key, tier) in enumerate(zip(keys, tiers, strict=True)):
            block_id = block_ids[lookup.start + offset]
            self._count(f'lgkv_hit_blocks_total{{tier="{tier}"}}', 1)
            self.index.touch(key)
            if tier == "ram":
                state = self.index.blocks[key]
                state.locks += 1
                items.append(LoadItem(block_id, key, state.slot, "ram"))
                continue
            slot = NO_SLOT
            state = self.index.blocks.get(key)
            if promote and (state is None or state.slot == NO_SLOT):
                slot = promote.pop()
                state = self.index.blocks.setdefault(key, BlockState(key))
                state.slot, state.ram_ready = slot, False
                state.locks += 1
            items.append(LoadItem(block_id, key, slot, tier))
        for slot in promote:  # not needed after all
            self.index.free_slots.append(slot)
        self._plan.loads.append(
            LoadJob(request.request_id, tuple(items), any(t != "ram" for t in tiers))
        )

    # -------------------------------------------------------------------- plans

    def build_plan(
        self,
        scheduled: list[tuple[str, list[int] | None, bool, int]],
        num_scheduled_tokens: dict[str, int],
    ) -> StepPlan:
        """The step's plan. ``scheduled``: (req id, new block ids or None, replaces the old
        list, computed tokens before this step) for every request scheduled this step."""
        self._sync_registry()
        wanted: list[tuple[int, str]] = []
        for req_id, new_ids, replace, num_computed in scheduled:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if new_ids is not None:
                tracked.block_ids = list(new_ids) if replace else tracked.block_ids + new_ids
            if tracked.op is not None or not self.index.num_slots:
                continue
            done = num_computed + num_scheduled_tokens.get(req_id, 0)
            hashes = tracked.request.block_hashes
            full = min(done // self.block_size, len(hashes), len(tracked.block_ids))
            for i in range(tracked.saved_upto, full):
                key = block_key(hashes[i])
                if key in self.index.blocks:
                    self.index.touch(key)
                elif all(key != k for _, k in wanted):
                    wanted.append((tracked.block_ids[i], key))
            tracked.saved_upto = max(tracked.saved_upto, full)
        if wanted:
            self._plan_saves(wanted)
        if not scheduled and self._plan.is_empty() and not self.index.removes:
            # Nothing runs: the engine only polls for loads or writes to finish. Yield the
            # CPU (and the GIL) to the I/O thread instead of spinning.
            time.sleep(_IDLE_POLL_S)
        plan, self._plan = self._plan, StepPlan()
        plan.removes, self.index.removes = self.index.removes, []
        self._removing.update(plan.removes)
        return plan

    def _plan_saves(self, wanted: list[tuple[int, str]]) -> None:
        keys = {k for _, k in wanted}
        slots = self.index.alloc_slots(len(wanted), protect=keys)
        for (block_id, key), slot in zip(wanted, slots, strict=False):
            to_disk = self.index.reserve_disk(protect=keys)
            self.index.new_block(key, slot, to_disk)
            self._plan.saves.append(SaveItem(block_id, key, slot, to_disk, self.redis is not None))
        if len(slots) < len(wanted):
            log.warning(
                "RAM tier full of locked blocks: %d blocks not saved", len(wanted) - len(slots)
            )

    # ------------------------------------------------------------------ reports

    def on_report(self, report: WorkerReport) -> None:
        """Apply the worker's completions to the index."""
        owners = self.index.slot_owners() if report.released_slots else {}
        for key in report.saved:
            self.index.saved(key)
        self._count("lgkv_saved_blocks_total", len(report.saved))
        for key in report.read_ok:
            self.index.read_ok(key)
        for key in report.written:
            self.index.written(key)
        for key in report.redis_written:
            self._redis_until[key] = time.time() + self.settings.redis_ttl_s
            self.index.dirty.add(key)
        for key in report.write_failed:
            self.index.disk_lost(key)
        for key in report.read_failed:
            self.index.read_failed(key)
        for slot in report.released_slots:
            self.index.release(slot, owners)
        self._removing.difference_update(report.removed)
        done = set(report.read_ok) | set(report.read_failed) | set(report.removed)
        for pending in self._held.values():
            pending -= done
        for name, values in (("load", report.load_seconds), ("save", report.save_seconds)):
            self._count(f"lgkv_{name}_seconds_sum", sum(values))
            self._count(f"lgkv_{name}_seconds_count", len(values))
        idle = not self._tracked and not self.has_pending_work()
        self.flush(force=idle)

    def has_pending_work(self) -> bool:
        """True while disk writes or removes are unconfirmed (keeps the engine stepping)."""
        if self.index.removes or self._removing or any(self._held.values()):
            return True
        return any(s.on_disk and not s.disk_confirmed for s in self.index.blocks.values())

    # ---------------------------------------------------------------- sessions

    def request_finished(self, request: Any) -> None:
        """Record the session's turn; forget the request."""
        tracked = self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._held.pop(request.request_id, None)
        if tracked is None or tracked.op is not None or tracked.session is None:
            return
        tenant, sid = tracked.session
        num_blocks = min(len(request.block_hashes), request.num_computed_tokens // self.block_size)
        keys = [block_key(h) for h in request.block_hashes[:num_blocks]]
        try:
            self.registry.record_turn(
                tenant,
                sid,
                keys,
                request.num_computed_tokens,
                default_ttl_s=self.settings.default_ttl_s,
            )
            row = self.registry.get_session(tenant, sid)
            if row is not None:
                self.policy.record(row, keys)
            self._data_version = self.registry.data_version()
        except Exception:  # the registry is bookkeeping: never fail a request for it
            log.warning("could not record session %r in the registry", sid, exc_info=True)
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Publish block locations and counters to the registry (throttled unless forced)."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.settings.stats_flush_s:
            return
        self._last_flush = now
        wall = time.time()
        for key in [k for k, until in self._redis_until.items() if until < wall]:
            del self._redis_until[key]  # expired in Redis by now
            self.index.dirty.add(key)
        dirty, self.index.dirty = self.index.dirty, set()
        updates = {
            k: (*self.index.location(k), k in self._redis_until, self.block_bytes) for k in dirty
        }
        gauges = self.index.gauges(self.block_bytes, redis_blocks=len(self._redis_until))
        fmt = self.settings.offload_dtype
        gauges[f'lgkv_kv_compression_ratio{{format="{fmt}"}}'] = self.compression_ratio
        counters = dict(self._counters)
        for tier, n in self.index.evicted.items():
            counters[f'lgkv_evicted_blocks_total{{tier="{tier}"}}'] = float(n)
        try:
            self.registry.set_block_tiers(updates)
            self.registry.add_stats(counters, gauges)
        except Exception:
            self.index.dirty |= dirty
            log.warning("could not publish KV stats to the registry", exc_info=True)
            return
        self._counters.clear()
        self.index.evicted = {"ram": 0, "disk": 0}

    def shutdown(self) -> None:
        """Final flush; close the registry."""
        self.flush(force=True)
        self.registry.close()

    # ----------------------------------------------------------------- helpers

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
            sid, tenant = extra.get(XARG_SESSION), extra.get(XARG_TENANT) or DEFAULT_TENANT
            session = (str(tenant), str(sid)) if isinstance(sid, str) and sid else None
            op = extra.get(XARG_OP)
            tracked = _Tracked(request, session=session, op=op if isinstance(op, str) else None)
            self._tracked[request.request_id] = tracked
        return tracked

    def _prefetch_step(self, req_id: str, tracked: _Tracked) -> tuple[int | None, bool]:
        if req_id not in self._held:
            pending: set[str] = set()
            if tracked.session is not None:
                try:
                    keys = self.registry.session_keys(*tracked.session)
                except Exception:
                    log.warning("session registry unavailable; prefetch skipped", exc_info=True)
                    keys = []
                todo = [
                    k
                    for k in keys
                    if self.index.tier_of(k) == "disk" and self.index.blocks[k].slot == NO_SLOT
                ]
                slots = self.index.alloc_slots(len(todo), protect=set(keys))
                for key, slot in zip(todo, slots, strict=False):
                    state = self.index.blocks[key]
                    state.slot, state.ram_ready, state.locks = slot, False, state.locks + 1
                    self.index.touch(key)
                    self._plan.reads.append((key, slot))
                    pending.add(key)
            self._held[req_id] = pending
        if self._held[req_id]:
            return None, False
        self.flush(force=True)
        return 0, False

    def _sync_step(self, req_id: str) -> tuple[int | None, bool]:
        """A ``SYNC_OP`` request: purge expired sessions and apply recorded deletes now, and
        hold the request until the worker has removed the freed blocks' files."""
        if req_id not in self._held:
            self._sync_registry(force=True)
            self._held[req_id] = set(self.index.removes) | self._removing
        return (None, False) if self._held[req_id] else (0, False)

    def _sync_registry(self, *, force: bool = False) -> None:
        """Apply the API process's drops and reload pins/TTLs when the registry changed; purge
        expired sessions every few seconds (the engine is the one owner of expiry)."""
        try:
            now = time.monotonic()
            if force or now - self._last_purge > _PURGE_EVERY_S:
                self._last_purge = now
                self._drop(self.registry.purge_expired())
            version = self.registry.data_version()
            if version == self._data_version and not force:
                return
            self._drop_seq, dropped = self.registry.drops_after(self._drop_seq)
            self._drop(dropped)
            self._load_snapshot()
            self._data_version = version
        except Exception:  # bookkeeping must never stop the engine; retried next step
            log.warning("session registry unavailable; retrying", exc_info=True)

    def _drop(self, keys: list[str]) -> None:
        """Forget blocks in every tier (their sessions were deleted or expired)."""
        for key in keys:
            self.index.drop(key, remove_file=True)
            self._redis_until.pop(key, None)
        if self.redis is not None and keys:
            with contextlib.suppress(OSError):  # else they expire with their TTL
                self.redis.remove_many(keys)

    def _load_snapshot(self) -> None:
        sessions, refs = self.registry.policy_snapshot()
        self.policy.load(sessions, refs)

    def _count(self, name: str, value: float) -> None:
        if value:
            self._counters[name] = self._counters.get(name, 0.0) + value
