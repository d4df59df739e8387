"""The worker's queue of background I/O jobs (disk and Redis reads, writes, removals).

One I/O thread per worker takes jobs from a :class:`JobQueue`: reads first, since a request
waits on them, then writes and removals in FIFO order. :meth:`JobQueue.take_reads` lets the
thread batch reads of one tier (Redis blocks go in one pipelined round trip).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class JobQueue:
    """Disk jobs for the I/O thread: reads first (a request waits on them), then writes and
    removals in FIFO order. A read of a block whose write is still queued is served from the
    write's buffer, so reads never see a missing file for a block that is being written."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reads: deque[tuple[str, object]] = deque()
        self._jobs: deque[tuple[str, object]] = deque()
        self._closed = False

    def put(self, job: tuple[str, object]) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def put_read(self, job: tuple[str, object]) -> None:
        with self._cond:
            self._reads.append(job)
            self._cond.notify()

    def take_reads(self, wanted: Callable[[object], bool], limit: int) -> list[Any]:
        """Up to ``limit`` more queued reads whose payload is ``wanted`` (to batch them)."""
        with self._cond:
            taken = [job for job in self._reads if wanted(job[1])][:limit]
            for job in taken:
                self._reads.remove(job)
        return [payload for _, payload in taken]

    def close(self) -> None:
        """Stop after the queued jobs."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def get(self) -> tuple[str, object] | None:
        """The next job, or None once closed and empty."""
        with self._cond:
            while not (self._reads or self._jobs or self._closed):
                self._cond.wait()
            if self._reads:
                return self._reads.popleft()
            if self._jobs:
                return self._jobs.popleft()
            return None
