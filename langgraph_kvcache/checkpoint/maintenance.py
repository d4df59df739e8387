"""Whole-thread and checkpoint deletion, copying and pruning, shared by the sync and async
savers (a mixin of :class:`~.base.BaseSQLAlchemySaver`). Operations are generators of
:class:`~.ops.Stmt` like the others; deleting checkpoints frees the blobs and items nothing left
reads (:mod:`.gc`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import delete, func, insert, literal, select, update

from langgraph_kvcache.checkpoint import filters, gc
from langgraph_kvcache.checkpoint.lists import ListState
from langgraph_kvcache.checkpoint.ops import Op, Stmt
from langgraph_kvcache.checkpoint.schema import blobs, checkpoints, items, writes
from langgraph_kvcache.errors import ThreadNotEmptyError

PRUNE_STRATEGIES = ("keep_latest", "delete")
"""Strategies ``prune`` accepts."""


class ThreadMaintenance:
    """``delete_thread``, ``copy_thread``, ``prune`` and ``delete_for_runs`` as operations.

    The saver sets ``dialect`` and ``lists``."""

    dialect: str
    lists: ListState

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
