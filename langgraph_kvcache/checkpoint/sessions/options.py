"""The options of a saver's session keeper, and its per-process memory.

:class:`KVSessionOptions` is what ``kv_server=`` becomes (:func:`resolve_options`);
:class:`Tracker` is what a keeper remembers between calls in one process (see
:mod:`.sync` for what the keepers do).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from langgraph_kvcache.contract import MAX_TTL_SECONDS, MIN_TTL_SECONDS

__all__ = [
    "DEFAULT_INTERRUPT_PIN_S",
    "IDLE_OUTBOX_CHECK_S",
    "KVSessionOptions",
    "Tracker",
    "resolve_options",
]

_MAX_TRACKED = 10_000
DEFAULT_INTERRUPT_PIN_S = 3600.0
"""The interrupt lease of a saver without a TTL (see ``KVSessionOptions.interrupt_pin_s``)."""
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
    run_pins: bool = True
    """Pin each (thread, namespace)'s server session while a graph run on it is in progress,
    so a long tool call or an ``interrupt()`` does not lose its KV to eviction (see
    :mod:`.pins`); ``False``: never pin (sessions are evicted by the server's policy
    alone). Pinned sessions hold their KV in the server's RAM budget: see docs/agents.md."""
    run_pin_s: float = 300.0
    """Lease of a run's pin: renewed as the run's checkpoints are stored, released when the run
    ends or fails; a client that dies mid-run leaves it to lapse after this long. Make it
    longer than the longest node (tool call, LLM call) of your graphs, or a pin lapses while
    that node runs."""
    interrupt_pin_s: float | None = None
    """How long a run stopped by ``interrupt()`` keeps its pin; ``None``: ``ttl_seconds``, or
    an hour (:data:`DEFAULT_INTERRUPT_PIN_S`) without a TTL."""

    def __post_init__(self) -> None:
        if not isinstance(self.server_url, str) or not self.server_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(
                "kv_server must be the server's URL (http://... or https://..., e.g. "
                f"http://127.0.0.1:8000) or a KVSessionOptions, got {self.server_url!r}"
            )
        if self.ttl_seconds is not None and not self.ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0 or None, got {self.ttl_seconds!r}")
        for name in ("prefetch_interval_s", "call_timeout_s", "retry_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("run_pin_s", "interrupt_pin_s"):
            value = getattr(self, name)
            if value is not None and not MIN_TTL_SECONDS <= value <= MAX_TTL_SECONDS:
                raise ValueError(
                    f"{name} must be between {MIN_TTL_SECONDS:g} and {MAX_TTL_SECONDS:g} "
                    f"seconds, got {value!r}"
                )

    @property
    def interrupt_lease_s(self) -> float:
        """The interrupt lease in effect (see :attr:`interrupt_pin_s`)."""
        if self.interrupt_pin_s is not None:
            return self.interrupt_pin_s
        if self.ttl_seconds is not None:
            return min(max(self.ttl_seconds, MIN_TTL_SECONDS), MAX_TTL_SECONDS)
        return DEFAULT_INTERRUPT_PIN_S


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
    if not isinstance(kv_server, str):
        raise TypeError(
            "kv_server must be the server's URL (e.g. http://127.0.0.1:8000) or a "
            f"KVSessionOptions, not {type(kv_server).__name__} {kv_server!r}"
        )
    return KVSessionOptions(kv_server, api_key=kv_api_key, ttl_seconds=ttl_seconds)


class Tracker:
    """Per-process memory: when each (thread, namespace) was last recorded and prefetched, and
    whether the outbox may hold calls. Thread-safe."""

    def __init__(self, options: KVSessionOptions) -> None:
        self.options = options
        self._last: dict[tuple[str, str], float] = {}
        self._registered: set[tuple[str, str]] = set()
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

    def first_registration(self, key: tuple[str, str]) -> bool:
        """Whether ``key``'s session is not registered by this process yet (and note that it
        is now). Past :data:`_MAX_TRACKED` keys the memory starts afresh: a registration
        made twice is harmless (it sets the same TTL)."""
        with self._lock:
            if key in self._registered:
                return False
            if len(self._registered) >= _MAX_TRACKED:
                self._registered.clear()
            self._registered.add(key)
            return True

    def forget(self, thread_ids: Sequence[str]) -> None:
        """Drop deleted threads (a reused id starts afresh: registered again)."""
        gone = set(thread_ids)
        with self._lock:
            self._last = {k: t for k, t in self._last.items() if k[0] not in gone}
            self._registered = {k for k in self._registered if k[0] not in gone}

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
