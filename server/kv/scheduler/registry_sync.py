"""The scheduler side's registry thread: every registry call of the engine, off vLLM's thread.

The registry is the SQLite file, or with ``--kv-redis-url`` sessions in Redis plus the local
part in the file (:func:`server.kv.registry.shared.open_registry`); the thread does not care
which: a Redis that is down fails a job like a locked file does, and the job is retried.

vLLM calls the scheduler side on its one scheduler thread, which must never wait on a disk or
on another process's lock. :class:`RegistrySync` owns the engine's registry connection on a
daemon thread; the scheduler only queues jobs and drains events, both in memory.

Contract:

- Jobs (:meth:`write`, :meth:`publish`, :meth:`sync`, :meth:`barrier`) return at once. The
  thread runs them in FIFO order. A write that fails (the registry locked by another process
  past the busy timeout, a full disk) keeps its place and is retried every ``retry_s`` until
  it succeeds or has failed for ``give_up_s`` (then it is dropped, with a warning); queued
  publishes merge into one.
- Between jobs, at least every ``poll_s`` and at once after its own writes, the thread reads
  what other processes changed, as increments: new ``drops`` rows (:class:`Dropped`) and the
  sessions named by new ``changes`` rows, with their rows and block lists
  (:class:`SessionChange`; ``row`` None: the session is gone). Only when the change log was
  trimmed past what it had read does it reload everything (:class:`Snapshot`, also sent once
  at start). Every ``purge_every_s`` it purges expired sessions (the engine owns expiry).
- A token from :meth:`sync` / :meth:`barrier` is answered by ``Done(token)`` once every job
  queued before it ran and a poll followed, so the events that poll caused come before it.
- Events wait in an outbox until :meth:`drain`; nothing is applied behind the scheduler's back.

So the engine sees the API process's deletes, copies, pins and TTLs within about ``poll_s``
(plus the time a lock holds the registry), and its own turn records and stats reach the
registry within milliseconds when the file is free, later while it is locked (lost only if
it stays locked past ``give_up_s``, or past the shutdown's wait).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from server.kv.registry.api import Cursor, EngineRegistry
from server.kv.registry.sql import SessionRow
from server.kv.registry.sqlite import Registry
from server.kv.scheduler.policy import SessionKey, SnapshotItem, group_snapshot

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 10_000
"""Sessions per chunk of the streamed policy snapshot."""

TierUpdates = dict[str, tuple[bool, bool, bool, int]]
"""Block key -> (in RAM, on disk, in Redis, bytes), as :meth:`Registry.set_block_tiers`."""


@dataclass(frozen=True)
class Snapshot:
    """The whole policy state (start, or the change log was trimmed past our position), in
    chunks as the registry streams it: ``first`` begins one, ``last`` ends it."""

    sessions: list[SessionRow]
    refs: list[tuple[str, str, str]]
    first: bool = True
    last: bool = True
    items: dict[SessionKey, SnapshotItem] | None = None
    """The chunk as one item per session (grouped on the registry thread)."""

    def grouped(self) -> dict[SessionKey, SnapshotItem]:
        """:attr:`items`, or the chunk grouped now (an event made elsewhere)."""
        return self.items if self.items is not None else group_snapshot(self.sessions, self.refs)


@dataclass(frozen=True)
class SessionChange:
    """A session's current row and block keys; ``row`` None: deleted or expired."""

    tenant: str
    session_id: str
    row: SessionRow | None
    keys: list[str]


@dataclass(frozen=True)
class Dropped:
    """Block keys freed by a delete or an expiry: forget them in every tier."""

    keys: list[str]


@dataclass(frozen=True)
class Done:
    """Every job queued before ``token`` ran, and the registry was read after them."""

    token: int


Event = Snapshot | SessionChange | Dropped | Done


@dataclass
class _Publish:
    updates: TierUpdates = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)

    def merge(self, other: _Publish) -> None:
        self.updates.update(other.updates)
        for name, value in other.counters.items():
            self.counters[name] = self.counters.get(name, 0.0) + value
        self.gauges.update(other.gauges)

    def run(self, reg: EngineRegistry) -> None:
        reg.set_block_tiers(self.updates)
        reg.add_stats(self.counters, self.gauges)


@dataclass
class _Write:
    what: str
    fn: Callable[[EngineRegistry], object]

    def run(self, reg: EngineRegistry) -> None:
        self.fn(reg)


@dataclass
class _Token:
    token: int
    purge: bool


_Job = _Publish | _Write | _Token


class RegistrySync:
    """The engine's registry connection on its own thread (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        busy_timeout_s: float = 2.0,
        poll_s: float = 0.05,
        purge_every_s: float = 10.0,
        retry_s: float = 0.2,
        give_up_s: float = 120.0,
        opener: Callable[[], EngineRegistry] | None = None,
    ) -> None:
        self.path = Path(path)
        self._opener = opener or (lambda: Registry(self.path, busy_timeout_s=busy_timeout_s))
        """Opens the registry on the thread: the SQLite file at ``path`` by default, or
        :func:`server.kv.registry.shared.open_registry` with sessions in Redis."""
        self.busy_timeout_s = busy_timeout_s
        self.poll_s = poll_s
        self.purge_every_s = purge_every_s
        self.retry_s = retry_s
        self.give_up_s = give_up_s
        self._jobs: collections.deque[_Job] = collections.deque()
        self._events: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition()
        self._next_token = 0
        self._answered = 0
        self._closing = False
        self._opened = threading.Event()
        self._registry: EngineRegistry | None = None
        self._drop_seq: Cursor = 0
        self._change_seq: Cursor = 0
        self._failing_since: float | None = None
        self._warned_poll = 0.0
        self._thread = threading.Thread(target=self._run, name="lgkv-registry", daemon=True)
        self._thread.start()

    # ------------------------------------------------------- scheduler side (no I/O)

    def write(self, what: str, fn: Callable[[EngineRegistry], object]) -> None:
        """Queue a write: ``fn`` runs on the thread with the connection (``what`` names it in
        warnings). ``fn`` must capture its arguments by value."""
        self._put(_Write(what, fn))

    def publish(
        self, updates: TierUpdates, counters: dict[str, float], gauges: dict[str, float]
    ) -> None:
        """Queue block locations, counter deltas and gauges (merged with a queued publish)."""
        job = _Publish(dict(updates), dict(counters), dict(gauges))
        with self._cond:
            last = self._jobs[-1] if self._jobs else None
            if isinstance(last, _Publish):
                last.merge(job)
            else:
                self._jobs.append(job)
            self._cond.notify()

    def sync(self) -> int:
        """Queue a purge of expired sessions and a read of every change; return the token."""
        return self._token(purge=True)

    def barrier(self) -> int:
        """Queue a read of every change after the queued jobs; return the token."""
        return self._token(purge=False)

    def drain(self) -> list[Event]:
        """The events so far, oldest first (never blocks)."""
        out: list[Event] = []
        while self._events:
            out.append(self._events.popleft())
        return out

    # --------------------------------------------------- tests, tools, shutdown

    def wait(self, token: int, timeout_s: float = 30.0) -> bool:
        """Block until ``token`` is answered (False on timeout). Never on the hot path."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._answered < token:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    @property
    def registry(self) -> EngineRegistry:
        """The thread's connection, once open (blocks until then). Tests and tools only."""
        if not self._opened.wait(60.0) or self._registry is None:
            raise RuntimeError(f"session registry {self.path} did not open")
        return self._registry

    def close(self, timeout_s: float = 10.0) -> None:
        """Run the queued jobs (for up to ``timeout_s``), then close the connection."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "session registry busy: %d bookkeeping writes not saved at shutdown",
                len(self._jobs),
            )

    # ------------------------------------------------------------------ thread

    def _put(self, job: _Job) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def _token(self, *, purge: bool) -> int:
        with self._cond:
            self._next_token += 1
            self._jobs.append(_Token(self._next_token, purge))
            self._cond.notify()
            return self._next_token

    def _run(self) -> None:
        reg = self._open()
        if reg is None:
            return
        last_poll = 0.0
        while True:
            with self._cond:
                if not self._jobs and not self._closing:
                    self._cond.wait(self.poll_s)
                closing = self._closing
            wrote = self._run_jobs(reg)
            if wrote or time.monotonic() - last_poll >= self.poll_s:
                self._poll(reg, force=wrote)
                last_poll = time.monotonic()
            if closing and not self._jobs:
                break
            if self._failing_since is not None:
                time.sleep(self.retry_s)
        reg.close()

    def _open(self) -> EngineRegistry | None:
        warned = False
        while not self._closing:
            reg: EngineRegistry | None = None
            try:
                reg = self._opener()
                self._start(reg)
            except Exception as exc:
                if reg is not None:
                    reg.close()
                if not warned:
                    log.warning("session registry %s unavailable (%s); retrying", self.path, exc)
                    warned = True
                time.sleep(self.retry_s)
                continue
            self._registry = reg
            self._opened.set()
            return reg
        self._opened.set()
        return None

    def _start(self, reg: EngineRegistry) -> None:
        self._drop_seq = reg.resume_drops()
        reg.drops_read(self._drop_seq)  # a restart resumes from here at the latest
        self._change_seq = reg.change_seq()
        self._version = reg.data_version()
        self._last_purge = time.monotonic()
        self._stream_snapshot(reg)

    def _stream_snapshot(self, reg: EngineRegistry) -> None:
        """Queue the policy snapshot chunk by chunk as it is read (one event per chunk: the
        scheduler starts on the first while the next is read, and takes each in steps)."""
        chunks = reg.iter_policy_snapshot(SNAPSHOT_CHUNK)
        ahead = next(chunks, None)
        first = True
        while True:
            sessions, refs = ahead if ahead is not None else ([], [])
            ahead = next(chunks, None) if ahead is not None else None
            items = group_snapshot(sessions, refs)
            self._events.append(Snapshot(sessions, refs, first, ahead is None, items))
            first = False
            if ahead is None:
                return

    def _run_jobs(self, reg: EngineRegistry) -> bool:
        """Run queued jobs until none is left or one fails; True if any wrote."""
        wrote = False
        while True:
            with self._cond:
                if not self._jobs:
                    return wrote
                job = self._jobs.popleft()
            if isinstance(job, _Token):
                if job.purge:
                    self._purge(reg)
                self._poll(reg, force=True)
                self._answer(job.token)
                continue
            try:
                job.run(reg)
            except Exception as exc:
                self._failed(job, exc)
                return wrote
            self._failing_since = None
            wrote = True

    def _failed(self, job: _Job, exc: Exception) -> None:
        now = time.monotonic()
        what = job.what if isinstance(job, _Write) else "stats publish"
        if self._failing_since is None:
            self._failing_since = now
            log.warning("session registry busy or unreachable (%s); retrying %s", exc, what)
        if now - self._failing_since > self.give_up_s:
            log.warning(
                "session registry busy or unreachable for %.0f s: %s dropped", self.give_up_s, what
            )
            self._failing_since = None
            return
        with self._cond:
            self._jobs.appendleft(job)

    def _answer(self, token: int) -> None:
        self._events.append(Done(token))
        with self._cond:
            self._answered = max(self._answered, token)
            self._cond.notify_all()

    def _purge(self, reg: EngineRegistry) -> None:
        self._last_purge = time.monotonic()
        try:
            reg.purge_expired()  # its drops and changes are read by the next poll
        except Exception as exc:
            self._warn_poll(f"could not purge expired sessions ({exc}); retrying later")

    def _poll(self, reg: EngineRegistry, *, force: bool) -> None:
        """Read new drops and changed sessions (increments); purge when it is time."""
        if time.monotonic() - self._last_purge > self.purge_every_s:
            self._purge(reg)
            force = True
        try:
            version = reg.data_version()
            if version == self._version and not force:
                return
            drop_seq, dropped = reg.drops_after(self._drop_seq)
            if dropped:
                self._events.append(Dropped(dropped))
            if drop_seq != self._drop_seq:
                reg.drops_read(drop_seq)
                self._drop_seq = drop_seq
            seq, changed = reg.changes_after(self._change_seq)
            if changed is None:
                self._stream_snapshot(reg)
            else:
                for tenant, sid in changed:
                    row, keys = reg.session_state(tenant, sid)
                    self._events.append(SessionChange(tenant, sid, row, keys))
            self._change_seq, self._version = seq, version
        except Exception as exc:  # retried at the next poll
            self._warn_poll(f"could not read registry changes ({exc}); retrying")

    def _warn_poll(self, message: str) -> None:
        if time.monotonic() - self._warned_poll > 30.0:
            self._warned_poll = time.monotonic()
            log.warning("session registry: %s", message)
