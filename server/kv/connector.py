"""``SessionKVConnector``: vLLM's ``KVConnectorBase_V1`` facade over the scheduler and worker sides.

Load it with ``KVTransferConfig(kv_connector="SessionKVConnector",
kv_connector_module_path="server.kv.connector", kv_role="kv_both",
kv_connector_extra_config={...})`` (keys: docs/configuration.md). vLLM builds one instance
per role: the SCHEDULER one holds :class:`SessionKVScheduler` (index, policy, registry), each
WORKER one holds :class:`SessionKVWorker` (RAM pool, disk I/O thread). This module only
translates vLLM's objects into the plain ones those classes take.

The connector is a best-effort cache: a block that cannot be loaded is recomputed, so it sets
``kv_load_failure_policy="recompute"`` on the transfer config (vLLM's default would fail the
request). It serves one KV cache group of paged attention (elsewhere, and where vLLM
disabled prefix caching, it offers nothing: :mod:`server.kv.layout`) and tensor parallelism
(``--tensor-parallel-size``): the scheduler side stays one and plans for every rank; each
rank's worker moves its own shard of heads (its RAM pool holds its share of every slot, its own
block files and Redis keys) and reports with its rank; :class:`~server.kv.scheduler.ranks.RankTally`
counts an event done once every rank reported it. The manifest records the TP size, so blocks
written with another TP size are never read.
Pipeline and context parallelism are refused (:func:`check_parallel`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from server.kv.groups import BlockRef, block_refs
from server.kv.layout import build_manifest, why_no_reuse
from server.kv.metadata import StepPlan, WorkerReport
from server.kv.scheduler.ranks import RankTally, check_parallel
from server.kv.scheduler.recovery import DiskSpace, check_budgets
from server.kv.scheduler.scheduler import SessionKVScheduler
from server.kv.scheduler.usage import LoadAccounting
from server.kv.scheduler.warm_up import FileScan
from server.kv.settings import ConnectorSettings
from server.kv.stats import SessionKVPromMetrics, SessionKVStats
from server.kv.tiers.disk import DiskStore, block_file_bytes
from server.kv.tiers.redis import RedisStore
from server.kv.worker.worker import SessionKVWorker
from server.logs import use_vllm_logging

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class SessionKVConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`StepPlan`, as vLLM ships it scheduler -> worker."""

    plan: StepPlan


@dataclass
class SessionKVWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's :class:`WorkerReport` of each rank, as vLLM ships them worker -> scheduler
    (vLLM's ``KVOutputAggregator`` calls ``aggregate`` to gather the ranks' metadata)."""

    reports: tuple[WorkerReport, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SessionKVWorkerMetadata)
        return SessionKVWorkerMetadata(self.reports + other.reports)


def _tp_rank() -> int:
    """This worker process's tensor-parallel rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _files_at_start(store: DiskStore | None, settings: ConnectorSettings) -> FileScan:
    """The sound block files the disk tier starts with, found on a background thread and
    indexed in steps while the engine serves (damaged ones deleted, and all of them when the
    session registry vanished: no session could reach or delete them)."""
    return FileScan(store, settings.registry_path)


class SessionKVConnector(KVConnectorBase_V1):
    """Keeps conversations' KV blocks in a RAM pool and on disk between turns."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        use_vllm_logging()  # this may be a fresh engine process: our lines in vLLM's format
        tp_size = check_parallel(vllm_config.parallel_config)
        rank = _tp_rank() if role != KVConnectorRole.SCHEDULER and tp_size > 1 else None
        self.settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            if role == KVConnectorRole.SCHEDULER:
                log.info(
                    "SessionKVConnector: kv_load_failure_policy set to 'recompute' "
                    "(a block that fails to load is recomputed, never an error)"
                )
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        reason = why_no_reuse(vllm_config, kv_cache_config)
        if reason is not None:
            # Offer nothing rather than a wrong answer: no tier holds or finds a block; the
            # session registry and its API keep working.
            if role == KVConnectorRole.SCHEDULER:
                log.warning("SessionKVConnector: %s; it keeps and offers no KV", reason)
            self.settings = dataclasses.replace(
                self.settings, ram_bytes=0, disk_bytes=0, redis_url=None
            )
        manifest = build_manifest(vllm_config, kv_cache_config, self.settings)
        self._num_blocks = kv_cache_config.num_blocks
        # Budgets count a block over every rank; each rank's pool holds its share of a slot.
        block_bytes = manifest.total_block_bytes
        disk_on = check_budgets(
            self.settings.ram_bytes,
            self.settings.disk_bytes,
            block_bytes,
            block_file_bytes(manifest),
            warn=role == KVConnectorRole.SCHEDULER,
        )
        store = DiskStore(self.settings.disk_dir, manifest, rank) if disk_on else None
        redis = (
            RedisStore(
                self.settings.redis_url, manifest, ttl_s=self.settings.redis_ttl_s, rank=rank
            )
            if self.settings.redis_url
            else None
        )
        num_slots = self.settings.ram_bytes // block_bytes
        self.scheduler: SessionKVScheduler | None = None
        self.worker: SessionKVWorker | None = None
        self._disk_space: DiskSpace | None = None
        if role == KVConnectorRole.SCHEDULER:
            if store is not None:
                self._disk_space = DiskSpace(store.root, self.settings.disk_bytes, store.file_bytes)
            self.scheduler = SessionKVScheduler(
                self.settings,
                block_size=manifest.block_size,
                block_bytes=block_bytes,
                file_bytes=store.file_bytes if store else block_bytes,
                disk_files=_files_at_start(store, self.settings),
                redis=redis,
                compression_ratio=manifest.block_format.ratio,
                on_files_indexed=self._fit_disk_budget,
            )
            self.scheduler.async_loads = bool(manifest.groups)
            log.info(
                "SessionKVConnector: %d RAM slots of %d bytes (%s, %d tensor-parallel rank(s) "
                "of %d bytes), disk %s (%d bytes budget)",
                num_slots,
                block_bytes,
                manifest.offload_dtype,
                tp_size,
                manifest.block_bytes,
                store.root if store else "off",
                self.settings.disk_bytes,
            )
        else:
            self.worker = SessionKVWorker(
                num_slots=num_slots,
                layers=list(manifest.layers),
                layer_block_bytes=list(manifest.layer_block_bytes),
                store=store,
                redis=redis,
                block_format=manifest.block_format,
                rank=rank or 0,
                block_size=manifest.block_size,
                layer_groups=manifest.groups,
            )
        self._tally = RankTally(tp_size)
        self._usage = LoadAccounting(manifest.block_size)

    def _fit_disk_budget(self) -> None:
        """Every block file found at start is indexed: cap the disk budget at what the file
        system holds (it counts the files indexed)."""
        if self._disk_space is not None and self.scheduler is not None:
            self._disk_space.fit_at_start(self.scheduler.index)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never a wrong answer

    # ------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # RAM loads are copied layer by layer during the forward; disk loads completed before
        # their request was scheduled (it waited in WAITING_FOR_REMOTE_KVS)
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # blocks are copied once per step in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        finished, errors = self.worker.collect()
        if self.worker.layer_groups:  # vLLM takes these per request (every load is async)
            self._failed_loads = self.worker.failed_requests(errors, finished)
            errors = set()
        self._load_errors = cast("set[int]", errors)  # one group: refs are block ids
        return self.worker.take_released() or None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving, self._failed_loads = getattr(self, "_failed_loads", set()), set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = getattr(self, "_load_errors", set()), set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        report = self.worker.take_report()
        return SessionKVWorkerMetadata((report,)) if report is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return SessionKVStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return SessionKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SessionKVConnectorMetadata)
        return meta.plan

    # ---------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        refs = block_refs(blocks.get_block_ids()) if num_external_tokens else []
        self.scheduler.update_state_after_alloc(request, refs, num_external_tokens)
        self._usage.on_alloc(request, refs, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return {CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        scheduled: list[tuple[str, list[BlockRef] | None, bool, int]] = [
            (r.req_id, block_refs(r.block_ids), True, r.num_computed_tokens)
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            scheduled.append(
                (
                    req_id,
                    block_refs(new_ids) if new_ids is not None else None,
                    req_id in cached.resumed_req_ids,
                    cached.num_computed_tokens[i],
                )
            )
        plan = self.scheduler.build_plan(scheduled, scheduler_output.num_scheduled_tokens)
        return SessionKVConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        reports = meta.reports if isinstance(meta, SessionKVWorkerMetadata) else ()
        report = self._tally.combine(reports) if reports else WorkerReport()
        self.scheduler.on_report(report)
        # cached_tokens counts only the blocks before a failed load (vLLM recomputes the rest)
        self._usage.on_output(
            connector_output.invalid_block_ids or (),
            connector_output.finished_recving or (),
            connector_output.failed_recving or (),
        )
        if self._disk_space is not None:
            if report.write_failed:
                self._disk_space.on_write_failed(self.scheduler.index)
            self._disk_space.maybe_regrow(self.scheduler.index)

    def request_finished(
        self, request: Request, block_ids: list[BlockRef]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        report = self.scheduler.reuse_report(request)
        delay = self.scheduler.request_finished(request, list(block_ids))
        self._usage.forget(request.request_id)
        return delay, report

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()


class HybridSessionKVConnector(SessionKVConnector, SupportsHMA):
    """The connector for models vLLM runs with its hybrid KV cache manager, which it keeps on
    only for a connector that declares ``SupportsHMA`` (:func:`~server.kv.layout.
    connector_class_for` picks it). Such a model has several KV cache groups.

    - Sliding-window layers beside global ones (Gemma 2/3, gpt-oss): every group is paged
      attention, so the tiers keep a block of every layer (a sliding group's skipped blocks
      are vLLM's null block: not saved, not loaded; :mod:`server.kv.groups`), and every load
      is asynchronous, as vLLM takes load failures only per request with several groups.
    - Recurrent state (Mamba, linear attention: Qwen3-Next, Granite 4): the tiers do not keep
      it yet (:func:`~server.kv.layout.why_no_reuse`), so the connector offers nothing; the
      model is served, vLLM's own prefix cache works as without the connector, and the
      session registry and API keep working."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_refs(block_ids))
