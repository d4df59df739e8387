"""Worker side of the connector: moves bytes as the scheduler side's :class:`StepPlan` says.

Per step:
- ``start_load`` (before the forward when the step has synchronous loads): RAM -> paged copies
  start on the copy thread, layer by layer (:mod:`server.kv.worker.layer_loads`), and ``wait_layer``
  (vLLM's ``wait_for_layer_load``, which each attention layer calls before it reads the cache)
  blocks until that layer is copied, so copying layer i+1 overlaps computing layer i. A tail
  block of a synchronous load is copied at once, every layer (the step writes its later
  slots). Disk reads of async jobs and prefetch reads go to the I/O thread.
- ``finish_loads`` (first thing in ``save`` and ``collect``): waits for the copy thread's last
  layer, frees the loads' RAM slots and turns a failed copy into load errors. On CPU the copy
  thread shares the cores with the forward, so it hides up to about half the copy time
  (figures: docs/architecture.md, "Loads overlap compute"); with the cache on CUDA every RAM
  load is copied in ``start_load``, all layers, as no copy stream is built.
- ``save`` (after the forward, from ``wait_for_save``): paged -> RAM slot copies of the blocks
  the step completed and of finished requests' tail blocks, then the step's file removals and
  writes go to the I/O thread (a write takes a private copy of the slot, so the slot can be
  reused at once). The requests whose tails were copied are released (``take_released``:
  vLLM's ``finished_sending``).

A tail block is loaded whole, like any block: where a token's slot lies inside a block is the
attention backend's business (the CPU backend stores all keys of a head, then all values, in
ISA-specific tiles), and the slots past the tail are never read: vLLM's forward writes the
positions it computes, and attention reads only positions below the sequence length. A tail is
saved from a private copy whose slots past its tokens are zero
(:mod:`server.kv.worker.token_slots`): the paged block vLLM handed the request may hold another
request's (another tenant's) KV there, which must not outlive it in RAM, files or Redis.
- ``collect`` (from ``get_finished``): applies finished disk reads to the paged cache, reports
  requests whose async load completed, and the paged block ids whose load failed (vLLM then
  recomputes them), and returns a :class:`WorkerReport` for the scheduler side.

With tensor parallelism each rank runs its own worker over its own shard of heads: its RAM
pool holds its share of every slot, its store and Redis tier are its rank's
(``DiskStore(..., rank=N)``), and its reports carry its ``rank`` (the scheduler side counts
an event done once every rank reported it: :mod:`server.kv.scheduler.ranks`).

Disk and Redis jobs run on the I/O thread (:mod:`server.kv.worker.io_thread`): reads first, then
writes and removals in FIFO order. Any disk or Redis error is a miss plus a warning, never an
exception to vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from server.kv.formats import BlockFormat
from server.kv.groups import BlockRef, LayerBlocks
from server.kv.keys import parse_tail_key
from server.kv.metadata import NO_SLOT, LoadItem, LoadJob, SaveItem, StepPlan, WorkerReport
from server.kv.stats import SessionKVStats
from server.kv.tiers.codec import BlockCodec
from server.kv.tiers.disk import DiskStore
from server.kv.tiers.ram import RamPool, load_block_bytes
from server.kv.tiers.redis import RedisStore
from server.kv.worker.io_thread import IOThread, Read
from server.kv.worker.kv_views import block_first_views
from server.kv.worker.layer_loads import LayerLoads
from server.kv.worker.shifted_loads import ShiftedLoads
from server.kv.worker.token_slots import TokenSlots

log = logging.getLogger(__name__)


@dataclass
class _AsyncLoad:
    req_id: str
    pending: int
    started: float
    failed_blocks: set[BlockRef] = field(default_factory=set)
    shifted: LoadJob | None = None
    """The job, when its shifted blocks wait for their sources' reads."""
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    """Shifted sources read without a slot, by number."""
    failed_sources: set[int] = field(default_factory=set)


class SessionKVWorker:
    """Holds the RAM pool, the views of vLLM's KV cache, the copy thread and the I/O thread.

    ``block_format`` is the stored format of every tier (``None``: ``auto``, the engine's
    dtype); blocks are encoded when they leave the paged cache and decoded when they return.
    """

    layer_wise = True
    """Copy RAM loads layer by layer on the copy thread when the paged cache is in CPU memory
    (with CUDA every load is copied in ``start_load``); ``False`` copies every layer in
    ``start_load`` (``benchmarks/layer_loads.py`` compares the two by swapping
    ``layer_loads``)."""
    copy_threads: int | None = 1
    """torch intra-op threads of the copy thread (None: torch's process-wide count)."""

    def __init__(
        self,
        *,
        num_slots: int,
        layers: list[str],
        layer_block_bytes: list[int],
        store: DiskStore | None,
        redis: RedisStore | None = None,
        block_format: BlockFormat | None = None,
        rank: int = 0,
        block_size: int | None = None,
        layer_groups: tuple[int, ...] = (),
    ) -> None:
        self.rank = rank
        """This worker's tensor-parallel rank (0 without tensor parallelism)."""
        self.block_size = block_size
        """Tokens per paged block (None: unknown, and tail blocks are saved as vLLM left
        them)."""
        self.token_slots: TokenSlots | None = None
        """Where each token lies in a layer's block, found in ``register_kv_caches``."""
        self.num_slots = num_slots
        self.layers = layers
        self.layer_groups = layer_groups
        """Per layer, its KV cache group (empty: one group): plan items then name blocks by
        one id per group (:mod:`server.kv.groups`)."""
        self._owners: dict[BlockRef, str] = {}
        """With several groups, the request each loading block belongs to: vLLM takes their
        load failures per request (``failed_recving``), not per block id."""
        self.layer_block_bytes = layer_block_bytes
        self.store = store
        self.redis = redis
        self.block_format = block_format
        self.codec: BlockCodec | None = None
        self.pool: RamPool | None = None
        self.kv: list[torch.Tensor] = []
        self._report = WorkerReport(rank=rank)
        self.stats = SessionKVStats()
        """Durations and block counts since vLLM last asked (:mod:`server.kv.stats`)."""
        self._loads: dict[str, _AsyncLoad] = {}
        self._finished_loads: set[str] = set()
        self._released: set[str] = set()
        self._load_errors: set[BlockRef] = set()
        self.layer_loads: LayerLoads | None = None
        self.shifted: ShiftedLoads | None = None
        """Shifted loads, built at the first one (probing the layout takes a moment)."""
        self._layered_jobs = 0
        self.io = IOThread(store, redis)

    # ------------------------------------------------------------------ set up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Keep block-first views of every layer's cache and allocate the RAM pool."""
        views = block_first_views(kv_caches, self.layers, self.layer_block_bytes, num_blocks)
        self.kv = views
        fmt = self.block_format or BlockFormat(
            "auto", str(views[0].dtype), tuple(self.layer_block_bytes)
        )
        self.codec = BlockCodec(fmt, [tuple(v.shape[1:]) for v in views])
        if self.block_size and self.num_slots:
            self.token_slots = TokenSlots.probe(views, self.block_size)
        if self.num_slots:
            self.pool = RamPool(self.num_slots, self.codec)
            if self.layer_wise and all(v.device.type == "cpu" for v in views):
                self.layer_loads = LayerLoads(self.layers, self._copy_layer, self.copy_threads)

    # ------------------------------------------------------------------- steps

    def start_load(self, plan: StepPlan) -> None:
        """Start RAM loads (layer by layer on the copy thread, or at once); queue disk reads of
        async loads and prefetch reads."""
        self.finish_loads()  # normally done by the previous step's save
        layered: list[LoadItem] = []
        for job in plan.loads:
            started = time.perf_counter()
            if self.layer_groups:
                self._owners.update((i.block_id, job.req_id) for i in job.items)
            reads = job.shifted_reads if job.shifted else ()
            if job.shifted and not reads:
                self._load_shifted(job)
            ram = [i for i in job.items if not i.from_disk]
            # A sync load's tail is copied now: this step's forward writes its later slots.
            now = [i for i in ram if self.layer_loads is None or (i.partial and not job.is_async)]
            later = [i for i in ram if i not in now]
            self._load_now(now)
            layered += later
            disk = [i for i in job.items if i.from_disk]
            if not disk and not reads:
                if later:
                    self._layered_jobs += 1  # observed when its last layer is copied
                else:
                    self.stats.observe_load(time.perf_counter() - started)
                if job.is_async:
                    self._finished_loads.add(job.req_id)
                continue
            pending = len(disk) + len(reads)
            self._loads[job.req_id] = _AsyncLoad(
                job.req_id, pending, started, shifted=job if reads else None
            )
            for item in disk:
                self.io.read(
                    Read(
                        item.key, item.slot, self._buffer(item.slot), item.source, item, job.req_id
                    )
                )
            for n in reads:  # the shifted fill waits for these (their slots stay locked)
                src = job.shifted_sources[n]
                buffer = self._buffer(src.slot)
                self.io.read(Read(src.key, src.slot, buffer, src.source, None, job.req_id, None, n))
        for key, slot in plan.reads:
            self.io.read(Read(key, slot, self._buffer(slot)))
        if layered and self.layer_loads is not None:
            self.layer_loads.start([i.slot for i in layered], [i.block_id for i in layered])

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's loads of layer ``layer_name`` are in the paged cache."""
        if self.layer_loads is not None:
            self.layer_loads.wait_layer(layer_name)

    def finish_loads(self) -> None:
        """Wait for the step's layer-wise loads; free their slots, record their failures."""
        done = self.layer_loads.finish() if self.layer_loads is not None else None
        if done is None:
            return
        slots, failed, seconds = done
        self._report.released_slots.extend(slots)
        self._load_errors.update(failed)
        for _ in range(self._layered_jobs):
            self.stats.observe_load(seconds)
        self._layered_jobs = 0

    def save(self, plan: StepPlan) -> None:
        """Copy the step's completed blocks to RAM; queue file removals and writes."""
        self.finish_loads()
        if plan.saves and self.pool is not None:
            started = time.perf_counter()
            self._copy_out(plan.saves)
            self._report.saved.extend(s.key for s in plan.saves)
            self.stats.observe_save(time.perf_counter() - started, len(plan.saves))
        self._released.update(plan.release)  # their blocks were copied (or not saved at all)
        for key in plan.removes:
            self.io.remove(key)
        if self.pool is not None:
            for item in plan.saves:
                if not (item.to_disk or item.to_redis):
                    continue
                data = self.pool.copy_slot(item.slot)
                if item.to_disk:
                    self.io.write(
                        item.key, data, (item.parent, item.tokens) if item.tokens else None
                    )
                if item.to_redis:
                    self.io.redis_write(item.key, data)

    def collect(self) -> tuple[set[str], set[BlockRef]]:
        """Apply finished disk jobs; return (finished async loads, failed paged blocks)."""
        self.finish_loads()
        for kind, payload in self.io.results():
            if kind == "read":
                assert isinstance(payload, Read)
                self._finish_read(payload)
            elif kind == "written":
                key, seconds = payload  # type: ignore[misc]
                self._report.written.append(key)
                self.stats.observe_save(seconds)
            elif kind == "write_failed":
                self._report.write_failed.append(payload)  # type: ignore[arg-type]
            elif kind == "redis_written":
                self._report.redis_written.append(payload)  # type: ignore[arg-type]
            elif kind == "redis_failed":
                self._report.redis_failed.append(payload)  # type: ignore[arg-type]
            elif kind == "removed":
                self._report.removed.append(payload)  # type: ignore[arg-type]
        finished, self._finished_loads = self._finished_loads, set()
        errors, self._load_errors = self._load_errors, set()
        return finished, errors

    def failed_requests(self, errors: set[BlockRef], finished: set[str]) -> set[str]:
        """With several KV cache groups: the requests whose load had a failed block (vLLM
        recomputes them whole), forgetting the blocks of the loads that ``finished``."""
        failed = {self._owners[ref] for ref in errors if ref in self._owners}
        if finished:
            self._owners = {r: q for r, q in self._owners.items() if q not in finished}
        return failed

    def take_released(self) -> set[str]:
        """Finished requests whose kept blocks vLLM may free now (their tails are copied)."""
        released, self._released = self._released, set()
        return released

    def take_report(self) -> WorkerReport | None:
        """The completions since the last call (None when nothing happened)."""
        report, self._report = self._report, WorkerReport(rank=self.rank)
        return None if report.is_empty() else report

    def take_stats(self) -> SessionKVStats | None:
        """The durations and block counts since the last call (None when there are none).
        Only rank 0 reports them: every rank moves its share of the same blocks."""
        stats = self.stats.take()
        return stats if self.rank == 0 else None

    def shutdown(self) -> None:
        """Finish queued disk jobs and stop the copy and I/O threads."""
        if self.layer_loads is not None:
            self.layer_loads.close()
        self.io.close()

    # ----------------------------------------------------------------- helpers

    def _copy_out(self, saves: list[SaveItem]) -> None:
        """Copy saved paged blocks into their RAM slots; a tail block from a copy whose slots
        past its tokens are zero (when the layout's token positions are known)."""
        assert self.pool is not None
        slots = self.token_slots
        tails = {s: parse_tail_key(s.key) for s in saves} if slots and slots.known else {}
        full = [s for s in saves if tails.get(s) is None]
        if full:
            self.pool.save(self.kv, self._blocks(s.block_id for s in full), [s.slot for s in full])
        partial = [(s, t[1]) for s, t in tails.items() if t is not None]
        if partial and slots is not None:
            copies = slots.tail_copies(
                self.kv, self._blocks(s.block_id for s, _ in partial), [n for _, n in partial]
            )
            ids = LayerBlocks(range(len(partial)))
            self.pool.save(copies, ids, [s.slot for s, _ in partial])

    def _blocks(self, refs: Iterable[BlockRef]) -> LayerBlocks:
        return LayerBlocks(list(refs), self.layer_groups)

    def _copy_layer(self, layer: int, slots: list[int], refs: list[BlockRef]) -> None:
        """Layer ``layer`` of RAM slots into the paged blocks ``refs`` name (the copy thread)."""
        assert self.pool is not None
        self.pool.load_layer(self.kv, layer, slots, self._blocks(refs).of(layer))

    def _load_now(self, items: list[LoadItem]) -> None:
        """Copy RAM items into the paged cache now, every layer (a failure is a miss)."""
        if not items or self.pool is None:
            return
        try:
            blocks = self._blocks(i.block_id for i in items)
            self.pool.load(self.kv, [i.slot for i in items], blocks)
        except Exception as e:  # a miss, never an exception in vLLM's step
            log.warning("KV load of %d RAM blocks failed, they are recomputed: %s", len(items), e)
            self._load_errors.update(i.block_id for i in items)
        self._report.released_slots.extend(i.slot for i in items)

    def _load_shifted(
        self,
        job: LoadJob,
        buffers: dict[int, torch.Tensor] | None = None,
        failed: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        """Fill the job's shifted blocks now (:meth:`ShiftedLoads.fill`; ``buffers``: sources
        read without a slot); a block not filled is a miss: vLLM computes it."""
        if self.shifted is None:
            self.shifted = ShiftedLoads.build(self.kv, self.block_size or 0, self.layer_groups)
        self._load_errors.update(self.shifted.fill(self.pool, self.kv, job, buffers or {}, failed))
        self._report.released_slots.extend(job.shifted_slots)

    def _buffer(self, slot: int) -> torch.Tensor:
        if slot != NO_SLOT and self.pool is not None:
            return self.pool.slot(slot)
        size = self.codec.format.block_bytes if self.codec else sum(self.layer_block_bytes)
        return torch.empty(size, dtype=torch.uint8)

    def _finish_read(self, read: Read) -> None:
        if read.error is None:
            if read.slot != NO_SLOT:
                self._report.read_ok.append(read.key)
        else:
            log.warning("KV block %s is a miss: %s", read.key[:16], read.error)
            self._report.read_failed.append(read.key)
        load = self._loads.get(read.req_id) if read.req_id is not None else None
        if read.shift_source is not None:  # the fill reads it (and then releases its slot)
            if load is not None and read.error is not None:
                load.failed_sources.add(read.shift_source)
            elif load is not None and read.slot == NO_SLOT:
                load.buffers[read.shift_source] = read.buffer
        elif read.item is not None and read.req_id is not None:
            block = self._blocks((read.item.block_id,))
            if read.error is None and self.pool is not None:
                self.pool.load_bytes(self.kv, read.buffer, block)
            elif read.error is None and self.codec is not None:
                load_block_bytes(self.codec, self.kv, read.buffer, block)
            elif load is not None:
                load.failed_blocks.add(read.item.block_id)
        if load is not None:
            load.pending -= 1
            if load.pending == 0:
                self._loads.pop(load.req_id)
                if load.shifted is not None:
                    self._load_shifted(load.shifted, load.buffers, load.failed_sources)
                self._finished_loads.add(load.req_id)
                self._load_errors |= load.failed_blocks
                self.stats.observe_load(time.perf_counter() - load.started)
        if read.slot != NO_SLOT and read.shift_source is None:
            self._report.released_slots.append(read.slot)
