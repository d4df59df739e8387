"""Layer-wise RAM loads: a step's RAM -> paged copies run on a copy thread, one layer at a
time, while the forward pass computes the layers already copied.

vLLM calls the connector's ``start_load_kv`` before the forward of a step that has synchronous
loads (``SchedulerOutput.has_sync_kv_loads``; ``v1/worker/kv_connector_model_runner_mixin.py``)
and each attention layer calls ``wait_for_layer_load(layer_name)`` before its attention reads
the paged cache (``maybe_transfer_kv_layer`` around ``unified_attention_with_output``; on the
CPU backend too, whose attention is an opaque custom op). :class:`LayerLoads` copies layer 0 of
every block of the step, then layer 1, ..., and :meth:`LayerLoads.wait_layer` blocks only until
its layer is done, so the copy of layer i+1 overlaps the compute of layer i.

What it must not overlap, and the worker keeps out of it:

- A block the step's forward writes into: a tail block (its later slots are this step's new
  tokens). vLLM writes a layer's new keys and values (``unified_kv_cache_update``) *before*
  that layer's ``wait_for_layer_load``, so a late whole-block copy would overwrite them. The
  worker copies such blocks, every layer, before the forward.
- The step's saves (they read paged blocks) and the reuse of the loads' RAM slots (released in
  the step's report): :meth:`LayerLoads.finish`, called before either, waits for every layer.

A layer whose copy raises fails every block of the batch: :meth:`LayerLoads.finish` returns
their paged block ids, which the worker reports as load errors, so vLLM discards the step's
output for the requests that read them and recomputes those blocks (a miss plus a warning,
never wrong KV). The layers after a failed one are not copied.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.kv.groups import BlockRef

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    slots: list[int]
    block_ids: list[BlockRef]
    started: float
    done: int = 0
    """Layers copied (or given up on) so far."""
    failed: bool = False
    finished: float = 0.0


CopyLayer = Callable[[int, list[int], list[BlockRef]], None]
"""``copy_layer(layer_index, slots, block_ids)``: copy one layer of RAM slots into paged
blocks."""


class LayerLoads:
    """One step's layer-wise RAM loads at a time, on one copy thread.

    ``copy_layer`` copies one layer of the batch; ``threads``, when given, is the number of
    torch intra-op threads the copy thread uses (set on that thread only; by default it uses
    torch's process-wide count).
    """

    def __init__(
        self, layers: list[str], copy_layer: CopyLayer, threads: int | None = None
    ) -> None:
        self._layer_index = {name: i for i, name in enumerate(layers)}
        self._num_layers = len(layers)
        self._copy_layer = copy_layer
        self._threads = threads
        self._cond = threading.Condition()
        self._batch: _Batch | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lgkv-layer-loads", daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The copy thread's OS id (for affinity checks)."""
        return self._thread.native_id

    def start(self, slots: list[int], block_ids: list[BlockRef]) -> None:
        """Start copying ``slots`` into paged ``block_ids``, layer by layer (the previous
        batch must be finished)."""
        with self._cond:
            assert self._batch is None, "the previous step's layer loads were not finished"
            self._batch = _Batch(list(slots), list(block_ids), time.perf_counter())
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """True while a batch is in flight or not yet finished."""
        return self._batch is not None

    def wait_layer(self, name: str) -> None:
        """Block until layer ``name`` of the batch in flight is in the paged cache (at once
        when there is none, or for a layer this worker does not copy)."""
        index = self._layer_index.get(name)
        if index is None or self._batch is None:
            return
        with self._cond:
            while self._batch is not None and self._batch.done <= index:
                self._cond.wait()

    def finish(self) -> tuple[list[int], list[BlockRef], float] | None:
        """Wait for every layer of the batch in flight; return its (slots, failed paged block
        ids, seconds from start to the last layer), or None when there was none."""
        if self._batch is None:
            return None
        with self._cond:
            while self._batch is not None and self._batch.done < self._num_layers:
                self._cond.wait()
            batch, self._batch = self._batch, None
        if batch is None:
            return None
        failed = batch.block_ids if batch.failed else []
        return batch.slots, failed, batch.finished - batch.started

    def close(self) -> None:
        """Finish the batch in flight and stop the thread."""
        self.finish()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        if self._threads is not None:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op after it binds its
            # OpenMP threads; torch._C.set_num_threads is the original (it sets this thread's
            # OpenMP count, and the count of threads that start torch after it).
            torch._C.set_num_threads(self._threads)
        while True:
            with self._cond:
                while not self._closed and (self._batch is None or self._pending() is None):
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._batch
            assert batch is not None
            with torch.inference_mode():  # vLLM's KV cache tensors are inference tensors
                self._copy(batch)

    def _pending(self) -> _Batch | None:
        batch = self._batch
        return batch if batch is not None and batch.done < self._num_layers else None

    def _copy(self, batch: _Batch) -> None:
        for layer in range(self._num_layers):
            if not batch.failed:
                try:
                    self._copy_layer(layer, batch.slots, batch.block_ids)
                except Exception as e:  # a miss, never an exception in vLLM's forward
                    log.warning(
                        "KV layer load failed (layer %d, %d blocks are recomputed): %s",
                        layer,
                        len(batch.block_ids),
                        e,
                    )
                    batch.failed = True
            with self._cond:
                batch.done = layer + 1
                if batch.done == self._num_layers:
                    batch.finished = time.perf_counter()
                self._cond.notify_all()
