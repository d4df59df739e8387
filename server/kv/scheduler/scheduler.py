"""Scheduler side of the connector: lookups, load/save/prefetch plans, session bookkeeping.

Runs in vLLM's scheduler (engine-core process). No torch: it sees requests only through
``request_id``, ``block_hashes``, ``num_tokens``, ``num_computed_tokens`` and
``sampling_params.extra_args``, and talks to the worker through :class:`StepPlan` and
:class:`WorkerReport`.

Verbs, per request:
- ``get_num_new_matched_tokens``: longest run of the request's next full blocks found in RAM
  or on disk, plus the tail block that continues them (:mod:`server.kv.scheduler.tails`: the
  count is then not block-aligned); never the whole prompt (vLLM must compute at least one token).
  All-RAM hits load synchronously; any disk block makes the load asynchronous.
- ``update_state_after_alloc``: turns the lookup into a :class:`LoadJob` on the blocks vLLM
  allocated, locking the RAM slots read (:mod:`server.kv.scheduler.loads`).
- ``build_plan`` (each step): saves of every block a scheduled request completes this step,
  with RAM slots and disk space reserved (evicting by :class:`EvictionPolicy`).
- ``request_finished``: queues the session's turn for the registry (block list, tokens, gap)
  and its tail block's save (vLLM keeps the blocks until the worker has copied it).

None of these waits on anything: every registry read and write runs on the registry thread
(:class:`RegistrySync`; its events are applied once a step, at the step's first call), every
Redis existence check on the Redis thread (:class:`RedisLookups`; a lookup waiting for one
answers vLLM None, "not yet"), control requests are held by :class:`ControlOps`, and the
start's block files and registry snapshots are taken a few milliseconds per step
(:class:`~server.kv.scheduler.recovery.WarmUp`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from server.kv.groups import BlockRef, saveable
from server.kv.keys import block_key
from server.kv.metadata import StepPlan, WorkerReport
from server.kv.registry.api import EngineRegistry
from server.kv.registry.shared import open_registry
from server.kv.scheduler.continuations import Continuations
from server.kv.scheduler.control_ops import CONTROL_OPS, ControlOps
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.loads import plan_load
from server.kv.scheduler.lookups import find_blocks
from server.kv.scheduler.policy import EvictionPolicy
from server.kv.scheduler.publisher import Publisher
from server.kv.scheduler.redis_lookups import RedisLookups
from server.kv.scheduler.registry_sync import Done, Dropped, RegistrySync, SessionChange, Snapshot
from server.kv.scheduler.requests import Lookup, Tracked, track
from server.kv.scheduler.saves import plan_saves
from server.kv.scheduler.shifted import find_shifted, tail_or_shifted, tokens_read
from server.kv.scheduler.tails import TailBook
from server.kv.scheduler.warm_up import FileScan, WarmUp
from server.kv.settings import ConnectorSettings
from server.kv.tiers.redis import RedisStore

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.002
_WARM_IDLE_S, _WARM_BUSY_S = 0.010, 0.002
"""Seconds of start-up work (files, snapshots) per step: idle, and with requests scheduled."""


class SessionKVScheduler:
    """Decides what moves where; the worker only executes its plans."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        block_size: int,
        block_bytes: int,
        file_bytes: int,
        disk_files: dict[str, int] | FileScan,
        sync: RegistrySync | None = None,
        redis: RedisStore | None = None,
        compression_ratio: float = 1.0,
        on_files_indexed: Callable[[], None] | None = None,
    ) -> None:
        """``disk_files``: the block files found at start, indexed here, or a
        :class:`FileScan` still running, indexed in steps (then ``on_files_indexed`` runs
        once every file is in)."""
        self.settings = settings
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.async_loads = False
        """Every load asynchronous (the request waits for it outside the batch): with several
        KV cache groups vLLM takes load failures only per waiting request."""
        self.file_bytes = file_bytes
        self.sync = sync or RegistrySync(
            settings.registry_path,
            opener=lambda: open_registry(
                settings.registry_path,
                redis_url=settings.redis_url,
                namespace=settings.registry_namespace,
                busy_timeout_s=2.0,
            ),
        )
        """Every registry read and write of the engine, on its own thread (sessions in Redis
        when ``redis_url`` is set)."""
        self.redis = redis
        self.redis_lookups = RedisLookups(redis) if redis is not None else None
        self.publisher = Publisher(
            self.sync,
            block_bytes=block_bytes,
            stats_flush_s=settings.stats_flush_s,
            redis_ttl_s=settings.redis_ttl_s,
            offload_dtype=settings.offload_dtype,
            compression_ratio=compression_ratio,
        )
        self.policy = EvictionPolicy(settings.default_gap_s, settings.min_gap_s)
        num_slots = settings.ram_bytes // block_bytes if block_bytes else 0
        self.index = BlockIndex(
            num_slots=num_slots,
            file_bytes=file_bytes,
            disk_bytes=settings.disk_bytes if num_slots else 0,
            policy=self.policy,
            pin_share=settings.pin_share,
        )
        self._tracked: dict[str, Tracked] = {}
        self._lookups: dict[str, Lookup] = {}
        self._removing: set[str] = set()
        """Keys whose file removal was planned and not yet confirmed by the worker."""
        self._to_redis: set[str] = set()
        """Keys whose Redis write was planned and not yet reported done or failed."""
        self._plan = StepPlan()
        self._ops = ControlOps(
            self.index, self.policy, self.sync, lambda: self.flush(force=True), self._removing
        )
        self._step_open = False
        """The registry's events were applied in this step already."""
        self.tails = TailBook(block_size)
        self.continuations = Continuations(block_size)
        """Token ids of stored blocks: reuse up to the last shared token (a session tree)."""
        self.sync.write("block tier reset", lambda reg: reg.reset_block_tiers())
        scan = disk_files if isinstance(disk_files, FileScan) else None
        self._warm = WarmUp(
            self.index, self.policy, self.tails, self.sync,
            scan or FileScan(None, files=disk_files),  # type: ignore[arg-type]
            block_bytes=block_bytes, answered=self._ops.answered, on_files_done=on_files_indexed,
            learn=self.continuations.learn_packed,
        )  # fmt: skip
        """Start-up work taken in steps: block files found on disk, registry snapshots."""
        if scan is None:
            self._warm.finish()  # files found already: indexed now
        self.flush(force=True)

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` and whether the load is async; None
        ("not yet") while a Redis check or a control request's work is outstanding."""
        self._begin_step()
        if self._warm.holding():
            return None, False  # the start's files are coming in: ask again next step
        tracked = track(self._tracked, request)
        if tracked.op in CONTROL_OPS:
            return self._ops.step(request.request_id, tracked.op, tracked.session, self._plan)
        start = num_computed_tokens // self.block_size
        end = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        found_blocks = find_blocks(request, start, end, self.index, self.redis_lookups, self.tails)
        if found_blocks is None:
            return None, False  # Redis has not answered yet
        keys, tiers, tier_of = found_blocks
        misses = max(0, end - start - len(keys))
        tail = self.tails.find(request, start + len(keys), tier_of)
        # a block shared up to a token inside it (a rewind, a fork), or the session's tokens
        # at other positions (shifted reuse, asked for), whichever fills the most
        partial = self.continuations.find(request, start + len(keys), tier_of)
        shift = None
        if tracked.shifted and tracked.session is not None and self.index.num_slots:
            shift = functools.partial(find_shifted, request, self.continuations,
                                      self.policy.keys_of(*tracked.session), start + len(keys),
                                      self.block_size, self.settings.shift_min_run,
                                      self.index.tier_of)  # fmt: skip
        tail, shifted = tail_or_shifted(tail, partial, shift, self.block_size)
        self._lookups[request.request_id] = Lookup(start, keys, tiers, misses, tail, shifted)
        if not keys and tail is None and shifted is None:
            return 0, False
        is_async = self.async_loads or any(t != "ram" for t in tiers)
        is_async = is_async or (tail is not None and tail.tier != "ram")
        is_async = is_async or (shifted is not None and shifted.disk)
        found = len(keys) * self.block_size + (tail.tokens if tail else 0)
        return found + (shifted.tokens if shifted else 0), is_async

    def update_state_after_alloc(
        self, request: Any, block_ids: list[BlockRef], num_external_tokens: int
    ) -> None:
        """Turn the request's lookup into a load job on the blocks vLLM allocated."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        job = plan_load(
            request.request_id, self.index, self.publisher, lookup, block_ids, num_external_tokens,
            block_size=self.block_size, async_loads=self.async_loads,
        )  # fmt: skip
        if job is None:
            return
        self._plan.loads.append(job)
        tracked = track(self._tracked, request)
        tracked.loading = tracked.loading or job.is_async
        if job.shifted:
            shifted = sum(s.count for i in job.shifted for s in i.segments)
            tracked.exact_tokens = num_external_tokens - shifted
            tracked.moved = [sum(s.count for s in i.segments if s.delta) for i in job.shifted]

    # -------------------------------------------------------------------- plans

    def build_plan(
        self,
        scheduled: list[tuple[str, list[BlockRef] | None, bool, int]],
        num_scheduled_tokens: dict[str, int],
    ) -> StepPlan:
        """The step's plan. ``scheduled``: (req id, new block ids or None, replaces the old
        list, computed tokens before this step) for every request scheduled this step."""
        self._begin_step()
        self._step_open = False  # the next call belongs to the next step
        if self._warm.pending() and not scheduled:
            self._warm.step(_WARM_IDLE_S)
        wanted: list[tuple[BlockRef, str]] = []
        for req_id, new_ids, replace, num_computed in scheduled:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if new_ids is not None:
                tracked.block_ids = list(new_ids) if replace else tracked.block_ids + new_ids
            if num_scheduled_tokens.get(req_id, 0):
                tracked.loading = False  # it computes: any load it had is done
            if tracked.op is not None or not self.index.num_slots:
                continue
            done = num_computed + num_scheduled_tokens.get(req_id, 0)
            hashes = tracked.request.block_hashes
            full = min(done // self.block_size, len(hashes), len(tracked.block_ids))
            first = tracked.saved_upto
            new_keys = [block_key(h) for h in hashes[first:full]]
            self.continuations.learn_blocks(tracked.request, first, new_keys)
            for i, key in enumerate(new_keys, first):
                if key in self.index.blocks:
                    self.index.touch(key)
                elif saveable(tracked.block_ids[i]) and all(key != k for _, k in wanted):
                    wanted.append((tracked.block_ids[i], key))
            tracked.saved_upto = max(tracked.saved_upto, full)
        if wanted:
            self._plan_saves(wanted)
        if self.tails.has_pending():
            self.tails.plan(self.index, self._plan_saves, self._plan.release)
        index = self.index
        self.continuations.prune(lambda k: k in index.blocks, 2 * len(index.blocks) + 1024)
        if not scheduled and self._plan.is_empty() and not self.index.removes:
            # Nothing runs: the engine only polls for loads or writes to finish. Yield the
            # CPU (and the GIL) to the I/O thread instead of spinning.
            time.sleep(_IDLE_POLL_S)
        plan, self._plan = self._plan, StepPlan()
        plan.removes, self.index.removes = self.index.removes, []
        self._removing.update(plan.removes)
        self._warm.removed(plan.removes)
        return plan

    def _plan_saves(self, wanted: list[tuple[BlockRef, str]]) -> None:
        ready, redis = self._warm.policy_ready, self.redis is not None
        saves = plan_saves(
            self.index, wanted, self.continuations, policy_ready=ready, to_redis=redis
        )
        self._plan.saves += saves
        if self.redis is not None:
            self._to_redis.update(s.key for s in saves)

    # ------------------------------------------------------------------ reports

    def on_report(self, report: WorkerReport) -> None:
        """Apply the worker's completions to the index."""
        self.index.apply(report)
        for key in report.redis_written:
            self.publisher.redis_written(key)
        self._removing.difference_update(report.removed)
        self._to_redis.difference_update(report.redis_written, report.redis_failed)
        self._ops.confirmed(set(report.read_ok) | set(report.read_failed) | set(report.removed))
        self._ops.advance()
        idle = not self._tracked and not self.has_pending_work()
        self.flush(force=idle)

    def has_pending_work(self) -> bool:
        """True while disk or Redis writes or removes are unconfirmed (keeps the engine
        stepping, so a turn's last blocks reach every tier before an idle engine stops)."""
        if self.index.removes or self._removing or self._to_redis or self._ops.pending():
            return True
        if self._warm.pending():
            return True  # start-up work left: keep stepping to take it
        return self.index.unconfirmed_writes > 0  # counted as blocks change: O(1)

    # ---------------------------------------------------------------- sessions

    def reuse_report(self, request: Any) -> dict[str, int] | None:
        """For a request that asked for shifted reuse, ``{"lgkv_shifted_tokens": n}``: the
        prompt tokens it read from other positions (blocks that failed to load left out);
        vLLM returns it as the response's ``kv_transfer_params``. None for other requests."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or not tracked.shifted:
            return None
        moved = tokens_read(request, tracked.moved, tracked.exact_tokens, self.block_size)
        return {"lgkv_shifted_tokens": moved}

    def request_finished(self, request: Any, block_ids: list[BlockRef] | None = None) -> bool:
        """Queue the session's turn for the registry and the save of its tail block (of
        paged ``block_ids``); forget the request. True: the tail's save is queued, so vLLM must
        keep the blocks until the worker reports the request in ``finished_sending``."""
        tracked = self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._ops.forget(request.request_id)
        if self.redis_lookups is not None:
            self.redis_lookups.forget(request.request_id)
        if tracked is None or tracked.op is not None or tracked.session is None:
            return False
        tenant, sid = tracked.session
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        num_blocks = min(len(request.block_hashes), computed // self.block_size)
        keys = [block_key(h) for h in request.block_hashes[:num_blocks]]
        ram_on = bool(self.index.num_slots) and not tracked.loading
        tail = self.tails.on_finished(request, block_ids, computed, ram_on)
        if tail is not None:
            keys.append(tail)
            self.continuations.learn_tail(request, tail, computed // self.block_size)
        now = time.time()
        self._warm.settle(tenant, sid)  # its snapshot item first, if still to come
        old = self.policy.keys_of(tenant, sid)
        keys = self.continuations.session_blocks(request, keys, old, self.settings.branch_blocks)
        self.policy.note_turn(tenant, sid, keys, now)
        self.tails.supersede(old, keys, self.policy, self.index)
        tokens, ttl = request.num_computed_tokens, self.settings.default_ttl_s
        self.sync.write(
            f"turn of session {sid!r}",
            lambda reg: reg.record_turn(tenant, sid, keys, tokens, default_ttl_s=ttl, now=now),
        )
        self.flush()
        return tail is not None

    def flush(self, force: bool = False) -> None:
        """Queue block locations and counters for the registry (throttled unless forced)."""
        self.publisher.flush(self.index, force=force)

    def shutdown(self) -> None:
        """Final flush; let the registry and Redis threads finish their queues."""
        self.flush(force=True)
        self.sync.close()
        if self.redis_lookups is not None:
            self.redis_lookups.close()

    @property
    def registry(self) -> EngineRegistry:
        """The registry thread's connection (tests and tools; blocks until it is open)."""
        return self.sync.registry

    def catch_up(self, *, purge: bool = False, timeout_s: float = 30.0) -> None:
        """Block until the registry thread wrote everything queued and read every change
        (after a purge of expired sessions when ``purge``), then apply its events. For tests,
        tools and shutdown: never called from vLLM's scheduler thread."""
        self.flush(force=True)
        token = self.sync.sync() if purge else self.sync.barrier()
        if not self.sync.wait(token, timeout_s):
            raise TimeoutError(f"session registry did not catch up in {timeout_s} s")
        self._apply_events()
        self._warm.finish()

    # ----------------------------------------------------------------- helpers

    def _begin_step(self) -> None:
        """Apply the registry thread's events once a step, at the step's first call (so a
        lookup and the allocation that follows it in the same step see one state)."""
        if not self._step_open:
            self._step_open = True
            self._apply_events()
            if self._warm.pending():
                self._warm.step(_WARM_BUSY_S)

    def _apply_events(self) -> None:
        for event in self.sync.drain():
            if isinstance(event, Snapshot):
                self._warm.add_snapshot(event)  # taken in steps
            elif isinstance(event, SessionChange):
                self._warm.add_change(event)  # taken in steps (a burst never stalls one)
            elif isinstance(event, Dropped):
                self._drop(event.keys)
            elif isinstance(event, Done) and not self._warm.defer(event.token):
                self._ops.answered(event.token)

    def _drop(self, keys: list[str]) -> None:
        """Forget blocks in every tier (their sessions were deleted or expired)."""
        self._warm.removed(keys)
        for key in keys:
            self.index.drop(key, remove_file=True)
            self.publisher.redis_until.pop(key, None)
        if self.redis_lookups is not None:
            self.redis_lookups.remove(keys)  # else they expire with their TTL
