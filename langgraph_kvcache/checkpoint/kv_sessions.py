"""Thread sessions: keep a KV-cache server's sessions in step with the checkpointer's threads.

Given ``kv_server=``, :class:`~langgraph_kvcache.checkpoint.SQLAlchemySaver` hands its lifecycle
hooks (:mod:`.hooks`) to :class:`ThreadSessions` (:class:`.kv_sessions_aio.AsyncThreadSessions`
for ``AsyncSQLAlchemySaver``). Each (``thread_id``, checkpoint namespace) maps to the server session
:func:`~langgraph_kvcache.sessions.session_id_for` names (the one ``ChatKVCache`` sends), kept
in the ``checkpoint_kv_sessions`` table (:mod:`.kv_store`):

- ``get_tuple`` (a run starts or resumes), at most once per ``prefetch_interval_s`` per session:
  records the use, registers the session on the server with the saver's TTL (first time in
  this process) and asks the server to prefetch its KV from disk to RAM. The server calls run in
  the background: the graph never waits for them.
- ``delete_thread``, ``prune(strategy="delete")``, and ``delete_for_runs`` for threads left
  without checkpoints: delete the thread's sessions (root and subgraphs) and their KV.
  ``prune(strategy="keep_latest")`` needs nothing: a session holds only its latest prefix.
  A thread that keeps checkpoints after ``delete_for_runs`` keeps its session, whose blocks
  cover the prefix the thread continues from.
- ``copy_thread``: forks each session of the source into the target's id (blocks are shared).
- ``sweep_expired()``: deletes threads unused for ``ttl_seconds``, checkpoints and sessions.

The server down or slow never fails the saver: a hook runs after its database change
committed; a call that cannot be made (refused, timed out, 502/503/504) is logged as a warning
and stored in the outbox table, replayed in order by later operations (delete, copy and sweep
at once; ``get_tuple`` in the background at most every ``retry_interval_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple

from langgraph_kvcache.checkpoint import kv_store
from langgraph_kvcache.checkpoint.hooks import LifecycleHooks
from langgraph_kvcache.checkpoint.kv_store import SessionCall
from langgraph_kvcache.client import (
    KVCacheClient,
    KVCacheClientError,
    ServerUnavailableError,
    SessionExistsError,
    SessionNotFoundError,
)
from langgraph_kvcache.sessions import session_id_for, strip_task_ids, thread_session_prefix

if TYPE_CHECKING:
    from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

__all__ = ["KVSessionOptions", "ThreadSessions", "resolve_options"]

logger = logging.getLogger(__name__)

_DRAIN_BATCH = 100
_MAX_TRACKED = 10_000
IDLE_OUTBOX_CHECK_S = 60.0
"""How often ``get_tuple`` looks at an outbox this process left empty."""


@dataclass(frozen=True)
class KVSessionOptions:
    """How a saver keeps the KV-cache server's sessions in step with its threads."""

    server_url: str
    """Server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted)."""
    api_key: str | None = None
    """Bearer key of a server run with ``--api-key`` (selects the tenant); default
    ``$LGKV_API_KEY``."""
    ttl_seconds: float | None = None
    """Idle time after which a thread expires: its server sessions are registered with this
    TTL and ``sweep_expired()`` deletes threads unused for longer. ``None``: never."""
    prefetch_interval_s: float = 30.0
    """A session is prefetched (and its use recorded) at most this often: the first
    ``get_tuple`` of a run does it, the run's later ones cost nothing."""
    call_timeout_s: float = 5.0
    """Timeout of each session API call; a slower server counts as unavailable."""
    retry_interval_s: float = 10.0
    """``get_tuple`` retries pending outbox calls at most this often."""

    def __post_init__(self) -> None:
        if not self.server_url:
            raise ValueError("kv_server must be the server's URL, e.g. http://127.0.0.1:8000")
        if self.ttl_seconds is not None and not self.ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0 or None, got {self.ttl_seconds!r}")
        for name in ("prefetch_interval_s", "call_timeout_s", "retry_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


def resolve_options(
    kv_server: str | KVSessionOptions | None,
    kv_api_key: str | None,
    ttl_seconds: float | None,
) -> KVSessionOptions | None:
    """The saver's ``kv_server``/``kv_api_key``/``ttl_seconds`` arguments as options (None:
    a plain SQL checkpointer). ``kv_server`` may be a URL or a full :class:`KVSessionOptions`."""
    if kv_server is None:
        if kv_api_key is not None or ttl_seconds is not None:
            raise ValueError(
                "kv_api_key and ttl_seconds need kv_server (the KV-cache server's URL): the TTL "
                "expires threads together with their server sessions"
            )
        return None
    if isinstance(kv_server, KVSessionOptions):
        if kv_api_key is not None or ttl_seconds is not None:
            raise ValueError("pass api_key and ttl_seconds inside KVSessionOptions, not beside it")
        return kv_server
    return KVSessionOptions(str(kv_server), api_key=kv_api_key, ttl_seconds=ttl_seconds)


class Tracker:
    """Per-process memory: when each (thread, namespace) was last recorded and prefetched, and
    whether the outbox may hold calls. Thread-safe."""

    def __init__(self, options: KVSessionOptions) -> None:
        self.options = options
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self.outbox_pending: bool | None = None  # None: not checked yet in this process
        self.last_retry = 0.0

    def due(self, key: tuple[str, str]) -> tuple[bool, bool]:
        """(whether ``key`` is due for a record/prefetch now, whether it is new here)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.options.prefetch_interval_s:
                return False, False
            if len(self._last) >= _MAX_TRACKED:
                horizon = now - self.options.prefetch_interval_s
                self._last = {k: t for k, t in self._last.items() if t >= horizon}
            self._last[key] = now
            return True, last is None

    def forget(self, thread_ids: Sequence[str]) -> None:
        """Drop deleted threads (a reused id starts afresh: registered again)."""
        gone = set(thread_ids)
        with self._lock:
            self._last = {k: t for k, t in self._last.items() if k[0] not in gone}

    def retry_due(self) -> bool:
        """Whether ``get_tuple`` should drain the outbox now (and note that it does): every
        ``retry_interval_s`` while calls are pending, every :data:`IDLE_OUTBOX_CHECK_S` when
        this process left it empty (another process sharing the database may have queued)."""
        now = time.monotonic()
        interval = self.options.retry_interval_s
        if self.outbox_pending is False:
            interval = max(interval, IDLE_OUTBOX_CHECK_S)
        if now - self.last_retry < interval:
            return False
        self.last_retry = now
        return True


def warm_plan(
    options: KVSessionOptions, found: CheckpointTuple | None, new: bool
) -> tuple[bool, bool]:
    """(register the session, prefetch its KV) after a ``get_tuple``. A thread with no
    checkpoint has no KV to prefetch; its session is registered only when it will carry the
    saver's TTL (a ``get_state`` of an unknown thread must not leave an immortal session)."""
    register = new and (found is not None or options.ttl_seconds is not None)
    return register, found is not None


def thread_key(config: RunnableConfig) -> tuple[str, str]:
    """(thread id, namespace without task ids) of a ``get_tuple`` config."""
    configurable = config["configurable"]
    return str(configurable["thread_id"]), strip_task_ids(configurable.get("checkpoint_ns", ""))


def delete_calls(thread_ids: Sequence[str], sessions: Sequence[str]) -> list[SessionCall]:
    """Drop every recorded session of the threads, and their root session in any case."""
    ids = dict.fromkeys([*sessions, *(thread_session_prefix(t) for t in thread_ids)])
    return [SessionCall("delete", sid) for sid in ids]


def copy_calls(
    source: str, target: str, pairs: Sequence[tuple[str, str]]
) -> tuple[list[SessionCall], list[tuple[str, str]]]:
    """Fork each of the source's sessions (root included) to the target's; target rows."""
    namespaces = dict.fromkeys(["", *(ns for _, ns in pairs)])
    calls = [
        SessionCall("copy", session_id_for(source, ns), session_id_for(target, ns))
        for ns in namespaces
    ]
    return calls, [(target, ns) for ns in namespaces]


def run_logged(fn: Callable[..., Any], *args: Any) -> None:
    """Run a background job; its failure (e.g. the database gone) is logged, not lost."""
    try:
        fn(*args)
    except Exception:
        logger.exception("background KV session job %s failed", getattr(fn, "__name__", fn))


def log_unavailable(what: str, exc: Exception) -> None:
    """The one warning a failed server call leaves (the call itself waits in the outbox)."""
    logger.warning("KV-cache server unavailable, %s later: %s", what, exc)


class ThreadSessions(LifecycleHooks):
    """Lifecycle hooks of :class:`SQLAlchemySaver` that keep the server's sessions in step.

    Built by the saver when it gets ``kv_server``; reach it as ``saver.kv_sessions``.
    """

    def __init__(self, saver: SQLAlchemySaver, options: KVSessionOptions) -> None:
        self.saver = saver
        self.options = options
        self.client = KVCacheClient(
            options.server_url, options.api_key, timeout=options.call_timeout_s
        )
        self._tracker = Tracker(options)
        self._drain_lock = threading.Lock()
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lgkv-sessions")
        self._jobs: set[Future[None]] = set()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        job = self._background.submit(run_logged, fn, *args)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    def _settle(self) -> None:
        """Let background calls finish first (bounded), so a register queued by ``get_tuple``
        never lands after the delete or copy that follows it."""
        if self._jobs:
            wait(list(self._jobs), timeout=2 * self.options.call_timeout_s + 1)

    # -- hooks -----------------------------------------------------------------------------

    def _after_get_tuple(self, config: RunnableConfig, found: CheckpointTuple | None) -> None:
        key = thread_key(config)
        due, new = self._tracker.due(key)
        if due:
            self.saver._run(kv_store.op_touch(self.saver.dialect, [key], time.time()), "single")
            register, prefetch = warm_plan(self.options, found, new)
            if register or prefetch:
                self._submit(self._warm, session_id_for(*key), register, prefetch)
        if self._tracker.retry_due():
            self._submit(self.drain)

    def _after_delete_threads(self, thread_ids: Sequence[str]) -> None:
        self._settle()
        sessions = self.saver._run(kv_store.op_forget(thread_ids), "write")
        self._tracker.forget(thread_ids)
        self.send(delete_calls(thread_ids, sessions))

    def _after_copy_thread(self, source: str, target: str) -> None:
        self._settle()
        pairs = self.saver._run(kv_store.op_namespaces([source]))
        calls, rows = copy_calls(source, target, pairs)
        self.saver._run(kv_store.op_touch(self.saver.dialect, rows, time.time()), "write")
        self.send(calls)

    def _after_delete_for_runs(self, run_ids: Sequence[str], thread_ids: Sequence[str]) -> None:
        emptied = self.saver._run(kv_store.op_threads_without_checkpoints(thread_ids))
        if emptied:
            self._after_delete_threads(emptied)

    # -- public ----------------------------------------------------------------------------

    def sweep_expired(self, *, limit: int = 1000) -> list[str]:
        """Delete up to ``limit`` threads unused for ``ttl_seconds`` (their checkpoints, then
        their sessions on the server); returns their ids. Without a TTL: nothing."""
        if self.options.ttl_seconds is None:
            return []
        self._settle()
        cutoff = time.time() - self.options.ttl_seconds
        op = kv_store.op_sweep(self.saver._op_delete_threads, cutoff, limit)
        threads, sessions = self.saver._run(op, "write")
        self._tracker.forget(threads)
        self.send(delete_calls(threads, sessions))
        return threads

    def send(self, calls: Sequence[SessionCall]) -> None:
        """Make ``calls`` on the server now, in order, behind any pending ones; whatever cannot
        be made now goes to the outbox (with a warning)."""
        if not calls:
            return
        if self._tracker.outbox_pending is not False:
            self.saver._run(kv_store.op_enqueue(calls, "queued behind pending calls"), "write")
            self._tracker.outbox_pending = True
            self.drain()
            return
        for i, call in enumerate(calls):
            try:
                self._apply(call)
            except ServerUnavailableError as exc:
                log_unavailable(f"{call.op} of {call.session_id!r} queued for", exc)
                self.saver._run(kv_store.op_enqueue(calls[i:], str(exc)), "write")
                self._tracker.outbox_pending = True
                return
            except KVCacheClientError as exc:
                logger.warning("session call %s refused: %s", call, exc)

    def drain(self) -> int:
        """Replay the outbox in order until it is empty or the server is unavailable; returns
        how many calls were made."""
        sent = 0
        with self._drain_lock:
            while True:
                rows = self.saver._run(kv_store.op_pending(_DRAIN_BATCH))
                if not rows:
                    self._tracker.outbox_pending = False
                    return sent
                for row in rows:
                    try:
                        self._apply(row.call)
                    except ServerUnavailableError as exc:
                        log_unavailable(f"{len(rows)}+ pending session calls retried", exc)
                        self.saver._run(kv_store.op_failed(row.id, str(exc)), "single")
                        self._tracker.outbox_pending = True
                        return sent
                    except KVCacheClientError as exc:
                        logger.warning("dropping session call %s: %s", row.call, exc)
                    self.saver._run(kv_store.op_done(row.id), "single")
                    sent += 1

    def close(self) -> None:
        """Wait for background calls (bounded by ``call_timeout_s`` each), close the client."""
        self._background.shutdown(wait=True)
        self.client.close()

    # -- server calls ----------------------------------------------------------------------

    def _apply(self, call: SessionCall) -> None:
        """Make one call; a missing session is no error (nothing cached yet, or gone)."""
        try:
            if call.op == "delete":
                self.client.delete_session(call.session_id)
            elif call.op == "copy":
                assert call.target_id is not None
                # The target thread was empty in SQL, so a session under its id is stale.
                self.client.copy_session(call.session_id, call.target_id, overwrite=True)
            else:
                ttl = self.options.ttl_seconds
                try:
                    self.client.create_session(call.session_id, ttl_seconds=ttl)
                except SessionExistsError:
                    if ttl is not None:
                        self.client.update_session(call.session_id, ttl_seconds=ttl)
        except SessionNotFoundError:
            return

    def _warm(self, session_id: str, register: bool, prefetch: bool) -> None:
        """Background job of ``get_tuple``: register a new session, prefetch its KV."""
        if register:
            self.send([SessionCall("register", session_id)])
        if not prefetch:
            return
        try:
            self.client.prefetch(session_id)
        except SessionNotFoundError:
            pass
        except KVCacheClientError as exc:
            logger.warning("prefetch of session %r failed: %s", session_id, exc)
