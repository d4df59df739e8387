"""A fair share of vLLM's batch per tenant: one key's generations cannot fill it.

vLLM schedules first come, first served, up to ``--max-num-seqs`` requests in the running
batch; the rest wait in its queue in arrival order. So one key that keeps the batch full (a
load test, an agent fan-out) makes every other key wait for a slot: measured with
``benchmarks/tenants.py``, tenant B's time to first token went from 39 ms to 4.6 s while tenant
A ran a full batch of long generations.

:class:`GenerationGate` admits at most ``limit`` generations of each tenant into vLLM at once
(``--tenant-generation-share`` of ``--max-num-seqs``); a tenant's further generations wait
here, in arrival order, and enter as its own finish. Other tenants' requests never wait behind
them: the batch keeps room for them. A tenant with more than ``max_waiting`` generations
waiting gets 429 at once. One event loop only (the API process's), so plain counters suffice;
a waiting client that disconnects leaves the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from server.api.protocol import APIError


class GenerationGate:
    """At most ``limit`` generations of each tenant in vLLM at once (see the module doc)."""

    def __init__(self, limit: int, *, max_waiting: int) -> None:
        if limit < 1 or max_waiting < 0:
            raise ValueError("limit must be >= 1 and max_waiting >= 0")
        self.limit = limit
        self.max_waiting = max_waiting
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    def running(self, tenant: str) -> int:
        """The tenant's generations in vLLM now."""
        return self._running.get(tenant, 0)

    def waiting(self, tenant: str) -> int:
        """The tenant's generations waiting for a slot."""
        return len(self._waiting.get(tenant, ()))

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the tenant's slots for the block's duration (waiting for it, in
        arrival order); 429 when the tenant already has ``max_waiting`` generations waiting."""
        if self._running.get(tenant, 0) >= self.limit:
            await self._wait(tenant)
        else:
            self._running[tenant] = self._running.get(tenant, 0) + 1
        try:
            yield
        finally:
            self._release(tenant)

    async def _wait(self, tenant: str) -> None:
        queue = self._waiting.setdefault(tenant, deque())
        if len(queue) >= self.max_waiting:
            if not queue:
                del self._waiting[tenant]
            raise APIError(
                429,
                f"this key has {self._running[tenant]} generations running and {len(queue)} "
                f"waiting, the most the server allows (--tenant-generation-share of "
                f"--max-num-seqs: {self.limit} running); wait for them and retry",
                "rate_limit_error",
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        try:
            await turn  # _release hands this slot over: the running count stays as it is
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._release(tenant)  # handed over, then cancelled: pass the slot on
            else:
                queue.remove(turn)
                if not queue:
                    self._waiting.pop(tenant, None)
            raise

    def _release(self, tenant: str) -> None:
        queue = self._waiting.get(tenant)
        while queue:
            turn = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if not turn.done():
                turn.set_result(None)  # the slot passes to the next in line
                return
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]
