"""What one key may send per second (bytes of large bodies, session API calls), so that one
key cannot keep the API process busy.

The API process parses every body it rewrites, and vLLM's frontend parses it again; both hold
the GIL of the one process that also streams every other tenant's tokens. One key sending 2 MiB
bodies back to back (one at a time, as :mod:`server.api.chat` already enforces) kept that
process busy: tenant B's time to first token rose 3.4x (``benchmarks/tenants.py``, phase (a)).

:class:`BodyBudget` is a token bucket per tenant, in bytes: it holds up to ``burst`` bytes
(the largest body allowed, so one such body always fits a full bucket) and refills at ``rate``
bytes per second. A body that does not fit gets 429 before it is read, with ``Retry-After``
saying when it would. :class:`KeyBucket` is the bucket; :class:`CallBudget` is the same for
session API calls (one unit per call).
"""

from __future__ import annotations

import math
import time


class KeyBucket:
    """A token bucket per tenant: up to ``burst`` units, refilled at ``rate`` per second.
    Event loop only: plain dicts suffice."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be > 0")
        self.rate = rate
        self.burst = burst
        self._level: dict[str, tuple[float, float]] = {}
        """tenant -> (units available, monotonic time of that figure)."""

    def take(self, tenant: str, size: float, now: float | None = None) -> float:
        """Charge ``size`` units to the tenant: 0.0 when they fit (charged), else the seconds
        until they would (nothing charged)."""
        now = time.monotonic() if now is None else now
        level, at = self._level.get(tenant, (float(self.burst), now))
        level = min(float(self.burst), level + (now - at) * self.rate)
        if size > level:
            self._level[tenant] = (level, now)
            return (size - level) / self.rate
        self._level[tenant] = (level - size, now)
        return 0.0


class BodyBudget(KeyBucket):
    """Large-body bytes per tenant per second (see the module doc)."""

    def refusal(self, wait_s: float) -> tuple[str, int]:
        """The 429 message and the ``Retry-After`` seconds for a body refused for ``wait_s``."""
        return (
            f"this key sent more large request bodies than the server accepts "
            f"(--tenant-body-rate: {self.rate / 2**20:g} MiB per second, bodies over 64 KiB); "
            f"retry in {wait_s:.1f} s",
            max(1, math.ceil(wait_s)),
        )


class CallBudget(KeyBucket):
    """Session API calls per tenant per second (``--tenant-session-rate``): a call costs the
    API process about 1 ms of CPU on the cores its engine uses, and one key renewing pins as
    fast as it could made about 700 calls a second (80% of a core on 2 cores, besides its own
    client's CPU; tenant B's time to first token 1.8x-3.8x idle meanwhile,
    ``benchmarks/tenants.py`` (b)). The bucket holds two seconds' worth."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate, 2 * rate)

    def refusal(self, wait_s: float) -> tuple[str, int]:
        """The 429 message and the ``Retry-After`` seconds for a call refused for ``wait_s``."""
        return (
            f"this key made more session API calls than the server accepts "
            f"(--tenant-session-rate: {self.rate:g} per second); retry in {wait_s:.1f} s",
            max(1, math.ceil(wait_s)),
        )
