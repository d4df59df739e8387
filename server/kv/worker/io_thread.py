"""The worker's I/O thread: disk and Redis reads, writes and removals off vLLM's step.

One thread per worker takes jobs from a :class:`~server.kv.worker.io_queue.JobQueue`: reads first,
then writes and removals in FIFO order (a removal planned before a write of the same key runs
first). A read of a block whose write is still queued is served from that write's buffer.
Redis reads queued together go in one pipelined round trip (up to 64 blocks). Any disk or
Redis error is a miss plus a warning, never an exception to vLLM. The worker applies the
results on its own thread (:meth:`IOThread.results`, from ``collect``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from server.kv.metadata import LoadItem
from server.kv.tiers.disk import DiskStore
from server.kv.tiers.redis import RedisStore
from server.kv.worker.io_queue import JobQueue

log = logging.getLogger(__name__)


@dataclass
class Read:
    """One block read into ``buffer`` (a RAM slot, or a temporary buffer for ``NO_SLOT``);
    ``req_id`` when it feeds an async load: ``item`` for a paged block, ``shift_source`` for
    the job's shifted source of that number; ``error`` is set when it failed."""

    key: str
    slot: int
    buffer: torch.Tensor
    source: str = "disk"
    item: LoadItem | None = None
    req_id: str | None = None
    error: str | None = None
    shift_source: int | None = None


class IOThread:
    """Runs the worker's disk and Redis jobs on a daemon thread; :meth:`results` yields
    ``(kind, payload)`` of finished ones: ``("read", Read)``, ``("written", (key,
    seconds))``, ``("write_failed", key)``, ``("redis_written", key)``,
    ``("redis_failed", key)``, ``("removed", key)``."""

    def __init__(self, store: DiskStore | None, redis: RedisStore | None) -> None:
        self.store = store
        self.redis = redis
        self._done: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._jobs = JobQueue()
        self._pending_writes: dict[str, torch.Tensor] = {}
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._io_loop, name="lgkv-disk-io", daemon=True)
        self._thread.start()

    def read(self, read: Read) -> None:
        """Queue a read (ahead of writes and removals)."""
        self._jobs.put_read(("read", read))

    def write(self, key: str, data: torch.Tensor, tokens: tuple[str, bytes] | None = None) -> None:
        """Queue a disk write of ``data`` (a private copy: reads of ``key`` use it until the
        file is written); ``tokens``: its parent key and token ids, for the file's header."""
        with self._pending_lock:
            self._pending_writes[key] = data
        self._jobs.put(("write", (key, data, tokens)))

    def redis_write(self, key: str, data: torch.Tensor) -> None:
        """Queue a Redis write of ``data``."""
        self._jobs.put(("redis_write", (key, data)))

    def remove(self, key: str) -> None:
        """Queue the removal of ``key``'s file (after the writes queued before it)."""
        self._jobs.put(("remove", key))

    def results(self) -> Iterator[tuple[str, object]]:
        """The jobs finished since the last call, in the order they finished."""
        while True:
            try:
                yield self._done.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """Finish the queued jobs and stop the thread."""
        self._jobs.close()
        self._thread.join(timeout=30)

    def _read_redis(self, reads: list[Read]) -> None:
        """Read several queued Redis blocks in one round trip (a block whose disk write is
        still queued is served from the write's buffer, as disk reads are)."""
        assert self.redis is not None
        fetch: list[Read] = []
        for read in reads:
            with self._pending_lock:
                queued = self._pending_writes.get(read.key)
            if queued is None:
                fetch.append(read)
            else:
                read.buffer.copy_(queued)
                self._done.put(("read", read))
        errors = self.redis.read_many_into(
            [r.key for r in fetch], [memoryview(r.buffer.numpy()) for r in fetch]
        )
        for read, error in zip(fetch, errors, strict=True):
            read.error = error
            self._done.put(("read", read))

    def _io_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, payload = job
            try:
                self._run_job(kind, payload)
            except Exception:  # never let the thread die
                log.exception("KV disk job %s failed", kind)

    def _run_job(self, kind: str, payload: object) -> None:
        store = self.store
        if kind == "read":
            assert isinstance(payload, Read)
            if payload.source == "redis" and self.redis is not None:
                self._read_redis([payload, *self._jobs.take_reads(_is_redis_read, 63)])
                return
            with self._pending_lock:
                queued = self._pending_writes.get(payload.key)
            if queued is not None:  # its write waits behind others: serve the bytes we hold
                payload.buffer.copy_(queued)
            elif store is None:
                payload.error = f"no {payload.source} tier"
            else:
                try:
                    store.read_into(payload.key, memoryview(payload.buffer.numpy()))
                except OSError as e:
                    payload.error = str(e)
            self._done.put(("read", payload))
        elif kind == "redis_write" and self.redis is not None:
            key, data = payload  # type: ignore[misc]
            try:
                self.redis.write(key, memoryview(data.numpy()))
                self._done.put(("redis_written", key))
            except OSError as e:
                log.debug("KV block %s not written to redis: %s", key[:16], e)
                self._done.put(("redis_failed", key))
        elif kind == "write" and store is not None:
            key, data, tokens = payload  # type: ignore[misc]
            started = time.perf_counter()
            try:
                store.write(key, memoryview(data.numpy()), tokens)
                self._done.put(("written", (key, time.perf_counter() - started)))
            except OSError as e:
                log.warning("KV block %s not written to disk: %s", key[:16], e)
                self._done.put(("write_failed", key))
            finally:
                with self._pending_lock:
                    if self._pending_writes.get(key) is data:
                        del self._pending_writes[key]
        elif kind == "remove":
            if store is not None:
                try:
                    store.remove(payload)  # type: ignore[arg-type]
                except OSError as e:
                    log.warning("KV block file %s not removed: %s", payload, e)
            self._done.put(("removed", payload))  # confirmed even when it failed


def _is_redis_read(payload: object) -> bool:
    return isinstance(payload, Read) and payload.source == "redis"
