"""Shared logic of the sync and async SQLAlchemy savers.

Each saver operation is written once here as a generator of :class:`Stmt` objects: it yields a
statement, receives the rows it returned, and finally returns its result. The sync saver
(:mod:`.sync`) and the async saver (:mod:`.aio`) only differ in how they run that generator
(``Connection.execute`` or ``await AsyncConnection.execute``) and in which transaction.

Session lifecycle extension point: after each operation that changes or reads a thread as a
whole the savers call a hook of :class:`~langgraph_kvcache.checkpoint.hooks.LifecycleHooks`
(no-ops there); a subclass that keeps a KV-cache server's sessions in step overrides them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

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
from sqlalchemy import (
    Executable,
    delete,
    func,
    insert,
    literal,
    select,
    text,
    update,
)

from langgraph_kvcache.checkpoint import codec, delta, filters, gc, queries
from langgraph_kvcache.checkpoint.engine import BEGIN_OPTION
from langgraph_kvcache.checkpoint.hooks import LifecycleHooks
from langgraph_kvcache.checkpoint.lists import DEFAULT_SNAPSHOT_EVERY, ListState, MissingItems
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS, statements_for
from langgraph_kvcache.checkpoint.schema import (
    blobs,
    checkpoints,
    items,
    migrations_table,
    writes,
)
from langgraph_kvcache.errors import CheckpointerSetupError, ThreadNotEmptyError

T = TypeVar("T")

PRUNE_STRATEGIES = ("keep_latest", "delete")
"""Strategies ``prune`` accepts."""

SETUP_LOCK_KEY = 0x6C676B76
"""PostgreSQL advisory lock key that serialises concurrent ``setup()`` calls."""


@dataclass(frozen=True)
class Stmt:
    """One statement an operation wants run, with its parameters."""

    statement: Executable
    params: list[dict[str, Any]] | dict[str, Any] | None = None
    """A dict, or a list of dicts for an executemany."""
    fetch: bool = False
    """Whether the operation wants the result rows (as mappings) back."""
    plain: bool = False
    """A prebuilt statement whose parameters are str, int, bytes or JSON-typed and whose results
    are str, int or bytes: a driver may run its compiled SQL on the DBAPI connection directly
    (see :func:`langgraph_kvcache.checkpoint.plain.run_plain`)."""


Op = Generator[Stmt, list[Any], T]
"""A saver operation: yields statements, is sent their rows, returns its result."""

Mode = Literal["read", "single", "write"]
"""How a driver runs an operation: ``read`` (reads only), ``single`` (one write statement, atomic
by itself) or ``write`` (several statements in one write transaction)."""


def execution_options(dialect: str, mode: Mode) -> dict[str, Any]:
    """Connection options for ``mode``: no transaction (and so no BEGIN/COMMIT round trips)
    unless the operation runs several write statements; on SQLite a write transaction takes the
    write lock at once (``BEGIN IMMEDIATE``) so concurrent writers queue on ``busy_timeout``."""
    if dialect == "postgresql":
        return {} if mode == "write" else {"isolation_level": "AUTOCOMMIT"}
    return {BEGIN_OPTION: "immediate" if mode == "write" else "none"}


class BaseSQLAlchemySaver(LifecycleHooks, BaseCheckpointSaver[str]):
    """Operations shared by :class:`SQLAlchemySaver` and :class:`AsyncSQLAlchemySaver`.

    Subclasses set ``dialect`` (``"sqlite"`` or ``"postgresql"``), call :meth:`_init_lists`
    and run the operations.
    """

    dialect: str
    lists: ListState
    """Append-aware list storage state (:mod:`.lists`)."""

    def _init_lists(self, snapshot_every: int | None) -> None:
        """Set up :attr:`lists`; ``snapshot_every`` as documented on the savers."""
        every = DEFAULT_SNAPSHOT_EVERY if snapshot_every is None else snapshot_every
        self.lists = ListState(self.serde, every)

    def _writes_mode(self, n_writes: int) -> Mode:
        """``put_writes`` is one statement on PostgreSQL, one per row on SQLite."""
        return "single" if self.dialect == "postgresql" or n_writes <= 1 else "write"

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
                    typed = (r["type"], bytes(r["blob"]))
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
        carries more than ``queries.PUT_INLINE_ITEMS`` new list items."""
        md = get_serializable_checkpoint_metadata(config, metadata)
        filters.check_storable(self.dialect, md)
        rows = codec.checkpoint_row(self.serde, config, checkpoint, md, new_versions, self.lists)
        if self.dialect == "postgresql":
            mode: Mode = "single" if len(rows.item_rows) <= queries.PUT_INLINE_ITEMS else "write"
        else:
            mode = "write"
        return rows, mode

    def _op_put(self, rows: codec.PutRows) -> Op[RunnableConfig]:
        """Write the rows of :meth:`_put_rows`."""
        row, blob_rows, item_rows = rows.row, rows.blob_rows, rows.item_rows
        if self.dialect == "postgresql":
            # One statement: items and blobs in data-modifying CTEs, then the checkpoint upsert.
            inline = item_rows if len(item_rows) <= queries.PUT_INLINE_ITEMS else []
            if item_rows and not inline:
                yield Stmt(queries.insert_items(self.dialect), item_rows, plain=True)
            params = {
                **row,
                **(queries.row_params(self.dialect, blob_rows) if blob_rows else {}),
                **queries.item_params(inline),
            }
            stmt = queries.put_checkpoint(self.dialect, len(blob_rows), len(inline))
            yield Stmt(stmt, params, plain=True)
        else:
            if item_rows:
                yield Stmt(queries.insert_items(self.dialect), item_rows, plain=True)
            if blob_rows:
                yield Stmt(queries.insert_blobs(self.dialect, 1), blob_rows, plain=True)
            yield Stmt(queries.put_checkpoint(self.dialect, 0), row, plain=True)
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

    def _op_put_writes(
        self,
        config: RunnableConfig,
        writes_: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> Op[None]:
        rows = codec.write_rows(self.serde, config, writes_, task_id, task_path)
        if not rows:
            return
        upsert = all(channel in WRITES_IDX_MAP for channel, _ in writes_)
        stmt = queries.insert_writes(self.dialect, len(rows), upsert)
        yield Stmt(stmt, queries.row_params(self.dialect, rows), plain=True)

    def _op_delete_threads(self, thread_ids: Sequence[str]) -> Op[None]:
        self.lists.forget_threads(thread_ids)
        for table in (checkpoints, blobs, items, writes):
            for chunk in gc.chunks(list(thread_ids)):
                yield Stmt(delete(table).where(table.c.thread_id.in_(chunk)))

    def _op_copy_thread(self, source: str, target: str) -> Op[None]:
        exists = yield Stmt(
            select(checkpoints.c.checkpoint_id).where(checkpoints.c.thread_id == target).limit(1),
            fetch=True,
        )
        if exists:
            raise ThreadNotEmptyError(
                f"copy_thread: target thread {target!r} already has checkpoints; delete it first "
                "or copy to a new thread id."
            )
        self.lists.forget_threads([target])
        for table in (checkpoints, blobs, items, writes):
            names = [col.name for col in table.c if col.name != "thread_id"]
            source_rows = select(
                literal(target).label("thread_id"), *[table.c[n] for n in names]
            ).where(table.c.thread_id == source)
            yield Stmt(insert(table).from_select(["thread_id", *names], source_rows))

    def _op_prune(self, thread_ids: Sequence[str], strategy: str) -> Op[None]:
        if strategy == "delete":
            yield from self._op_delete_threads(thread_ids)
            return
        c = checkpoints.c
        uses_delta = filters.has_metadata_key(self.dialect, "counters_since_delta_snapshot")
        delta = yield Stmt(
            select(c.thread_id).where(c.thread_id.in_(thread_ids), uses_delta).distinct(),
            fetch=True,
        )
        if delta:
            names = ", ".join(sorted(r["thread_id"] for r in delta))
            raise NotImplementedError(
                f"keep_latest can't prune threads that use a DeltaChannel: {names}"
            )
        for thread_id in thread_ids:
            heads = yield Stmt(
                select(c.checkpoint_ns, func.max(c.checkpoint_id).label("head"))
                .where(c.thread_id == thread_id)
                .group_by(c.checkpoint_ns),
                fetch=True,
            )
            for head in heads:
                ns = head["checkpoint_ns"]
                rows = yield Stmt(
                    select(c.checkpoint_id).where(
                        c.thread_id == thread_id,
                        c.checkpoint_ns == ns,
                        c.checkpoint_id != head["head"],
                    ),
                    fetch=True,
                )
                yield from self._op_delete_checkpoints(
                    thread_id, ns, [r["checkpoint_id"] for r in rows]
                )

    def _op_delete_for_runs(self, run_ids: Sequence[str]) -> Op[list[str]]:
        """Delete the checkpoints (and their writes) made by ``run_ids``; returns their threads."""
        c = checkpoints.c
        found: dict[tuple[str, str], list[str]] = defaultdict(list)
        for chunk in gc.chunks([str(r) for r in run_ids]):
            rows = yield Stmt(
                select(c.thread_id, c.checkpoint_ns, c.checkpoint_id).where(c.run_id.in_(chunk)),
                fetch=True,
            )
            for r in rows:
                found[(r["thread_id"], r["checkpoint_ns"])].append(r["checkpoint_id"])
        for (thread_id, ns), ids in found.items():
            yield from self._op_delete_checkpoints(thread_id, ns, ids)
        return sorted({thread_id for thread_id, _ in found})

    def _op_delete_checkpoints(self, thread_id: str, ns: str, ids: list[str]) -> Op[None]:
        """Delete checkpoints of one namespace with their writes, then the blobs and list items
        nothing left reads (a kept checkpoint keeps the versions its lists extend)."""
        if not ids:
            return
        self.lists.forget_threads([thread_id])
        c, w = checkpoints.c, writes.c
        for chunk in gc.chunks(ids):
            yield Stmt(
                delete(checkpoints).where(
                    c.thread_id == thread_id, c.checkpoint_ns == ns, c.checkpoint_id.in_(chunk)
                )
            )
            yield Stmt(
                delete(writes).where(
                    w.thread_id == thread_id, w.checkpoint_ns == ns, w.checkpoint_id.in_(chunk)
                )
            )
            yield Stmt(
                update(checkpoints)
                .where(c.thread_id == thread_id, c.checkpoint_ns == ns)
                .where(c.parent_checkpoint_id.in_(chunk))
                .values(parent_checkpoint_id=None)
            )
        yield from gc.op_collect(thread_id, ns)


def check_prune_args(thread_ids: Sequence[str], strategy: str) -> list[str]:
    """Validate ``prune``'s arguments like the PostgreSQL saver; returns the ids as strings."""
    if isinstance(thread_ids, str):
        raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
    if strategy not in PRUNE_STRATEGIES:
        raise ValueError(f"Unknown prune strategy: {strategy!r}; use one of {PRUNE_STRATEGIES}")
    return [str(t) for t in thread_ids]
