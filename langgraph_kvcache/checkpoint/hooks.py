"""The session lifecycle hooks: the extension point for keeping KV-cache sessions in step.

With ``kv_server=`` a saver maps each (``thread_id``, ``checkpoint_ns``) to a session on the
KV-cache server (:mod:`.sessions.sync`). The savers call these hooks around each operation that
reads or changes a thread as a whole; here they do nothing, so a plain saver pays nothing. A
session-aware subclass (:class:`~.sessions.keeper.SessionKeeper`) overrides them.

In-transaction hooks: the saver passes its change (an :data:`~.base.Op`) and runs the operation
the hook returns instead, as one transaction, so what the hook records commits with the change
or not at all. The default returns the change itself.

- ``_tx_delete_threads``: ``delete_thread`` and ``prune(strategy="delete")``.
- ``_tx_copy_thread``: ``copy_thread``.
- ``_tx_delete_for_runs``: ``delete_for_runs`` (the change returns the threads it touched).

After-commit hooks, with what the operation touched (the sync ones for ``SQLAlchemySaver``, the
``_aafter_*`` twins for ``AsyncSQLAlchemySaver``):

- ``_after_get_tuple``: a run is starting or resuming: prefetch the thread's KV from disk.
- ``_after_delete_threads``: ``delete_thread`` / ``prune(strategy="delete")``: drop sessions.
- ``_after_copy_thread``: fork the source thread's sessions into the target thread.
- ``_after_prune``: ``prune`` either strategy (``keep_latest`` keeps the sessions' latest KV).
- ``_after_delete_for_runs``: the threads that lost checkpoints to ``delete_for_runs``.

Store hooks, called by both savers (sync and async alike) after a write committed; they only
decide and queue work, never wait for it, so the graph's hot path pays nothing:

- ``_after_checkpoint``: ``put``/``aput`` stored a checkpoint (run pins, :mod:`.sessions.pins`).
- ``_after_task_writes``: ``put_writes``/``aput_writes`` stored a task's writes.

After-commit hooks must not raise for a missing server session; a failure to reach the server
is logged, and never loses the database change that already committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint, CheckpointTuple

if TYPE_CHECKING:  # .base imports this module
    from langgraph_kvcache.checkpoint.base import Op

T = TypeVar("T")


class LifecycleHooks:
    """No-op lifecycle hooks, called by the savers around each thread-level operation."""

    def _tx_delete_threads(self, change: Op[T], thread_ids: Sequence[str]) -> Op[T]:
        """The transaction of ``delete_thread`` / ``prune(strategy="delete")``: ``change``
        (deletes ``thread_ids``) plus whatever must commit with it."""
        return change

    def _tx_copy_thread(self, change: Op[T], source: str, target: str) -> Op[T]:
        """The transaction of ``copy_thread``: ``change`` plus whatever must commit with it."""
        return change

    def _tx_delete_for_runs(self, change: Op[list[str]], run_ids: Sequence[str]) -> Op[list[str]]:
        """The transaction of ``delete_for_runs``: ``change`` (returns the threads that lost
        checkpoints) plus whatever must commit with it; returns what ``change`` returns."""
        return change

    def _after_checkpoint(self, config: RunnableConfig, checkpoint: Checkpoint) -> None:
        """Called after a checkpoint was stored (``config``: the one ``put`` was given)."""

    def _after_task_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]]) -> None:
        """Called after a task's writes were stored against the checkpoint in ``config``."""

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
