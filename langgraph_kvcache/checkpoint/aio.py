"""``AsyncSQLAlchemySaver``: the LangGraph checkpointer on a SQLAlchemy ``AsyncEngine``.

Drop-in for ``AsyncSqliteSaver`` / ``AsyncPostgresSaver``::

    async with AsyncSQLAlchemySaver.from_conn_string("sqlite:///checkpoints.db") as saver:
        await saver.setup()
        graph = builder.compile(checkpointer=saver)

Like ``AsyncPostgresSaver``, the sync methods (``get_tuple``, ``put``, ...) run the async ones on
the saver's event loop and wait, so they may be called from other threads (e.g. a sync node
inside ``ainvoke``) but not from the loop's own thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from langgraph_kvcache.checkpoint.base import (
    BaseSQLAlchemySaver,
    Mode,
    Op,
    execution_options,
)
from langgraph_kvcache.checkpoint.engine import (
    engine_kwargs,
    normalize_url,
    prepare_engine,
)
from langgraph_kvcache.checkpoint.hooks import LifecycleHooks
from langgraph_kvcache.checkpoint.maintenance import check_prune_args
from langgraph_kvcache.checkpoint.sessions.aio import AsyncThreadSessions
from langgraph_kvcache.checkpoint.sessions.keeper import Runner
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions, resolve_options
from langgraph_kvcache.errors import UnsupportedDatabaseError

T = TypeVar("T")


async def arun_op(conn: AsyncConnection, op: Op[T]) -> T:
    """Run an operation's statements on ``conn``; returns the operation's result."""
    try:
        stmt = next(op)
        while True:
            result = await conn.execute(stmt.statement, stmt.params)
            stmt = op.send(list(result.mappings()) if stmt.fetch else [])
    except StopIteration as stop:
        return stop.value


class AsyncSQLAlchemySaver(BaseSQLAlchemySaver):
    """Checkpointer storing LangGraph checkpoints through a SQLAlchemy ``AsyncEngine``.

    Works on SQLite (``aiosqlite``; file or ``:memory:``) and PostgreSQL (psycopg 3 async).
    Await :meth:`setup` once before first use (idempotent, safe from several processes).

    Args:
        engine: The async engine. On SQLite the saver installs connect/begin listeners on its
            ``sync_engine`` (WAL, busy timeout, ``BEGIN IMMEDIATE`` for writes).
        serde: Serializer; defaults to ``JsonPlusSerializer``.
        kv_server: URL of a langgraph-kvcache server (or full :class:`KVSessionOptions`): keep
            its sessions in step with the threads (see :mod:`.sessions.sync`). ``None``: a plain
            SQL checkpointer.
        kv_api_key: The server's bearer key, when it runs with ``--api-key``.
        ttl_seconds: Idle time after which threads and their sessions expire (server TTL, and
            :meth:`asweep_expired` here). Needs ``kv_server``.
        snapshot_every: As for :class:`~.sync.SQLAlchemySaver`: a full snapshot of an
            append-only list channel every ``snapshot_every`` versions (default 100).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        serde: SerializerProtocol | None = None,
        kv_server: str | KVSessionOptions | None = None,
        kv_api_key: str | None = None,
        ttl_seconds: float | None = None,
        snapshot_every: int | None = None,
    ) -> None:
        super().__init__(serde=serde)
        options = resolve_options(kv_server, kv_api_key, ttl_seconds)
        if not hasattr(engine, "sync_engine"):
            raise TypeError("AsyncSQLAlchemySaver needs an AsyncEngine; use SQLAlchemySaver")
        if engine.dialect.name not in ("sqlite", "postgresql"):
            raise UnsupportedDatabaseError(
                f"AsyncSQLAlchemySaver supports SQLite and PostgreSQL, not {engine.dialect.name!r}"
            )
        prepare_engine(engine.sync_engine)
        self.engine = engine
        self.dialect = engine.dialect.name
        self._init_lists(snapshot_every)
        self._lock: AbstractAsyncContextManager[Any] = (
            asyncio.Lock() if isinstance(engine.sync_engine.pool, StaticPool) else nullcontext()
        )
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        runner = Runner(self.dialect, self._run, self._op_delete_threads)
        self.kv_sessions = AsyncThreadSessions(runner, options) if options else None
        """The server session keeper (``None`` without ``kv_server``)."""
        self.lifecycle: LifecycleHooks = self.kv_sessions or self
        """Whose lifecycle hooks run: the session keeper, else the saver's own (no-ops)."""

    @classmethod
    @asynccontextmanager
    async def from_conn_string(
        cls,
        url: str | URL,
        *,
        serde: SerializerProtocol | None = None,
        kv_server: str | KVSessionOptions | None = None,
        kv_api_key: str | None = None,
        ttl_seconds: float | None = None,
        snapshot_every: int | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AsyncSQLAlchemySaver]:
        """Create a saver on a new async engine for ``url``, disposed of on exit.

        Plain ``sqlite:///...`` / ``postgresql://...`` URLs get the ``aiosqlite`` / ``psycopg``
        drivers. ``kv_server``, ``kv_api_key``, ``ttl_seconds`` and ``snapshot_every`` are the
        constructor's; other ``kwargs`` go to ``create_async_engine``.
        """
        parsed = normalize_url(url, asynchronous=True)
        engine = create_async_engine(parsed, **{**engine_kwargs(parsed), **kwargs})
        saver = None
        try:
            saver = cls(
                engine,
                serde=serde,
                kv_server=kv_server,
                kv_api_key=kv_api_key,
                ttl_seconds=ttl_seconds,
                snapshot_every=snapshot_every,
            )
            yield saver
        finally:
            if saver is not None and saver.kv_sessions is not None:
                await saver.kv_sessions.aclose()
            await engine.dispose()

    async def _run(self, op: Op[T], mode: Mode = "read") -> T:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        async with self._lock, self.engine.connect() as conn:
            await conn.execution_options(**execution_options(self.dialect, mode))
            async with conn.begin():
                return await arun_op(conn, op)

    async def setup(self) -> None:
        """Create or migrate the tables (append-only migrations; idempotent, multi-process safe).
        With ``kv_server``, also look at the server: a key it refuses raises
        :class:`~langgraph_kvcache.client.AuthenticationError` (the server down is a warning)."""
        await self._run(self._op_setup(), "write")
        if self.kv_sessions is not None:
            await self.kv_sessions.check_server()

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (its ``checkpoint_id``, else the thread's latest)."""
        found = await self._run(self._op_get_tuple(config))
        await self.lifecycle._aafter_get_tuple(config, found)
        return found

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Per-channel writes and seed along ``config``'s parent chain (``DeltaChannel``)."""
        return await self._run(self._op_delta_history(config, channels))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Sync :meth:`aget_delta_channel_history`, run on the saver's loop (another thread)."""
        return self._wait(self.aget_delta_channel_history(config=config, channels=channels))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints newest first, by thread/namespace, metadata filter, ``before``, ``limit``."""
        for item in await self._run(self._op_list(config, filter, before, limit)):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Save a checkpoint and the channel values whose version is new; one transaction."""
        rows, mode = self._put_rows(config, checkpoint, metadata, new_versions)
        saved: RunnableConfig = await self._run(self._op_put(rows), mode)
        self.lifecycle._after_checkpoint(config, checkpoint)
        return saved

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Save a task's pending writes against the checkpoint in ``config``."""
        rows, mode = self._write_rows(config, writes, task_id, task_path)
        await self._run(self._op_put_writes(rows), mode)
        self._after_put_writes(rows)
        self.lifecycle._after_task_writes(config, writes)

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, blob and write of ``thread_id`` (all namespaces)."""
        ids = [str(thread_id)]
        op = self.lifecycle._tx_delete_threads(self._op_delete_threads(ids), ids)
        await self._run(op, "write")
        await self.lifecycle._aafter_delete_threads(ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, blob and write of a thread to a new, empty thread."""
        source, target = str(source_thread_id), str(target_thread_id)
        op = self.lifecycle._tx_copy_thread(self._op_copy_thread(source, target), source, target)
        await self._run(op, "write")
        await self.lifecycle._aafter_copy_thread(source, target)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``"keep_latest"``: keep each namespace's latest checkpoint; ``"delete"``: drop all."""
        ids = check_prune_args(thread_ids, strategy)
        if not ids:
            return
        op = self._op_prune(ids, strategy)
        if strategy == "delete":
            op = self.lifecycle._tx_delete_threads(op, ids)
        await self._run(op, "write")
        if strategy == "delete":
            await self.lifecycle._aafter_delete_threads(ids)
        await self.lifecycle._aafter_prune(ids, strategy)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints whose metadata ``run_id`` is in ``run_ids``, with their writes."""
        if not run_ids:
            return
        op = self.lifecycle._tx_delete_for_runs(self._op_delete_for_runs(run_ids), run_ids)
        threads = await self._run(op, "write")
        await self.lifecycle._aafter_delete_for_runs(list(run_ids), threads)

    async def asweep_expired(self) -> list[str]:
        """Delete the threads unused for ``ttl_seconds`` with their server sessions; returns
        their ids (none without ``kv_server`` and ``ttl_seconds``)."""
        return await self.kv_sessions.sweep_expired() if self.kv_sessions else []

    def sweep_expired(self) -> list[str]:
        """Sync :meth:`asweep_expired`, run on the saver's loop (call from another thread)."""
        return self._wait(self.asweep_expired())

    # -- sync interface: the async methods on the saver's loop -----------------------------

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            coro.close()
            raise asyncio.InvalidStateError(
                "Synchronous calls to AsyncSQLAlchemySaver are only allowed from a thread other "
                "than its event loop's. From the loop, use the async interface, e.g. "
                "`await checkpointer.aget_tuple(...)` or `await graph.ainvoke(...)`; without a "
                "loop, use SQLAlchemySaver."
            )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Sync :meth:`aget_tuple`, run on the saver's loop (call from another thread)."""
        return self._wait(self.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Sync :meth:`alist`, run on the saver's loop (call from another thread)."""
        yield from self._wait(self._run(self._op_list(config, filter, before, limit)))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Sync :meth:`aput`, run on the saver's loop (call from another thread)."""
        return self._wait(self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Sync :meth:`aput_writes`, run on the saver's loop (call from another thread)."""
        self._wait(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        """Sync :meth:`adelete_thread`, run on the saver's loop (call from another thread)."""
        self._wait(self.adelete_thread(thread_id))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Sync :meth:`acopy_thread`, run on the saver's loop (call from another thread)."""
        self._wait(self.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Sync :meth:`aprune`, run on the saver's loop (call from another thread)."""
        self._wait(self.aprune(thread_ids, strategy=strategy))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Sync :meth:`adelete_for_runs`, run on the saver's loop (call from another thread)."""
        self._wait(self.adelete_for_runs(run_ids))
