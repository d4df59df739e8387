"""``AsyncThreadSessions``: the session keeper of :class:`AsyncSQLAlchemySaver`.

Same behaviour as :class:`.sync.ThreadSessions` (see :mod:`.sync`): it drives the
same steps (:mod:`.keeper`), SQL through the saver's async runner, the server through
:class:`AsyncKVCacheClient`, and ``get_tuple``'s background work as tasks on the saver's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple

from langgraph_kvcache.checkpoint.sessions.keeper import Runner, SessionKeeper, Steps, adrive
from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions
from langgraph_kvcache.client import AsyncKVCacheClient

__all__ = ["AsyncThreadSessions"]

logger = logging.getLogger("langgraph_kvcache.checkpoint.sessions.sync")

T = TypeVar("T")


async def arun_logged(coro: Coroutine[Any, Any, Any]) -> None:
    """Run a background task; its failure (e.g. the database gone) is logged, not lost."""
    try:
        await coro
    except Exception:
        logger.exception("background KV session job failed")


class AsyncThreadSessions(SessionKeeper):
    """Lifecycle hooks of :class:`AsyncSQLAlchemySaver` that keep the server's sessions in step
    (reach it as ``saver.kv_sessions``). Server work runs one job at a time under a lock."""

    def __init__(self, runner: Runner[Awaitable[Any]], options: KVSessionOptions) -> None:
        super().__init__(runner, options)
        self.client = AsyncKVCacheClient(
            options.server_url, options.api_key, timeout=options.call_timeout_s
        )
        self._server_lock: asyncio.Lock | None = None  # made on the saver's loop
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _serially(self, steps: Steps[T]) -> T:
        if self._server_lock is None:
            self._server_lock = asyncio.Lock()
        async with self._server_lock:
            return await adrive(steps, self.client, self.runner)

    async def _after_change(self) -> None:
        """See :meth:`.sync.ThreadSessions._after_change`."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2 * self.options.call_timeout_s + 1)
        await self.drain()

    # -- hooks -----------------------------------------------------------------------------

    async def _aafter_get_tuple(
        self, config: RunnableConfig, found: CheckpointTuple | None
    ) -> None:
        job = await adrive(self._get_tuple_steps(config, found), self.client, self.runner)
        if job is not None:
            self._submit(self._warm_steps(job))

    def _submit(self, steps: Steps[None]) -> None:
        """A task on the saver's loop (the caller runs on it)."""
        task = asyncio.get_running_loop().create_task(arun_logged(self._serially(steps)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _aafter_delete_threads(self, thread_ids: Sequence[str]) -> None:
        await self._after_change()

    async def _aafter_copy_thread(self, source: str, target: str) -> None:
        await self._after_change()

    async def _aafter_delete_for_runs(
        self, run_ids: Sequence[str], thread_ids: Sequence[str]
    ) -> None:
        await self._after_change()

    # -- public ----------------------------------------------------------------------------

    async def sweep_expired(self, *, limit: int = 1000) -> list[str]:
        """See :meth:`.sync.ThreadSessions.sweep_expired`."""
        if self.options.ttl_seconds is None:
            return []
        threads: list[str] = await self.runner.run(self._op_sweep(limit), "write")
        await self._after_change()
        return threads

    async def check_server(self) -> None:
        """``setup()``'s look at the server (see :meth:`SessionKeeper._check_key_steps`)."""
        await self._serially(self._check_key_steps())

    async def drain(self) -> int:
        """See :meth:`.sync.ThreadSessions.drain`."""
        return await self._serially(self._drain_steps())

    async def aclose(self) -> None:
        """Wait for background calls (bounded by ``call_timeout_s`` each), close the client."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
