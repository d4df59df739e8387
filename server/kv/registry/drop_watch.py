"""The API process's watch on the shared drops stream (sessions in Redis only).

vLLM's engine core sleeps while it has no requests, and our scheduler side applies the
registry's events only when vLLM calls it. With one node that is enough: a ``DELETE`` of this
process is followed by a ``sync`` request that wakes the engine. With several replicas, a
``DELETE`` through replica B records drops that replica A's engine must apply too, and A may
be idle. :class:`DropWatcher` is a daemon thread of A's API process that blocks on the drops
stream (``XREAD BLOCK``) and calls ``on_drops`` (which submits a ``sync``) when new entries
arrive, from any replica, TTL purges included. Redis unreachable: a warning every 30 s,
retried every second; the engine applies missed drops at its next step anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from server.kv.registry.api import RegistryUnavailable
from server.kv.registry.redis import RedisSessions

log = logging.getLogger(__name__)


class DropWatcher:
    """Calls ``on_drops`` (on its own thread) after new entries in the drops stream."""

    def __init__(
        self, sessions: RedisSessions, on_drops: Callable[[], None], *, block_ms: int = 1000
    ) -> None:
        self.sessions = sessions
        self.on_drops = on_drops
        self.block_ms = block_ms
        self._stop = threading.Event()
        self._warned = 0.0
        self._thread = threading.Thread(target=self._run, name="lgkv-drop-watch", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 3.0) -> None:
        """Stop the thread (it notices within ``block_ms``)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        seq: str | None = None
        while not self._stop.is_set():
            try:
                if seq is None:
                    seq = self.sessions.last_drop_seq()
                newest = self.sessions.wait_drops(seq, self.block_ms)
            except RegistryUnavailable as exc:
                if time.monotonic() - self._warned > 30.0:
                    self._warned = time.monotonic()
                    log.warning("drops watch: %s", exc)
                self._stop.wait(1.0)
                continue
            if newest != seq and not self._stop.is_set():
                seq = newest
                try:
                    self.on_drops()
                except Exception as exc:  # the engine applies them at its next step anyway
                    log.warning("drops watch: could not wake the engine: %s", exc)
