"""Shared logic of the sync and async SQLAlchemy savers.

Each saver operation is written once here as a generator of :class:`Stmt` objects: it yields a
statement, receives the rows it returned, and finally returns its result. The sync saver
(:mod:`.sync`) and the async saver (:mod:`.aio`) only differ in how they run that generator
(``Connection.execute`` or ``await AsyncConnection.execute``) and in which transaction.

Session lifecycle extension point: after each operation that changes or reads a thread as a
whole the savers call a private hook (``_after_get_tuple``, ``_after_delete_threads``,
``_after_copy_thread``, ``_after_prune``, ``_after_delete_for_runs`` and their ``_a`` async
twins). They are no-ops here; a subclass that keeps a KV-cache server's sessions in step with the
threads overrides them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
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
    tuple_,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from langgraph_kvcache.checkpoint import codec
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS, statements_for
from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, migrations_table, writes
from langgraph_kvcache.errors import CheckpointerSetupError, ThreadNotEmptyError

T = TypeVar("T")

PRUNE_STRATEGIES = ("keep_latest", "delete")
"""Strategies ``prune`` accepts."""

SETUP_LOCK_KEY = 0x6C676B76
"""PostgreSQL advisory lock key that serialises concurrent ``setup()`` calls."""

_CHUNK = 500
"""Most keys per ``IN`` list, well under SQLite's bound-parameter limit."""


@dataclass(frozen=True)
class Stmt:
    """One statement an operation wants run, with its parameters."""

    statement: Executable
    params: list[dict[str, Any]] | dict[str, Any] | None = None
    """A dict, or a list of dicts for an executemany."""
    fetch: bool = False
    """Whether the operation wants the result rows (as mappings) back."""


Op = Generator[Stmt, list[Any], T]
"""A saver operation: yields statements, is sent their rows, returns its result."""


def _chunks(items: Sequence[Any], size: int = _CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class BaseSQLAlchemySaver(BaseCheckpointSaver[str]):
    """Operations shared by :class:`SQLAlchemySaver` and :class:`AsyncSQLAlchemySaver`.

    Subclasses set ``dialect`` (``"sqlite"`` or ``"postgresql"``) and run the operations.
    """

    dialect: str

    def get_next_version(self, current: str | None, channel: None = None) -> str:
        """Next channel version: ``"<32-digit counter>.<random>"``, like the PostgreSQL saver."""
        return codec.next_version(current)

    # -- dialect helpers -------------------------------------------------------------------

    def _insert(self, table: Any) -> Any:
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        return dialect.insert(table)

    def _metadata_matches(self, filter: dict[str, Any]) -> list[Any]:
        col = checkpoints.c.metadata
        if self.dialect == "postgresql":
            return [type_coerce(col, postgresql.JSONB).contains(filter)]
        clauses = []
        for key, value in filter.items():
            path = '$."' + key.replace('"', '""') + '"'
            extracted = func.json_extract(col, path)
            if value is None:
                clauses.append(func.json_type(col, path) == "null")
            elif isinstance(value, bool):
                clauses.append(func.json_type(col, path) == ("true" if value else "false"))
            elif isinstance(value, (dict, list)):
                clauses.append(extracted == func.json(json.dumps(value)))
            else:
                clauses.append(extracted == value)
        return clauses

    def _has_metadata_key(self, key: str) -> Any:
        col = checkpoints.c.metadata
        if self.dialect == "postgresql":
            return type_coerce(col, postgresql.JSONB).has_key(key)
        return func.json_type(col, "$." + key).is_not(None)

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

    _COLUMNS = (
        checkpoints.c.thread_id,
        checkpoints.c.checkpoint_ns,
        checkpoints.c.checkpoint_id,
        checkpoints.c.parent_checkpoint_id,
        checkpoints.c.type,
        checkpoints.c.checkpoint,
        checkpoints.c.metadata,
    )

    def _op_get_tuple(self, config: RunnableConfig) -> Op[CheckpointTuple | None]:
        configurable = config["configurable"]
        c = checkpoints.c
        query = select(*self._COLUMNS).where(
            c.thread_id == str(configurable["thread_id"]),
            c.checkpoint_ns == configurable.get("checkpoint_ns", ""),
        )
        if checkpoint_id := get_checkpoint_id(config):
            query = query.where(c.checkpoint_id == checkpoint_id)
        else:
            query = query.order_by(c.checkpoint_id.desc()).limit(1)
        rows = yield Stmt(query, fetch=True)
        if not rows:
            return None
        tuples = yield from self._op_load(rows)
        return tuples[0]

    def _op_list(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> Op[list[CheckpointTuple]]:
        c = checkpoints.c
        query = select(*self._COLUMNS)
        if config:
            configurable = config["configurable"]
            query = query.where(c.thread_id == str(configurable["thread_id"]))
            if (ns := configurable.get("checkpoint_ns")) is not None:
                query = query.where(c.checkpoint_ns == ns)
            if checkpoint_id := get_checkpoint_id(config):
                query = query.where(c.checkpoint_id == checkpoint_id)
        if filter:
            query = query.where(*self._metadata_matches(filter))
        if before is not None and (before_id := get_checkpoint_id(before)):
            query = query.where(c.checkpoint_id < before_id)
        query = query.order_by(c.checkpoint_id.desc())
        if limit is not None:
            query = query.limit(int(limit))
        rows = yield Stmt(query, fetch=True)
        if not rows:
            return []
        return (yield from self._op_load(rows))

    def _op_load(self, rows: list[Any]) -> Op[list[CheckpointTuple]]:
        """Fetch the blobs and pending writes of checkpoint rows and build their tuples."""
        bodies = [codec.load_body(self.serde, r["type"], r["checkpoint"]) for r in rows]
        by_group: dict[tuple[str, str], tuple[set[tuple[str, str]], list[str]]] = defaultdict(
            lambda: (set(), [])
        )
        for row, body in zip(rows, bodies, strict=True):
            keys, ids = by_group[(row["thread_id"], row["checkpoint_ns"])]
            ids.append(row["checkpoint_id"])
            keys.update((k[2], k[3]) for k in codec.blob_keys(*k_of(row), body))
        found: dict[codec.BlobKey, tuple[str, bytes | None]] = {}
        pending: dict[codec.WriteKey, list[Any]] = defaultdict(list)
        b, w = blobs.c, writes.c
        for (thread_id, ns), (keys, ids) in by_group.items():
            for chunk in _chunks(sorted(keys)):
                got = yield Stmt(
                    select(b.channel, b.version, b.type, b.blob).where(
                        b.thread_id == thread_id,
                        b.checkpoint_ns == ns,
                        tuple_(b.channel, b.version).in_(chunk),
                    ),
                    fetch=True,
                )
                for r in got:
                    found[(thread_id, ns, r["channel"], r["version"])] = (r["type"], r["blob"])
            for chunk in _chunks(ids):
                got = yield Stmt(
                    select(
                        w.checkpoint_id, w.task_id, w.task_path, w.idx, w.channel, w.type, w.blob
                    )
                    .where(w.thread_id == thread_id, w.checkpoint_ns == ns)
                    .where(
                        w.checkpoint_id.in_(chunk)
                        if len(chunk) > 1
                        else w.checkpoint_id == chunk[0]
                    ),
                    fetch=True,
                )
                for r in got:
                    pending[(thread_id, ns, r["checkpoint_id"])].append(r)
        return [
            codec.make_tuple(self.serde, row, body, found, pending.get(k_of(row, True), []))
            for row, body in zip(rows, bodies, strict=True)
        ]

    # -- writes ----------------------------------------------------------------------------

    def _op_put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> Op[RunnableConfig]:
        md = get_serializable_checkpoint_metadata(config, metadata)
        row, blob_rows = codec.checkpoint_row(self.serde, config, checkpoint, md, new_versions)
        if blob_rows:
            yield Stmt(self._insert(blobs).on_conflict_do_nothing(), blob_rows)
        stmt = self._insert(checkpoints)
        stmt = stmt.on_conflict_do_update(
            index_elements=["thread_id", "checkpoint_ns", "checkpoint_id"],
            set_={
                "checkpoint": stmt.excluded.checkpoint,
                "type": stmt.excluded.type,
                "metadata": stmt.excluded.metadata,
                "run_id": stmt.excluded.run_id,
            },
        )
        yield Stmt(stmt, row)
        return {
            "configurable": {
                "thread_id": row["thread_id"],
                "checkpoint_ns": row["checkpoint_ns"],
                "checkpoint_id": checkpoint["id"],
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
        stmt = self._insert(writes)
        if all(channel in WRITES_IDX_MAP for channel, _ in writes_):
            stmt = stmt.on_conflict_do_update(
                index_elements=["thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"],
                set_={
                    "channel": stmt.excluded.channel,
                    "type": stmt.excluded.type,
                    "blob": stmt.excluded.blob,
                },
            )
        else:
            stmt = stmt.on_conflict_do_nothing()
        yield Stmt(stmt, rows)

    def _op_delete_threads(self, thread_ids: Sequence[str]) -> Op[None]:
        for table in (checkpoints, blobs, writes):
            for chunk in _chunks(list(thread_ids)):
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
        for table in (checkpoints, blobs, writes):
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
        delta = yield Stmt(
            select(c.thread_id)
            .where(
                c.thread_id.in_(thread_ids), self._has_metadata_key("counters_since_delta_snapshot")
            )
            .distinct(),
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
        for chunk in _chunks([str(r) for r in run_ids]):
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
        """Delete checkpoints of one namespace with their writes, then blobs nothing uses."""
        if not ids:
            return
        c, w, b = checkpoints.c, writes.c, blobs.c
        for chunk in _chunks(ids):
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
        kept = yield Stmt(
            select(c.type, c.checkpoint).where(c.thread_id == thread_id, c.checkpoint_ns == ns),
            fetch=True,
        )
        used = {
            key[2:]
            for r in kept
            for key in codec.blob_keys(
                thread_id, ns, codec.load_body(self.serde, r["type"], r["checkpoint"])
            )
        }
        stored = yield Stmt(
            select(b.channel, b.version).where(b.thread_id == thread_id, b.checkpoint_ns == ns),
            fetch=True,
        )
        garbage = sorted({(r["channel"], r["version"]) for r in stored} - used)
        for chunk in _chunks(garbage):
            yield Stmt(
                delete(blobs).where(
                    b.thread_id == thread_id,
                    b.checkpoint_ns == ns,
                    tuple_(b.channel, b.version).in_(chunk),
                )
            )

    # -- lifecycle hooks (extension point; no-ops here) ------------------------------------

    def _after_get_tuple(self, config: RunnableConfig, found: CheckpointTuple | None) -> None:
        """Called after ``get_tuple``; a session-aware saver may prefetch the thread's KV."""

    def _after_delete_threads(self, thread_ids: Sequence[str]) -> None:
        """Called after ``delete_thread`` and ``prune(strategy="delete")``."""

    def _after_copy_thread(self, source: str, target: str) -> None:
        """Called after ``copy_thread``; a session-aware saver may fork the session."""

    def _after_prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        """Called after ``prune`` (either strategy)."""

    def _after_delete_for_runs(self, run_ids: Sequence[str], thread_ids: Sequence[str]) -> None:
        """Called after ``delete_for_runs`` with the threads that lost checkpoints."""

    async def _aafter_get_tuple(
        self, config: RunnableConfig, found: CheckpointTuple | None
    ) -> None:
        """Async twin of :meth:`_after_get_tuple`."""

    async def _aafter_delete_threads(self, thread_ids: Sequence[str]) -> None:
        """Async twin of :meth:`_after_delete_threads`."""

    async def _aafter_copy_thread(self, source: str, target: str) -> None:
        """Async twin of :meth:`_after_copy_thread`."""

    async def _aafter_prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        """Async twin of :meth:`_after_prune`."""

    async def _aafter_delete_for_runs(
        self, run_ids: Sequence[str], thread_ids: Sequence[str]
    ) -> None:
        """Async twin of :meth:`_after_delete_for_runs`."""


def k_of(row: Any, with_id: bool = False) -> Any:
    """(thread_id, checkpoint_ns[, checkpoint_id]) of a checkpoint row."""
    if with_id:
        return (row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"])
    return (row["thread_id"], row["checkpoint_ns"])


def check_prune_args(thread_ids: Sequence[str], strategy: str) -> list[str]:
    """Validate ``prune``'s arguments like the PostgreSQL saver; returns the ids as strings."""
    if isinstance(thread_ids, str):
        raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
    if strategy not in PRUNE_STRATEGIES:
        raise ValueError(f"Unknown prune strategy: {strategy!r}; use one of {PRUNE_STRATEGIES}")
    return [str(t) for t in thread_ids]
