"""``SQLAlchemySaver``: the LangGraph checkpointer on a synchronous SQLAlchemy ``Engine``.

Drop-in for ``SqliteSaver`` / ``PostgresSaver``::

    with SQLAlchemySaver.from_conn_string("sqlite:///checkpoints.db") as saver:
        saver.setup()
        graph = builder.compile(checkpointer=saver)

The async methods (``aget_tuple``, ``aput``, ...) run the sync ones in a worker thread, so the
saver also works with ``graph.ainvoke``; on an event loop prefer :class:`AsyncSQLAlchemySaver`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL
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
from langgraph_kvcache.checkpoint.plain import PLAIN_DRIVERS, HeldConnection, run_op, run_plain
from langgraph_kvcache.checkpoint.sessions.keeper import Runner
from langgraph_kvcache.checkpoint.sessions.sync import (
    KVSessionOptions,
    ThreadSessions,
    resolve_options,
)
from langgraph_kvcache.errors import UnsupportedDatabaseError

T = TypeVar("T")


class SQLAlchemySaver(BaseSQLAlchemySaver):
    """Checkpointer storing LangGraph checkpoints through a sync SQLAlchemy ``Engine``.

    Works on SQLite (file or ``:memory:``) and PostgreSQL (psycopg 3). Call :meth:`setup` once
    before first use (it is idempotent and safe to call from several processes).

    Args:
        engine: The engine. On SQLite the saver installs connect/begin listeners on it (WAL,
            busy timeout, ``BEGIN IMMEDIATE`` for writes); create it with ``StaticPool`` for
            ``:memory:`` (``from_conn_string`` does all of this for you).
        serde: Serializer for checkpoints, channel values and writes; defaults to
            ``JsonPlusSerializer``. ``EncryptedSerializer`` works too.
        kv_server: URL of a langgraph-kvcache server (or full :class:`KVSessionOptions`): keep
            its sessions in step with the threads (see :mod:`.sessions.sync`). ``None``: a plain
            SQL checkpointer.
        kv_api_key: The server's bearer key, when it runs with ``--api-key``.
        ttl_seconds: Idle time after which threads and their sessions expire (server TTL, and
            :meth:`sweep_expired` here). Needs ``kv_server``.
        snapshot_every: List channels that grow by appending store each version as the new
            items' references plus a link to the version it extends, with a full snapshot (of
            item references) every ``snapshot_every`` versions (default 100; 1: every version
            a snapshot); a read follows at most two links. See :mod:`.lists` and the docs page
            "Checkpoint storage".
    """

    def __init__(
        self,
        engine: Engine,
        *,
        serde: SerializerProtocol | None = None,
        kv_server: str | KVSessionOptions | None = None,
        kv_api_key: str | None = None,
        ttl_seconds: float | None = None,
        snapshot_every: int | None = None,
    ) -> None:
        super().__init__(serde=serde)
        options = resolve_options(kv_server, kv_api_key, ttl_seconds)
        if hasattr(engine, "sync_engine"):
            raise TypeError("SQLAlchemySaver needs a sync Engine; use AsyncSQLAlchemySaver")
        if engine.dialect.name not in ("sqlite", "postgresql"):
            raise UnsupportedDatabaseError(
                f"SQLAlchemySaver supports SQLite and PostgreSQL, not {engine.dialect.name!r}"
            )
        prepare_engine(engine)
        self.engine = engine
        self.dialect = engine.dialect.name
        self._init_lists(snapshot_every)
        # One shared connection (``:memory:``) must not run two transactions at once.
        self._lock: AbstractContextManager[Any] = (
            threading.Lock() if isinstance(engine.pool, StaticPool) else nullcontext()
        )
        self._held = None if isinstance(engine.pool, StaticPool) else HeldConnection(engine)
        """The connection the hot path keeps between calls (none with ``StaticPool``: its one
        connection is shared, ``_lock`` guards it)."""
        runner = Runner(self.dialect, self._run, self._op_delete_threads)
        self.kv_sessions = ThreadSessions(runner, options) if options else None
        """The server session keeper (``None`` without ``kv_server``)."""
        self.lifecycle: LifecycleHooks = self.kv_sessions or self
        """Whose lifecycle hooks run: the session keeper, else the saver's own (no-ops)."""

    @classmethod
    @contextmanager
    def from_conn_string(
        cls,
        url: str | URL,
        *,
        serde: SerializerProtocol | None = None,
        kv_server: str | KVSessionOptions | None = None,
        kv_api_key: str | None = None,
        ttl_seconds: float | None = None,
        snapshot_every: int | None = None,
        **kwargs: Any,
    ) -> Iterator[SQLAlchemySaver]:
        """Create a saver on a new engine for ``url``, disposed of on exit.

        ``url`` may be a plain ``sqlite:///path.db``, ``sqlite:///:memory:`` or
        ``postgresql://...`` URL; the driver is chosen for you. ``kv_server``, ``kv_api_key``,
        ``ttl_seconds`` and ``snapshot_every`` are the constructor's; other ``kwargs`` go to
        ``sqlalchemy.create_engine``.
        """
        parsed = normalize_url(url, asynchronous=False)
        engine = create_engine(parsed, **{**engine_kwargs(parsed), **kwargs})
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
            if saver is not None:
                saver.release_connection()
                if saver.kv_sessions is not None:
                    saver.kv_sessions.close()
            engine.dispose()

    def release_connection(self) -> None:
        """Return the connection the saver keeps between ``get_tuple``/``put``/``put_writes``
        calls to the engine's pool (the next call checks one out again). Call it before
        disposing of an engine you passed in, to close that connection with the pool's."""
        if self._held is not None:
            self._held.close()

    def _run(self, op: Op[T], mode: Mode = "read") -> T:
        with self._lock, self.engine.connect() as conn:
            conn.execution_options(**execution_options(self.dialect, mode))
            with conn.begin():
                return run_op(conn, op)

    def _run_raw(self, op: Op[T], mode: Mode = "read") -> T:
        """Run an operation made only of ``plain`` statements straight on a pooled DBAPI
        connection, without a SQLAlchemy ``Connection`` (the hot paths: ``get_tuple``, ``put``,
        ``put_writes``). Transactions as in :func:`~.base.execution_options`: SQLite writes in
        ``BEGIN IMMEDIATE`` ... ``COMMIT``, single statements and reads in autocommit."""
        if self.engine.dialect.driver not in PLAIN_DRIVERS:
            return self._run(op, mode)
        with self._lock:
            held = self._held
            raw = held.take() if held is not None else self.engine.raw_connection()
            driver = raw.driver_connection
            ok = False
            sqlite = self.dialect == "sqlite"
            try:
                if sqlite and mode == "write":
                    driver.execute("BEGIN IMMEDIATE")
                elif not sqlite:
                    driver.autocommit = mode != "write"
                try:
                    stmt = next(op)
                    while True:
                        if not stmt.plain:
                            raise TypeError(f"not a plain statement: {stmt.statement}")
                        stmt = op.send(run_plain(self.engine.dialect, driver, stmt))
                except StopIteration as stop:
                    result = stop.value
                driver.commit()
                ok = True
                return result
            except BaseException:
                driver.rollback()
                raise
            finally:
                if not sqlite:
                    driver.autocommit = False
                if held is not None:
                    held.give(raw, ok)
                else:
                    raw.close()

    def setup(self) -> None:
        """Create or migrate the tables (append-only migrations; idempotent, multi-process safe).
        With ``kv_server``, also look at the server: a key it refuses raises
        :class:`~langgraph_kvcache.client.AuthenticationError` (the server down is a warning)."""
        self._run(self._op_setup(), "write")
        if self.kv_sessions is not None:
            self.kv_sessions.check_server()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (its ``checkpoint_id``, else the thread's latest)."""
        found = self._run_raw(self._op_get_tuple(config))
        self.lifecycle._after_get_tuple(config, found)
        return found

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Per-channel writes and seed along ``config``'s parent chain (``DeltaChannel``)."""
        return self._run_raw(self._op_delta_history(config, channels))

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Async :meth:`get_delta_channel_history` (runs in a worker thread)."""
        return await asyncio.to_thread(
            self.get_delta_channel_history, config=config, channels=channels
        )

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first, by thread/namespace, metadata filter, ``before``, ``limit``."""
        yield from self._run(self._op_list(config, filter, before, limit))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Save a checkpoint and the channel values whose version is new; one transaction."""
        rows, mode = self._put_rows(config, checkpoint, metadata, new_versions)
        saved: RunnableConfig = self._run_raw(self._op_put(rows), mode)
        self.lifecycle._after_checkpoint(config, checkpoint)
        return saved

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Save a task's pending writes against the checkpoint in ``config``."""
        rows, mode = self._write_rows(config, writes, task_id, task_path)
        self._run_raw(self._op_put_writes(rows), mode)
        self._after_put_writes(rows)
        self.lifecycle._after_task_writes(config, writes)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, blob and write of ``thread_id`` (all namespaces)."""
        ids = [str(thread_id)]
        self._run(self.lifecycle._tx_delete_threads(self._op_delete_threads(ids), ids), "write")
        self.lifecycle._after_delete_threads(ids)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, blob and write of a thread to a new, empty thread."""
        source, target = str(source_thread_id), str(target_thread_id)
        op = self.lifecycle._tx_copy_thread(self._op_copy_thread(source, target), source, target)
        self._run(op, "write")
        self.lifecycle._after_copy_thread(source, target)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``"keep_latest"``: keep each namespace's latest checkpoint; ``"delete"``: drop all.

        ``keep_latest`` refuses (``NotImplementedError``) threads that use a ``DeltaChannel``,
        like the PostgreSQL saver, since their latest value is rebuilt from older checkpoints.
        """
        ids = check_prune_args(thread_ids, strategy)
        if not ids:
            return
        op = self._op_prune(ids, strategy)
        if strategy == "delete":
            op = self.lifecycle._tx_delete_threads(op, ids)
        self._run(op, "write")
        if strategy == "delete":
            self.lifecycle._after_delete_threads(ids)
        self.lifecycle._after_prune(ids, strategy)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints whose metadata ``run_id`` is in ``run_ids``, with their writes."""
        if not run_ids:
            return
        op = self.lifecycle._tx_delete_for_runs(self._op_delete_for_runs(run_ids), run_ids)
        threads = self._run(op, "write")
        self.lifecycle._after_delete_for_runs(list(run_ids), threads)

    def sweep_expired(self) -> list[str]:
        """Delete the threads unused for ``ttl_seconds`` with their server sessions; returns
        their ids (none without ``kv_server`` and ``ttl_seconds``)."""
        return self.kv_sessions.sweep_expired() if self.kv_sessions else []

    async def asweep_expired(self) -> list[str]:
        """Async :meth:`sweep_expired` (runs in a worker thread)."""
        return await asyncio.to_thread(self.sweep_expired)

    # -- async interface: the sync methods in a worker thread ------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Async :meth:`get_tuple` (runs in a worker thread)."""
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Async :meth:`list` (runs in a worker thread)."""
        op = self._op_list(config, filter, before, limit)
        for item in await asyncio.to_thread(self._run, op):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Async :meth:`put` (runs in a worker thread)."""
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Async :meth:`put_writes` (runs in a worker thread)."""
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """Async :meth:`delete_thread` (runs in a worker thread)."""
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async :meth:`copy_thread` (runs in a worker thread)."""
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async :meth:`prune` (runs in a worker thread)."""
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async :meth:`delete_for_runs` (runs in a worker thread)."""
        await asyncio.to_thread(self.delete_for_runs, run_ids)
