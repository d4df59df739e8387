"""The Redis tier's existence checks and removals, on a thread of their own.

A lookup that reaches past the local tiers asks Redis which of the next blocks it holds. A
network round trip (and a Redis that is slow or gone: up to the store's socket timeout) must
not run on vLLM's scheduler thread, so :meth:`RedisLookups.exists` answers from memory only:
the answer for exactly those keys when the thread has it, else None after queuing the check
("not yet": the scheduler answers vLLM None and is asked again next step, as vLLM's own
OffloadingConnector does for asynchronous lookups). An answer is used once. A Redis error is
an answer of all misses (:meth:`RedisStore.exists_many`), never an error. Removals of dropped
blocks go through the same thread, fire and forget (a block not removed expires by its TTL).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable

from server.kv.tiers.redis import RedisStore

log = logging.getLogger(__name__)


class RedisLookups:
    """Asynchronous ``exists_many`` / ``remove_many`` over one :class:`RedisStore`."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._lock = threading.Condition()
        self._checks: collections.OrderedDict[str, tuple[str, ...]] = collections.OrderedDict()
        self._removes: list[str] = []
        self._answers: dict[str, tuple[tuple[str, ...], list[bool]]] = {}
        self._inflight: tuple[str, tuple[str, ...]] | None = None
        self._live: set[str] = set()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="lgkv-redis", daemon=True)
        self._thread.start()

    def exists(self, req_id: str, keys: list[str]) -> list[bool] | None:
        """Which of ``keys`` Redis holds, if the answer for exactly them is in; else None
        (the check is queued once). Never blocks on Redis."""
        wanted = tuple(keys)
        with self._lock:
            answer = self._answers.pop(req_id, None)
            if answer is not None and answer[0] == wanted:
                return answer[1]
            self._live.add(req_id)
            if self._checks.get(req_id) != wanted and self._inflight != (req_id, wanted):
                self._checks[req_id] = wanted
                self._lock.notify()
        return None

    def forget(self, req_id: str) -> None:
        """The request finished: drop its pending check and answer."""
        with self._lock:
            self._checks.pop(req_id, None)
            self._answers.pop(req_id, None)
            self._live.discard(req_id)

    def remove(self, keys: list[str]) -> None:
        """Queue the removal of dropped blocks."""
        if keys:
            with self._lock:
                self._removes.extend(keys)
                self._lock.notify()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (queued removals are attempted first)."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._checks and not self._removes and not self._closing:
                    self._lock.wait()
                if self._closing and not self._removes:
                    return
                removes, self._removes = self._removes, []
                check = self._checks.popitem(last=False) if self._checks else None
                self._inflight = check
            if removes:
                with contextlib.suppress(OSError):
                    self.store.remove_many(removes)
            if check is not None:
                req_id, keys = check
                found = self.store.exists_many(list(keys))
                with self._lock:
                    self._inflight = None
                    if req_id in self._live and req_id not in self._checks:
                        self._answers[req_id] = (keys, found)  # not finished nor asked anew


def local_or_redis(local: Callable[[str], str | None], in_redis: set[str], key: str) -> str | None:
    """The tier of ``key``: a local one, else ``"redis"`` when Redis said it holds it."""
    return local(key) or ("redis" if key in in_redis else None)
