"""``AsyncThreadSessions``: the async twin of :class:`.kv_sessions.ThreadSessions`.

Same behaviour (see :mod:`.kv_sessions`), for :class:`AsyncSQLAlchemySaver`: SQL through the
saver's ``await _run``, the server through :class:`AsyncKVCacheClient`, and the background calls
of ``get_tuple`` as tasks on the saver's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple

from langgraph_kvcache.checkpoint import kv_store
from langgraph_kvcache.checkpoint.hooks import LifecycleHooks
from langgraph_kvcache.checkpoint.kv_sessions import (
    KVSessionOptions,
    Tracker,
    copy_calls,
    delete_calls,
    log_unavailable,
    thread_key,
    warm_plan,
)
from langgraph_kvcache.checkpoint.kv_store import SessionCall
from langgraph_kvcache.client import (
    AsyncKVCacheClient,
    KVCacheClientError,
    ServerUnavailableError,
    SessionExistsError,
    SessionNotFoundError,
)
from langgraph_kvcache.sessions import session_id_for

if TYPE_CHECKING:
    from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver

__all__ = ["AsyncThreadSessions"]

logger = logging.getLogger("langgraph_kvcache.checkpoint.kv_sessions")

_DRAIN_BATCH = 100


async def arun_logged(coro: Coroutine[Any, Any, Any]) -> None:
    """Async :func:`run_logged`."""
    try:
        await coro
    except Exception:
        logger.exception("background KV session job failed")


class AsyncThreadSessions(LifecycleHooks):
    """Async twin of :class:`ThreadSessions` for :class:`AsyncSQLAlchemySaver` (its background
    calls are tasks on the saver's loop)."""

    def __init__(self, saver: AsyncSQLAlchemySaver, options: KVSessionOptions) -> None:
        self.saver = saver
        self.options = options
        self.client = AsyncKVCacheClient(
            options.server_url, options.api_key, timeout=options.call_timeout_s
        )
        self._tracker = Tracker(options)
        self._drain_lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _settle(self) -> None:
        """See :meth:`ThreadSessions._settle`."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2 * self.options.call_timeout_s + 1)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(arun_logged(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- hooks -----------------------------------------------------------------------------

    async def _aafter_get_tuple(
        self, config: RunnableConfig, found: CheckpointTuple | None
    ) -> None:
        key = thread_key(config)
        due, new = self._tracker.due(key)
        if due:
            op = kv_store.op_touch(self.saver.dialect, [key], time.time())
            await self.saver._run(op, "single")
            register, prefetch = warm_plan(self.options, found, new)
            if register or prefetch:
                self._spawn(self._warm(session_id_for(*key), register, prefetch))
        if self._tracker.retry_due():
            self._spawn(self.drain())

    async def _aafter_delete_threads(self, thread_ids: Sequence[str]) -> None:
        await self._settle()
        sessions = await self.saver._run(kv_store.op_forget(thread_ids), "write")
        self._tracker.forget(thread_ids)
        await self.send(delete_calls(thread_ids, sessions))

    async def _aafter_copy_thread(self, source: str, target: str) -> None:
        await self._settle()
        pairs = await self.saver._run(kv_store.op_namespaces([source]))
        calls, rows = copy_calls(source, target, pairs)
        await self.saver._run(kv_store.op_touch(self.saver.dialect, rows, time.time()), "write")
        await self.send(calls)

    async def _aafter_delete_for_runs(
        self, run_ids: Sequence[str], thread_ids: Sequence[str]
    ) -> None:
        emptied = await self.saver._run(kv_store.op_threads_without_checkpoints(thread_ids))
        if emptied:
            await self._aafter_delete_threads(emptied)

    # -- public ----------------------------------------------------------------------------

    async def sweep_expired(self, *, limit: int = 1000) -> list[str]:
        """See :meth:`ThreadSessions.sweep_expired`."""
        if self.options.ttl_seconds is None:
            return []
        await self._settle()
        cutoff = time.time() - self.options.ttl_seconds
        op = kv_store.op_sweep(self.saver._op_delete_threads, cutoff, limit)
        threads, sessions = await self.saver._run(op, "write")
        self._tracker.forget(threads)
        await self.send(delete_calls(threads, sessions))
        return threads

    async def send(self, calls: Sequence[SessionCall]) -> None:
        """See :meth:`ThreadSessions.send`."""
        if not calls:
            return
        if self._tracker.outbox_pending is not False:
            op = kv_store.op_enqueue(calls, "queued behind pending calls")
            await self.saver._run(op, "write")
            self._tracker.outbox_pending = True
            await self.drain()
            return
        for i, call in enumerate(calls):
            try:
                await self._apply(call)
            except ServerUnavailableError as exc:
                log_unavailable(f"{call.op} of {call.session_id!r} queued for", exc)
                await self.saver._run(kv_store.op_enqueue(calls[i:], str(exc)), "write")
                self._tracker.outbox_pending = True
                return
            except KVCacheClientError as exc:
                logger.warning("session call %s refused: %s", call, exc)

    async def drain(self) -> int:
        """See :meth:`ThreadSessions.drain`."""
        if self._drain_lock is None:
            self._drain_lock = asyncio.Lock()
        sent = 0
        async with self._drain_lock:
            while True:
                rows = await self.saver._run(kv_store.op_pending(_DRAIN_BATCH))
                if not rows:
                    self._tracker.outbox_pending = False
                    return sent
                for row in rows:
                    try:
                        await self._apply(row.call)
                    except ServerUnavailableError as exc:
                        log_unavailable(f"{len(rows)}+ pending session calls retried", exc)
                        await self.saver._run(kv_store.op_failed(row.id, str(exc)), "single")
                        self._tracker.outbox_pending = True
                        return sent
                    except KVCacheClientError as exc:
                        logger.warning("dropping session call %s: %s", row.call, exc)
                    await self.saver._run(kv_store.op_done(row.id), "single")
                    sent += 1

    async def aclose(self) -> None:
        """Wait for background calls (bounded by ``call_timeout_s`` each), close the client."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    # -- server calls ----------------------------------------------------------------------

    async def _apply(self, call: SessionCall) -> None:
        """See :meth:`ThreadSessions._apply`."""
        try:
            if call.op == "delete":
                await self.client.delete_session(call.session_id)
            elif call.op == "copy":
                assert call.target_id is not None
                await self.client.copy_session(call.session_id, call.target_id, overwrite=True)
            else:
                ttl = self.options.ttl_seconds
                try:
                    await self.client.create_session(call.session_id, ttl_seconds=ttl)
                except SessionExistsError:
                    if ttl is not None:
                        await self.client.update_session(call.session_id, ttl_seconds=ttl)
        except SessionNotFoundError:
            return

    async def _warm(self, session_id: str, register: bool, prefetch: bool) -> None:
        """See :meth:`ThreadSessions._warm`."""
        if register:
            await self.send([SessionCall("register", session_id)])
        if not prefetch:
            return
        try:
            await self.client.prefetch(session_id)
        except SessionNotFoundError:
            pass
        except KVCacheClientError as exc:
            logger.warning("prefetch of session %r failed: %s", session_id, exc)
