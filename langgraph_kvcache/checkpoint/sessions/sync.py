"""Thread sessions: keep a KV-cache server's sessions in step with the checkpointer's threads.

Given ``kv_server=``, :class:`~langgraph_kvcache.checkpoint.SQLAlchemySaver` hands its lifecycle
hooks (:mod:`..hooks`) to :class:`ThreadSessions` (:class:`.aio.AsyncThreadSessions`
for ``AsyncSQLAlchemySaver``; both drive the logic of :mod:`.keeper`). Each (``thread_id``,
checkpoint namespace) maps to the server session :func:`~langgraph_kvcache.sessions.session_id_for`
names (the one ``ChatKVCache`` sends), kept in the ``checkpoint_kv_sessions`` table
(:mod:`.store`):

- ``get_tuple`` of a thread that has a checkpoint (a run starts or resumes), at most once per
  ``prefetch_interval_s`` per session: records the use, registers the session on the server
  with the saver's TTL (first time in this process) and asks the server to prefetch its KV from
  disk to RAM. A read never creates a session: a thread without checkpoints (new, deleted or
  expired) is registered at its first stored checkpoint (``put``). The server calls run in
  the background: the graph never waits for them.
- ``delete_thread``, ``prune(strategy="delete")``, and ``delete_for_runs`` for threads left
  without checkpoints: delete the thread's sessions (root and subgraphs) and their KV.
  ``prune(strategy="keep_latest")`` needs nothing: a session holds only its latest prefix.
  A thread that keeps checkpoints after ``delete_for_runs`` keeps its session, whose blocks
  cover the prefix the thread continues from.
- ``copy_thread``: forks each session of the source into the target's id (blocks are shared).
- ``sweep_expired()``: deletes threads unused for ``ttl_seconds``, checkpoints and sessions.
- ``put`` / ``put_writes`` during a run (``run_pins``, on by default): pin the session while
  the run is in progress, as a lease the server lets lapse by itself (:mod:`.pins`); in
  the background, and a failure is a warning.

Every server call a change owes (a delete, a copy, a registration) is written to the outbox
table in the change's own transaction, and made after the commit by draining the outbox in
order. So a process that dies between the commit and the call loses nothing: the next drain,
by any process on the database, makes it. The server down or slow never fails the saver: a call
that cannot be made (refused connection, timeout, 502/503/504; or 401, a key the server
refuses, logged as an error) stays in the outbox, replayed by later operations (delete, copy
and sweep at once; ``get_tuple`` in the background at most every ``retry_interval_s``).
``setup()`` raises :class:`~langgraph_kvcache.client.AuthenticationError` for a refused key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple

from langgraph_kvcache.checkpoint.sessions.keeper import Runner, SessionKeeper, Steps, drive
from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions, resolve_options
from langgraph_kvcache.client import KVCacheClient

__all__ = ["KVSessionOptions", "ThreadSessions", "resolve_options"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run_logged(fn: Callable[..., Any], *args: Any) -> None:
    """Run a background job; its failure (e.g. the database gone) is logged, not lost."""
    try:
        fn(*args)
    except Exception:
        logger.exception("background KV session job %s failed", getattr(fn, "__name__", fn))


class ThreadSessions(SessionKeeper):
    """Lifecycle hooks of :class:`SQLAlchemySaver` that keep the server's sessions in step.

    Built by the saver when it gets ``kv_server``; reach it as ``saver.kv_sessions``. Server
    work runs one job at a time under a lock: drains, and ``get_tuple``'s background jobs on a
    single worker thread.
    """

    def __init__(self, runner: Runner[Any], options: KVSessionOptions) -> None:
        super().__init__(runner, options)
        self.client = KVCacheClient(
            options.server_url, options.api_key, timeout=options.call_timeout_s
        )
        self._server_lock = threading.Lock()
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lgkv-sessions")
        self._jobs: set[Future[None]] = set()

    def _serially(self, steps: Steps[T]) -> T:
        with self._server_lock:
            return drive(steps, self.client, self.runner)

    def _after_change(self) -> None:
        """After a change committed: let queued background jobs finish (bounded by two call
        timeouts), then make the calls the change owes."""
        if self._jobs:
            wait(list(self._jobs), timeout=2 * self.options.call_timeout_s + 1)
        self.drain()

    # -- hooks -----------------------------------------------------------------------------

    def _submit(self, steps: Steps[None]) -> None:
        future = self._background.submit(run_logged, self._serially, steps)
        self._jobs.add(future)
        future.add_done_callback(self._jobs.discard)

    def _after_get_tuple(self, config: RunnableConfig, found: CheckpointTuple | None) -> None:
        job = drive(self._get_tuple_steps(config, found), self.client, self.runner)
        if job is not None:
            self._submit(self._warm_steps(job))

    def _after_delete_threads(self, thread_ids: Sequence[str]) -> None:
        self._after_change()

    def _after_copy_thread(self, source: str, target: str) -> None:
        self._after_change()

    def _after_delete_for_runs(self, run_ids: Sequence[str], thread_ids: Sequence[str]) -> None:
        self._after_change()

    # -- public ----------------------------------------------------------------------------

    def sweep_expired(self, *, limit: int = 1000) -> list[str]:
        """Delete up to ``limit`` threads unused for ``ttl_seconds`` (their checkpoints, then
        their sessions on the server); returns their ids. Without a TTL: nothing."""
        if self.options.ttl_seconds is None:
            return []
        threads: list[str] = self.runner.run(self._op_sweep(limit), "write")
        self._after_change()
        return threads

    def check_server(self) -> None:
        """``setup()``'s look at the server (see :meth:`SessionKeeper._check_key_steps`)."""
        self._serially(self._check_key_steps())

    def drain(self) -> int:
        """Make the outbox's calls in order until it is empty or the server is unavailable
        (after the server call in flight, if any); returns how many calls were made."""
        return self._serially(self._drain_steps())

    def close(self) -> None:
        """Wait for background calls (bounded by ``call_timeout_s`` each), close the client."""
        self._background.shutdown(wait=True)
        self.client.close()
