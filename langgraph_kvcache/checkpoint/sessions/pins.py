"""Run-scoped pins: a thread's session stays pinned on the server while a graph run is on.

A graph run on a thread puts a checkpoint at the end of each superstep; between two of them a
node runs (an LLM call, a tool, a sub-agent), and a long one (a slow tool, a person answering
an ``interrupt()``) leaves the thread idle while other threads' turns push its KV out of the
server's RAM. With ``run_pins`` on (:class:`~.options.KVSessionOptions`), the session keeper
pins the session of each (thread, checkpoint namespace) as a *lease*, from what the saver is
given to store:

- a checkpoint with pending tasks (the run goes on): pinned for ``run_pin_s``, renewed by a
  later checkpoint once less than half of it is left (so most checkpoints cost no call);
- a checkpoint without pending tasks (the run is over): unpinned;
- a task's ``ERROR`` write (the run fails): unpinned; LangGraph stores writes and checkpoints
  on different background threads, so the failing step's own checkpoint may be stored after
  the error: a checkpoint no newer than the one the error was written against asks for nothing;
- a task's ``INTERRUPT`` write (``interrupt()``; the run stops until resumed): pinned for the
  interrupt lease (``interrupt_pin_s``, by default the thread TTL), which the resumed run's
  checkpoints leave alone while it is the longer.

A thread may resume in another process than the one that pinned it (a fresh saver of another
web request or worker answers the ``interrupt()``): a ``get_tuple`` that finds the thread
stopped by an ``INTERRUPT`` write takes the interrupt lease over (:meth:`RunPins.on_read`), so
whichever saver ends the resumed run releases the pin. A client that dies mid-run never
unpins: its lease lapses on the server by itself. A run
stopped by ``interrupt_before``/``interrupt_after`` ends on a checkpoint with pending tasks,
which looks like any checkpoint of a run going on: it keeps the run lease only.

:func:`has_pending_tasks` reads pending tasks off a checkpoint the way LangGraph's own
``prepare_next_tasks`` decides which nodes run next, without the graph: a node of a compiled
``StateGraph`` is triggered by ``branch:to:<node>`` (``__start__`` by its input channel, a
join of several sources by ``join:<a>+<b>:<node>``), and is pending when that channel holds a
value written after the node last saw it (a consumed channel is gone from ``channel_values``,
a consumed join is empty); pending ``Send`` packets sit in ``__pregel_tasks``.
:class:`RunPins` decides the calls; the keepers make them in the background
(:mod:`.keeper`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langgraph.checkpoint.base import Checkpoint

from langgraph_kvcache.sessions import session_id_for, strip_task_ids

__all__ = ["PinCall", "RunPins", "has_pending_tasks"]

START = "__start__"
TASKS = "__pregel_tasks"
ERROR = "__error__"
INTERRUPT = "__interrupt__"
BRANCH_TO = "branch:to:"
JOIN = "join:"
_MAX_TRACKED = 10_000


def _join_target(channel: str, sources: set[Any]) -> str | None:
    """The node a complete join channel ``join:<a>+<b>:<node>`` triggers, or None while not
    every source in its name has written (``sources``: the names the barrier has seen)."""
    rest = channel[len(JOIN) :]

    def match(rest: str, left: frozenset[str]) -> str | None:
        for name in left:
            if not rest.startswith(name):
                continue
            tail, others = rest[len(name) :], left - {name}
            if others and tail.startswith("+"):
                found = match(tail[1:], others)
                if found is not None:
                    return found
            elif not others and tail.startswith(":") and len(tail) > 1:
                return tail[1:]
        return None

    names = frozenset(s for s in sources if isinstance(s, str))
    return match(rest, names) if names else None


def has_pending_tasks(checkpoint: Checkpoint) -> bool:
    """Whether a graph resumed from ``checkpoint`` has tasks to run (what
    ``graph.get_state(config).next`` lists is not empty), judged from the checkpoint alone."""
    values: Mapping[str, Any] = checkpoint.get("channel_values") or {}
    if values.get(TASKS):
        return True
    versions: Mapping[str, Any] = checkpoint.get("channel_versions") or {}
    seen_by: Mapping[str, Mapping[str, Any]] = checkpoint.get("versions_seen") or {}
    for channel, value in values.items():
        if channel == START:
            node: str | None = START
        elif channel.startswith(BRANCH_TO):
            node = channel[len(BRANCH_TO) :]
        elif channel.startswith(JOIN) and isinstance(value, (set, frozenset)):
            node = _join_target(channel, set(value))
        else:
            continue
        if node is None or channel not in versions:
            continue
        seen = seen_by.get(node, {}).get(channel)
        if seen is None or versions[channel] > seen:
            return True
    return False


@dataclass(frozen=True)
class PinCall:
    """A pin call a keeper owes: pin ``session_id`` for ``lease_s`` seconds, or unpin it
    (``lease_s`` None)."""

    key: tuple[str, str]
    """(thread id, namespace without task ids)."""
    session_id: str
    lease_s: float | None


class RunPins:
    """Per-process memory of the run pins this process holds, and the calls they need.
    Thread-safe; an unknown (thread, namespace) counts as unpinned."""

    def __init__(self, run_pin_s: float, interrupt_pin_s: float) -> None:
        self.run_pin_s = run_pin_s
        self.interrupt_pin_s = interrupt_pin_s
        self._until: dict[tuple[str, str], float] = {}
        """Key -> when (``time.monotonic``) the lease asked for runs out."""
        self._failed_at: dict[tuple[str, str], str] = {}
        """Key -> the id of the checkpoint its last run failed at (an ``ERROR`` write)."""
        self._lock = threading.Lock()

    def on_checkpoint(self, config: Mapping[str, Any], checkpoint: Checkpoint) -> PinCall | None:
        """The call a stored checkpoint needs: a (renewed) run lease while tasks are pending,
        an unpin once none are."""
        key = _key(config)
        if self._stale(key, checkpoint.get("id")):
            return None
        if has_pending_tasks(checkpoint):
            return self._want(key, self.run_pin_s)
        return self._release(key)

    def on_writes(
        self, config: Mapping[str, Any], writes: Sequence[tuple[str, Any]]
    ) -> PinCall | None:
        """The call a task's stored writes need: an interrupt lease for ``INTERRUPT``, an
        unpin for ``ERROR``, nothing for ordinary writes."""
        channels = {channel for channel, _ in writes}
        if INTERRUPT in channels:
            return self._want(_key(config), self.interrupt_pin_s)
        if ERROR in channels:
            key = _key(config)
            failed_at = config["configurable"].get("checkpoint_id")
            if isinstance(failed_at, str):
                with self._lock:
                    if len(self._failed_at) >= _MAX_TRACKED:
                        self._failed_at.clear()
                    self._failed_at[key] = failed_at
            return self._release(key)
        return None

    def on_read(self, config: Mapping[str, Any], pending_writes: Iterable[Sequence[Any]]) -> None:
        """A ``get_tuple`` found the thread's checkpoint with these pending writes: a thread
        stopped by ``interrupt()`` holds the interrupt lease (whoever pinned it), which this
        process now releases when the run it resumes ends. No call."""
        if not any(len(w) > 1 and w[1] == INTERRUPT for w in pending_writes):
            return
        key = _key(config)
        with self._lock:
            if key not in self._until:
                self._until[key] = time.monotonic() + self.interrupt_pin_s

    def failed(self, call: PinCall) -> None:
        """The server did not take ``call`` (no session yet, unreachable): the next
        checkpoint asks again."""
        if call.lease_s is not None:
            with self._lock:
                self._until.pop(call.key, None)

    def forget(self, thread_ids: Iterable[str]) -> None:
        """Deleted threads hold no pins."""
        gone = set(thread_ids)
        with self._lock:
            self._until = {k: t for k, t in self._until.items() if k[0] not in gone}
            self._failed_at = {k: c for k, c in self._failed_at.items() if k[0] not in gone}

    def _stale(self, key: tuple[str, str], checkpoint_id: Any) -> bool:
        """Whether a checkpoint belongs to a run that already failed: its id (LangGraph's ids
        sort in the order they were made) is not newer than the failing one. A newer one (the
        run retried) forgets the failure."""
        with self._lock:
            failed_at = self._failed_at.get(key)
            if failed_at is None or not isinstance(checkpoint_id, str):
                return False
            if checkpoint_id <= failed_at:
                return True
            del self._failed_at[key]
            return False

    def _want(self, key: tuple[str, str], lease_s: float) -> PinCall | None:
        """Pin for ``lease_s`` unless the lease held lasts at least half of that still."""
        now = time.monotonic()
        with self._lock:
            until = self._until.get(key)
            if until is not None and until - now >= lease_s / 2:
                return None
            if len(self._until) >= _MAX_TRACKED:
                self._until = {k: t for k, t in self._until.items() if t > now}
            self._until[key] = now + lease_s
        return PinCall(key, session_id_for(*key), lease_s)

    def _release(self, key: tuple[str, str]) -> PinCall | None:
        with self._lock:
            if self._until.pop(key, None) is None:
                return None
        return PinCall(key, session_id_for(*key), None)


def _key(config: Mapping[str, Any]) -> tuple[str, str]:
    configurable = config["configurable"]
    return str(configurable["thread_id"]), strip_task_ids(configurable.get("checkpoint_ns", ""))
