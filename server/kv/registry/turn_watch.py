"""Read your own turns: the session API waits for this process's finished turns, not the engine.

The engine records a finished turn (block list, tokens, last use) on its registry thread,
moments after the request finished and never on vLLM's scheduler thread. A client that gets
its chat answer and at once reads the session (``GET``, or a pin, copy or delete) must see that
turn. Asking the engine (a barrier request through its queue) made every session call wait
behind generation: up to a minute while the engine ran long requests.

Instead the API process remembers, per session, the turns it served that the registry may not
show yet (:meth:`TurnWatch.started` / :meth:`TurnWatch.finished`, called by the request
middleware around each generation), and a session call waits only for those: until the row's
``last_used_at`` reaches the start of the latest such turn (the engine stamps a turn with its
finish time, which is later than the request's start here), polling the registry, at most
:data:`RECORD_WAIT_S` after the turn finished (then it answers from the registry as it is, with
a warning). A session no turn of which is pending costs nothing. One replica knows its own
turns; a client reading through another replica (sessions in Redis) may see a turn a few
milliseconds late, as before.

Two turns of one session running at once are rare (a thread's turns follow each other); then
the wait ends at the record of either, and the other may show up moments later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

RECORD_WAIT_S = 2.0
"""Longest wait, counted from a turn's end, for the engine's record of it."""
POLL_S = 0.005
"""Registry poll interval while a record is awaited."""

SessionKey = tuple[str, str]
"""(tenant, session id)."""


@dataclass
class _Pending:
    started: float
    """Unix time the latest finished turn started (its record carries a later time)."""
    deadline: float
    """Monotonic time after which the record is no longer awaited."""


class TurnWatch:
    """Turns this process served whose records the registry may not show yet. Thread-safe:
    the middleware calls it on the event loop, the session routes from worker threads."""

    def __init__(self, *, wait_s: float = RECORD_WAIT_S) -> None:
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._pending: dict[SessionKey, _Pending] = {}
        self._running: dict[SessionKey, int] = {}

    def started(self, tenant: str, session_id: str) -> float:
        """A generation of the session starts; returns its start time for :meth:`finished`."""
        with self._lock:
            key = (tenant, session_id)
            self._running[key] = self._running.get(key, 0) + 1
        return time.time()

    def finished(self, tenant: str, session_id: str, started: float, *, ok: bool) -> None:
        """The generation begun at ``started`` ended; ``ok``: the engine ran it (its turn will
        be recorded), else nothing is awaited."""
        key = (tenant, session_id)
        with self._lock:
            left = self._running.get(key, 1) - 1
            if left > 0:
                self._running[key] = left
            else:
                self._running.pop(key, None)
            if ok:
                known = self._pending.get(key)
                latest = max(started, known.started) if known else started
                self._pending[key] = _Pending(latest, time.monotonic() + self.wait_s)

    def generating(self) -> bool:
        """Whether a generation of a named session runs now (the engine is busy)."""
        return bool(self._running)

    def pending(self, tenant: str, session_id: str | None = None) -> list[SessionKey]:
        """Sessions (of ``tenant``, or just ``session_id``) with a turn not yet seen."""
        with self._lock:
            if session_id is not None:
                key = (tenant, session_id)
                return [key] if key in self._pending else []
            return [k for k in self._pending if k[0] == tenant]

    def wait(
        self, tenant: str, session_id: str | None, last_used: Callable[[str, str], float | None]
    ) -> None:
        """Block until the registry shows every pending turn of the session (of every session
        of ``tenant`` when ``session_id`` is None), or their waits ran out.

        ``last_used(tenant, sid)`` reads the row's ``last_used_at`` (None: no row yet)."""
        for key in self.pending(tenant, session_id):
            while True:
                with self._lock:
                    entry = self._pending.get(key)
                if entry is None:
                    break
                seen = last_used(*key)
                if seen is not None and seen >= entry.started:
                    self._settled(key, entry)
                    break
                if time.monotonic() >= entry.deadline:
                    log.warning(
                        "the engine has not recorded the last turn of session %r within %.1f s "
                        "of its end; answering from the registry as it is",
                        key[1], self.wait_s,
                    )  # fmt: skip
                    self._settled(key, entry)
                    break
                time.sleep(POLL_S)

    def _settled(self, key: SessionKey, entry: _Pending) -> None:
        with self._lock:
            if self._pending.get(key) is entry:
                del self._pending[key]
