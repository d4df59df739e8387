"""The session keeper's logic, written once for the sync and the async saver.

:class:`~.sync.ThreadSessions` (sync) and :class:`~.aio.AsyncThreadSessions`
(async) keep a KV-cache server's sessions in step with a saver's threads (what they do is in
:mod:`.sync`). Everything they decide is here, in two forms a driver runs:

- **In-transaction operations** (:data:`~..base.Op`, the saver's own form): the ``_tx_*``
  lifecycle hooks wrap the saver's change (delete, copy, ...) with the keeper's bookkeeping in
  the same transaction: the session table rows, and an outbox row for each server call the
  change owes. Once the change is committed its calls are too: a process killed right after the
  commit leaves them in the outbox, and the next drain of any process on the database makes them.
- **Steps** (:data:`~.steps.Steps`): generators that yield :class:`Sql` (run an operation)
  and :class:`Request` (call the session API), are sent each result or thrown its error, and
  return their own result. The sync keeper drives them with a :class:`Runner` and a
  ``KVCacheClient``, the async one with an async :class:`Runner` and an ``AsyncKVCacheClient``.

A keeper talks to its saver only through a :class:`Runner`; the server only through the steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint, CheckpointTuple

from langgraph_kvcache.checkpoint.base import Op
from langgraph_kvcache.checkpoint.hooks import LifecycleHooks
from langgraph_kvcache.checkpoint.sessions import store
from langgraph_kvcache.checkpoint.sessions.options import KVSessionOptions, Tracker
from langgraph_kvcache.checkpoint.sessions.pins import PinCall, RunPins
from langgraph_kvcache.checkpoint.sessions.steps import Request, Runner, Sql, Steps, adrive, drive
from langgraph_kvcache.checkpoint.sessions.store import SessionCall
from langgraph_kvcache.client import (
    AuthenticationError,
    KVCacheClientError,
    ServerUnavailableError,
    SessionExistsError,
    SessionNotFoundError,
)
from langgraph_kvcache.sessions import session_id_for, strip_task_ids, thread_session_prefix

__all__ = ["Request", "Runner", "SessionKeeper", "Sql", "Steps", "Warm", "adrive", "drive"]

logger = logging.getLogger("langgraph_kvcache.checkpoint.sessions.sync")

T = TypeVar("T")

DRAIN_BATCH = 100
"""Outbox rows read per query while draining."""


@dataclass(frozen=True)
class Warm:
    """Background work a ``get_tuple`` leaves: drain the outbox (a registration, or a retry is
    due), then prefetch the session's KV."""

    session_id: str
    drain: bool
    prefetch: bool


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


def log_unavailable(what: str, exc: Exception) -> None:
    """The one warning a failed server call leaves (the call itself waits in the outbox)."""
    logger.warning("KV-cache server unavailable, %s later: %s", what, exc)


class SessionKeeper(LifecycleHooks):
    """The logic both keepers share: the in-transaction hooks and the steps their drivers run.

    A driver subclass implements the ``_after_*`` hooks (let queued background work finish,
    bounded, then drain the outbox the transaction just wrote to), ``get_tuple``'s hook (drive
    :meth:`_get_tuple_steps`, then run the :class:`Warm` it returns in the background),
    :meth:`_submit` (run steps in the background), ``drain`` and ``sweep_expired``; it runs
    server work (drains, background jobs) one at a time, so a prefetch queued by ``get_tuple``
    never races the delete that follows it. The store hooks (run pins) are here, once.
    """

    def __init__(self, runner: Runner[Any], options: KVSessionOptions) -> None:
        self.runner = runner
        """The saver's database (see :class:`Runner`)."""
        self.options = options
        self._tracker = Tracker(options)
        self.run_pins = (
            RunPins(options.run_pin_s, options.interrupt_lease_s) if options.run_pins else None
        )
        """The run pins this process holds (``None`` with ``run_pins=False``)."""

    def _submit(self, steps: Steps[None]) -> None:
        """Run ``steps`` in the background, after the server work queued before (no wait)."""
        raise NotImplementedError

    # -- store hooks (run pins; see :mod:`.pins`) ----------------------------------------

    def _after_checkpoint(self, config: RunnableConfig, checkpoint: Checkpoint) -> None:
        try:
            key = thread_key(config)
        except (KeyError, TypeError):  # no thread id: nothing to register
            key = None
        if key is not None and self._tracker.first_registration(key):
            self._submit(self._register_steps(key))
        if self.run_pins is not None:
            self._pin(self.run_pins.on_checkpoint, config, checkpoint)

    def _register_steps(self, key: tuple[str, str]) -> Steps[None]:
        """A thread's first checkpoint stored by this process (a write, never a read): record
        its use and register its session with the saver's TTL, in the background."""
        yield Sql(self._op_register(key), "write")
        yield from self._drain_steps()

    def _op_register(self, key: tuple[str, str]) -> Op[None]:
        """Record and owe the registration, unless the thread lost its checkpoints since (a
        delete committed before this job ran: no row nor session for a deleted thread)."""
        gone = yield from store.op_threads_without_checkpoints([key[0]])
        if not gone:
            yield from self._op_use(key, True)

    def _after_task_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]]) -> None:
        if self.run_pins is not None:
            self._pin(self.run_pins.on_writes, config, writes)

    def _pin(self, decide: Callable[..., PinCall | None], *args: Any) -> None:
        """Queue the pin call ``decide`` owes; never raises into the saver's write."""
        try:
            call = decide(*args)
        except Exception as exc:  # a checkpoint not shaped as LangGraph's: no pin
            logger.warning("run pins: checkpoint or writes not understood, no pin: %r", exc)
            return
        if call is not None:
            self._submit(self._pin_steps(call))

    def _pin_steps(self, call: PinCall) -> Steps[None]:
        """Pin (with the call's lease) or unpin; a missing session (no LLM call yet) or a
        failure leaves the pin to the next checkpoint, with a warning for a failure."""
        assert self.run_pins is not None
        try:
            if call.lease_s is None:
                yield Request("unpin", (call.session_id,))
            else:
                yield Request("pin", (call.session_id,), {"ttl_seconds": call.lease_s})
        except SessionNotFoundError:
            self.run_pins.failed(call)
        except KVCacheClientError as exc:
            self.run_pins.failed(call)
            logger.warning("run pin of session %r not changed: %s", call.session_id, exc)

    # -- in-transaction hooks (run by the saver inside its change's transaction) -------------

    def _tx_delete_threads(self, change: Op[T], thread_ids: Sequence[str]) -> Op[T]:
        yield from self._op_drop(thread_ids)  # first: it reads the namespaces of checkpoints
        return (yield from change)

    def _tx_copy_thread(self, change: Op[T], source: str, target: str) -> Op[T]:
        result = yield from change
        pairs = yield from store.op_thread_namespaces([source])
        calls, rows = copy_calls(source, target, pairs)
        yield from store.op_touch(self.runner.dialect, rows, time.time())
        yield from self._op_owe(calls)
        return result

    def _tx_delete_for_runs(self, change: Op[list[str]], run_ids: Sequence[str]) -> Op[list[str]]:
        threads = yield from change
        emptied = yield from store.op_threads_without_checkpoints(threads)
        if emptied:
            yield from self._op_drop(emptied)
        return threads

    def _op_sweep(self, limit: int) -> Op[list[str]]:
        """``sweep_expired``'s transaction: up to ``limit`` threads unused for ``ttl_seconds``
        lose their checkpoints and session rows, and their sessions are owed a delete."""
        assert self.options.ttl_seconds is not None
        cutoff = time.time() - self.options.ttl_seconds
        threads = yield from store.op_expired(cutoff, limit)
        if threads:
            yield from self._op_drop(threads)
            yield from self.runner.delete_threads(threads)
        return threads

    def _op_drop(self, thread_ids: Sequence[str]) -> Op[None]:
        """Forget the threads' session rows and owe a delete of each of their sessions (those
        recorded and those of their checkpoints: run it before deleting the checkpoints)."""
        sessions = yield from store.op_forget(thread_ids)
        self._tracker.forget(thread_ids)
        if self.run_pins is not None:
            self.run_pins.forget(thread_ids)
        yield from self._op_owe(delete_calls(thread_ids, sessions))

    def _op_owe(self, calls: Sequence[SessionCall]) -> Op[None]:
        """Append ``calls`` to the outbox (in the caller's transaction)."""
        if calls:
            yield from store.op_enqueue(calls)
            self._tracker.outbox_pending = True

    # -- steps ---------------------------------------------------------------------------------

    def _get_tuple_steps(
        self, config: RunnableConfig, found: CheckpointTuple | None
    ) -> Steps[Warm | None]:
        """For a thread that has a checkpoint: record the use (at most once per
        ``prefetch_interval_s``), owe a registration of a session new to this process, and
        prefetch its KV. A read never creates a session, nor a row: a thread without
        checkpoints (unknown, deleted or expired) registers at its first checkpoint
        (:meth:`_after_checkpoint`). Returns the background work, if any."""
        key = thread_key(config)
        register = prefetch = False
        if found is not None and self.run_pins is not None:
            self.run_pins.on_read(config, found.pending_writes or ())
        if found is not None:
            due, _ = self._tracker.due(key)
            if due:
                register = self._tracker.first_registration(key)
                prefetch = True
                yield Sql(self._op_use(key, register), "write" if register else "single")
        drain = register or self._tracker.retry_due()
        if drain or prefetch:
            return Warm(session_id_for(*key), drain, prefetch)
        return None

    def _op_use(self, key: tuple[str, str], register: bool) -> Op[None]:
        yield from store.op_touch(self.runner.dialect, [key], time.time())
        if register:
            yield from self._op_owe([SessionCall("register", session_id_for(*key))])

    def _check_key_steps(self) -> Steps[None]:
        """``setup()``'s look at the server: a refused key raises
        :class:`~langgraph_kvcache.client.AuthenticationError` (every call of this saver would
        be refused); the server down, or any other answer, is a warning only."""
        try:
            yield Request("list_sessions", (), {"limit": 1})
        except AuthenticationError:
            raise
        except KVCacheClientError as exc:
            logger.warning("KV-cache server not checked at setup: %s", exc)

    def _warm_steps(self, job: Warm) -> Steps[None]:
        """``get_tuple``'s background work: drain (registrations first), then prefetch."""
        if job.drain:
            yield from self._drain_steps()
        if not job.prefetch:
            return
        try:
            yield Request("prefetch", (job.session_id,))
        except SessionNotFoundError:
            pass
        except KVCacheClientError as exc:
            logger.warning("prefetch of session %r failed: %s", job.session_id, exc)

    def _drain_steps(self) -> Steps[int]:
        """Replay the outbox in order until it is empty or the server is unavailable; returns
        how many calls were made. A refused key (401) stops the drain and keeps the call,
        like an unavailable server; any other refusal (a missing session is no error) is
        logged and the call dropped."""
        sent = 0
        while True:
            rows = yield Sql(store.op_pending(DRAIN_BATCH))
            if not rows:
                self._tracker.outbox_pending = False
                return sent
            for row in rows:
                try:
                    yield from self._call_steps(row.call)
                except ServerUnavailableError as exc:
                    log_unavailable(f"{len(rows)}+ pending session calls retried", exc)
                    yield Sql(store.op_failed(row.id, str(exc)), "single")
                    self._tracker.outbox_pending = True
                    return sent
                except AuthenticationError as exc:  # never drop a call for a wrong key
                    logger.error(
                        "KV-cache server refused the saver's key; %d+ session calls (%s first) "
                        "stay in the outbox until it is fixed: %s", len(rows), row.call, exc,
                    )  # fmt: skip
                    yield Sql(store.op_failed(row.id, str(exc)), "single")
                    self._tracker.outbox_pending = True
                    return sent
                except KVCacheClientError as exc:
                    logger.warning("dropping session call %s: %s", row.call, exc)
                yield Sql(store.op_done(row.id), "single")
                sent += 1

    def _call_steps(self, call: SessionCall) -> Steps[None]:
        """Make one call; a missing session is no error (nothing cached yet, or gone)."""
        try:
            if call.op == "delete":
                yield Request("delete_session", (call.session_id,))
            elif call.op == "copy":
                # The target thread was empty in SQL, so a session under its id is stale.
                args = (call.session_id, call.target_id)
                yield Request("copy_session", args, {"overwrite": True})
            else:
                ttl = self.options.ttl_seconds
                try:
                    yield Request("create_session", (call.session_id,), {"ttl_seconds": ttl})
                except SessionExistsError:
                    if ttl is not None:
                        yield Request("update_session", (call.session_id,), {"ttl_seconds": ttl})
        except SessionNotFoundError:
            return
