"""The session lifecycle hooks: the extension point for keeping KV-cache sessions in step.

A later saver option (``kv_server=``) maps each (``thread_id``, ``checkpoint_ns``) to a session
on the KV-cache server. The savers call these hooks after the matching operation has committed,
with what it touched; here they do nothing, so a plain saver pays nothing. A session-aware
subclass overrides the sync hooks (used by ``SQLAlchemySaver``) and the async ones (used by
``AsyncSQLAlchemySaver``):

- ``_after_get_tuple``: a run is starting or resuming: prefetch the thread's KV from disk.
- ``_after_delete_threads``: ``delete_thread`` / ``prune(strategy="delete")``: drop sessions.
- ``_after_copy_thread``: fork the source thread's sessions into the target thread.
- ``_after_prune``: ``prune`` either strategy (``keep_latest`` keeps the sessions' latest KV).
- ``_after_delete_for_runs``: the threads that lost checkpoints to ``delete_for_runs``.

Hooks must not raise for a missing server session; a failure to reach the server should be
logged, never lose the database change that already committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple


class LifecycleHooks:
    """No-op lifecycle hooks, called by the savers after each thread-level operation."""

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
