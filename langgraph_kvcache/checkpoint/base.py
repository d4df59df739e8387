"""Shared logic of the sync and async SQLAlchemy savers.

Each saver operation is written once here (deleting, copying and pruning in
:mod:`.maintenance`) as a generator of :class:`~.ops.Stmt` objects: it yields a
statement, receives the rows it returned, and finally returns its result. The sync saver
(:mod:`.sync`) and the async saver (:mod:`.aio`) only differ in how they run that generator
(``Connection.execute`` or ``await AsyncConnection.execute``) and in which transaction.

Session lifecycle extension point: after each operation that changes or reads a thread as a
whole the savers call a hook of :class:`~langgraph_kvcache.checkpoint.hooks.LifecycleHooks`
(no-ops there); a subclass that keeps a KV-cache server's sessions in step overrides them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from sqlalchemy import func, insert, select, text

from langgraph_kvcache.checkpoint import codec, compress, delta, filters, queries, write_queries
from langgraph_kvcache.checkpoint.engine import BEGIN_OPTION
from langgraph_kvcache.checkpoint.hooks import LifecycleHooks
from langgraph_kvcache.checkpoint.list_rows import DEFAULT_SNAPSHOT_EVERY, MissingItems
from langgraph_kvcache.checkpoint.lists import ListState
from langgraph_kvcache.checkpoint.maintenance import ThreadMaintenance
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS, statements_for
from langgraph_kvcache.checkpoint.ops import Mode, Op, Stmt
from langgraph_kvcache.checkpoint.schema import (
    checkpoints,
    migrations_table,
)
from langgraph_kvcache.errors import CheckpointerSetupError

T = TypeVar("T")

SETUP_LOCK_KEY = 0x6C676B76
"""PostgreSQL advisory lock key that serialises concurrent ``setup()`` calls."""


def execution_options(dialect: str, mode: Mode) -> dict[str, Any]:
    """Connection options for ``mode``: no transaction (and so no BEGIN/COMMIT round trips)
    unless the operation runs several write statements; on SQLite a write transaction takes the
    write lock at once (``BEGIN IMMEDIATE``) so concurrent writers queue on ``busy_timeout``."""
    if dialect == "postgresql":
        return {} if mode == "write" else {"isolation_level": "AUTOCOMMIT"}
    return {BEGIN_OPTION: "immediate" if mode == "write" else "none"}


class BaseSQLAlchemySaver(ThreadMaintenance, LifecycleHooks, BaseCheckpointSaver[str]):
    """Operations shared by :class:`SQLAlchemySaver` and :class:`AsyncSQLAlchemySaver`.

    Subclasses set ``dialect`` (``"sqlite"`` or ``"postgresql"``), call :meth:`_init_lists`
    and run the operations.
    """

    dialect: str
    lists: ListState
    """Append-aware list storage state (:mod:`.lists`)."""

    def _init_lists(self, snapshot_every: int | None) -> None:
        """Set up :attr:`lists` (after :attr:`dialect`); ``snapshot_every`` as documented on the
        savers. New items and bodies are compressed on the dialects of
        :data:`compress.COMPRESSED_DIALECTS`."""
        every = DEFAULT_SNAPSHOT_EVERY if snapshot_every is None else snapshot_every
        compressed = self.dialect in compress.COMPRESSED_DIALECTS
        self.lists = ListState(self.serde, every, compressed=compressed)

    def get_next_version(self, current: str | None, channel: None = None) -> str:
        """Next channel version: ``"<32-digit counter>.<random>"``, like the PostgreSQL saver."""
        return codec.next_version(current)

    # -- setup -----------------------------------------------------------------------------

    def _op_setup(self) -> Op[int]:
        """Apply every migration the database lacks; returns the schema version after."""
        if self.dialect == "postgresql":
            yield Stmt(select(func.pg_advisory_xact_lock(SETUP_LOCK_KEY)))
        for sql in statements_for(MIGRATIONS[0], self.dialect):
            yield Stmt(text(sql))
        rows = yield Stmt(select(func.max(migrations_table.c.v).label("v")), fetch=True)
        current = rows[0]["v"] if rows and rows[0]["v"] is not None else -1
        if current >= len(MIGRATIONS):
            raise CheckpointerSetupError(
                f"The database's checkpoint schema is at version {current}, newer than this "
                f"langgraph-kvcache knows ({len(MIGRATIONS) - 1}); upgrade langgraph-kvcache."
            )
        for version in range(current + 1, len(MIGRATIONS)):
            for sql in statements_for(MIGRATIONS[version], self.dialect):
                yield Stmt(text(sql))
            yield Stmt(insert(migrations_table).values(v=version))
        return len(MIGRATIONS) - 1

    # -- reads -----------------------------------------------------------------------------

    def _op_get_tuple(self, config: RunnableConfig) -> Op[CheckpointTuple | None]:
        configurable = config["configurable"]
        params = {
            "thread_id": str(configurable["thread_id"]),
            "checkpoint_ns": configurable.get("checkpoint_ns", ""),
        }
        if checkpoint_id := get_checkpoint_id(config):
            stmt = queries.get_by_id(self.dialect)
            params["checkpoint_id"] = checkpoint_id
        else:
            stmt = queries.get_latest(self.dialect)
        rows = yield Stmt(stmt, params, fetch=True, plain=True)
        found = yield from self._op_load(rows)
        return found[0] if found else None

    def _op_load(self, rows: list[Any]) -> Op[list[CheckpointTuple]]:
        """Decode ``queries.checkpoint_rows`` rows; fetch the list items not remembered (only
        when decoding from memory fails, so a warm read is one statement)."""
        loaded = codec.LoadedRows(rows)
        try:
            return loaded.tuples(self.serde, self.lists, {})
        except MissingItems:
            pass
        fetched: dict[bytes, tuple[str, bytes]] = {}
        for (thread_id, ns), digests in loaded.item_digests().items():
            missing = self.lists.missing(digests)
            scope = {"thread_id": thread_id, "checkpoint_ns": ns}
            # A reader that lacks most of them (a cold start) takes the whole thread's items in
            # one statement, so its next reads of the thread need none; else by digest.
            batches = (
                [(queries.select_thread_items(), {})]
                if 2 * len(missing) > len(digests)
                else queries.item_batches(missing)
            )
            for stmt, params in batches:
                got = yield Stmt(stmt, {**scope, **params}, fetch=True, plain=True)
                for r in got:
                    typed = compress.unpack(r["type"], bytes(r["blob"]))
                    fetched[bytes(r["item"])] = typed
                    self.lists.items.put(bytes(r["item"]), typed)
        return loaded.tuples(self.serde, self.lists, fetched)

    def _op_delta_history(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> Op[dict[str, DeltaChannelHistory]]:
        """``get_delta_channel_history`` in one query (:mod:`.delta`); no lifecycle hooks."""
        return (yield from delta.op_delta_history(self, config, channels))

    def _op_list(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> Op[list[CheckpointTuple]]:
        c = checkpoints.c
        where: list[Any] = []
        if config:
            configurable = config["configurable"]
            where.append(c.thread_id == str(configurable["thread_id"]))
            if (ns := configurable.get("checkpoint_ns")) is not None:
                where.append(c.checkpoint_ns == ns)
            if checkpoint_id := get_checkpoint_id(config):
                where.append(c.checkpoint_id == checkpoint_id)
        matcher = filters.MetadataFilter(self.dialect, filter or {})
        if matcher.never:
            return []
        where.extend(matcher.clauses)
        if before is not None and (before_id := get_checkpoint_id(before)):
            where.append(c.checkpoint_id < before_id)
        n = None if limit is None else int(limit)
        stmt = queries.checkpoint_rows(self.dialect, where, None if matcher.python else n)
        rows = yield Stmt(stmt, fetch=True)
        found = yield from self._op_load(rows)
        if matcher.python:
            found = [t for t in found if matcher.matches(t.metadata)][:n]
        return found

    # -- writes ----------------------------------------------------------------------------

    def _put_rows(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> tuple[codec.PutRows, Mode]:
        """The rows of a ``put`` and how to run them: one statement on PostgreSQL unless it
        carries more than ``write_queries.PUT_INLINE_ITEMS`` new list items."""
        md = get_serializable_checkpoint_metadata(config, metadata)
        filters.check_storable(self.dialect, md)
        rows = codec.checkpoint_row(self.serde, config, checkpoint, md, new_versions, self.lists)
        if self.dialect == "postgresql":
            mode: Mode = (
                "single" if len(rows.item_rows) <= write_queries.PUT_INLINE_ITEMS else "write"
            )
        else:
            mode = "write"
        return rows, mode

    def _op_put(self, rows: codec.PutRows) -> Op[RunnableConfig]:
        """Write the rows of :meth:`_put_rows`."""
        row, blob_rows, item_rows = rows.row, rows.blob_rows, rows.item_rows
        if self.dialect == "postgresql":
            # One statement: items and blobs in data-modifying CTEs, then the checkpoint upsert.
            inline = item_rows if len(item_rows) <= write_queries.PUT_INLINE_ITEMS else []
            if item_rows and not inline:
                yield Stmt(write_queries.insert_items(self.dialect), item_rows, plain=True)
            params = {
                **row,
                **(write_queries.row_params(self.dialect, blob_rows) if blob_rows else {}),
                **write_queries.item_params(inline),
            }
            stmt = write_queries.put_checkpoint(self.dialect, len(blob_rows), len(inline))
            yield Stmt(stmt, params, plain=True)
        else:
            if item_rows:
                yield Stmt(write_queries.insert_items(self.dialect), item_rows, plain=True)
            if blob_rows:
                yield Stmt(write_queries.insert_blobs(self.dialect, 1), blob_rows, plain=True)
            yield Stmt(write_queries.put_checkpoint(self.dialect, 0), row, plain=True)
        if rows.lists:
            self.lists.remember(
                row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"], rows.lists
            )
        return {
            "configurable": {
                "thread_id": row["thread_id"],
                "checkpoint_ns": row["checkpoint_ns"],
                "checkpoint_id": row["checkpoint_id"],
            }
        }

    def _write_rows(
        self,
        config: RunnableConfig,
        writes_: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> tuple[codec.WriteRows, Mode]:
        """The rows of a ``put_writes`` and how to run them: one statement on PostgreSQL (up to
        ``write_queries.PUT_INLINE_ITEMS`` items), one per table on SQLite."""
        rows, item_rows = codec.write_rows(
            self.serde, config, writes_, task_id, task_path, self.lists
        )
        upsert = all(channel in WRITES_IDX_MAP for channel, _ in writes_)
        if self.dialect == "postgresql":
            many = len(item_rows) > write_queries.PUT_INLINE_ITEMS
        else:
            many = len(rows) > 1 or bool(item_rows)
        return codec.WriteRows(rows, item_rows, upsert), "write" if many else "single"

    def _after_put_writes(self, rows: codec.WriteRows) -> None:
        """After a ``put_writes`` committed: remember the list items it stored, so the next
        checkpoint's list, which takes them in, does not send them again."""
        if rows.item_rows:
            first = rows.rows[0]
            self.lists.remember_written(
                first["thread_id"],
                first["checkpoint_ns"],
                first["checkpoint_id"],
                [r["item"] for r in rows.item_rows],
            )

    def _op_put_writes(self, rows: codec.WriteRows) -> Op[None]:
        """Write the rows of :meth:`_write_rows`: items first (or, on PostgreSQL, in the same
        statement), so a stored write never names an item that is not stored."""
        if not rows.rows:
            return
        item_rows = rows.item_rows
        inline = item_rows if self.dialect == "postgresql" else []
        if len(inline) > write_queries.PUT_INLINE_ITEMS:
            inline = []
        if item_rows and not inline:
            yield Stmt(write_queries.insert_items(self.dialect), item_rows, plain=True)
        stmt = write_queries.insert_writes(self.dialect, len(rows.rows), rows.upsert, len(inline))
        params = write_queries.row_params(self.dialect, rows.rows)
        if inline:
            params = {**params, **write_queries.item_params(inline)}
        yield Stmt(stmt, params, plain=True)
