"""Bytes of large request bodies per key per second: one key cannot keep the API process busy.

The API process parses every body it rewrites, and vLLM's frontend parses it again; both hold
the GIL of the one process that also streams every other tenant's tokens. One key sending 2 MiB
bodies back to back (one at a time, as :mod:`server.api.chat` already enforces) kept that
process busy: tenant B's time to first token rose 3.4x (``benchmarks/tenants.py``, phase (a)).

:class:`BodyBudget` is a token bucket per tenant, in bytes: it holds up to ``burst`` bytes
(the largest body allowed, so one such body always fits a full bucket) and refills at ``rate``
bytes per second. A body that does not fit gets 429 before it is read, with ``Retry-After``
saying when it would. Event loop only: plain dicts suffice.
"""

from __future__ import annotations

import math
import time


class BodyBudget:
    """Large-body bytes per tenant per second (see the module doc)."""

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be > 0")
        self.rate = rate
        self.burst = burst
        self._level: dict[str, tuple[float, float]] = {}
        """tenant -> (bytes available, monotonic time of that figure)."""

    def take(self, tenant: str, size: int, now: float | None = None) -> float:
        """Charge ``size`` bytes to the tenant: 0.0 when they fit (charged), else the seconds
        until they would (nothing charged)."""
        now = time.monotonic() if now is None else now
        level, at = self._level.get(tenant, (float(self.burst), now))
        level = min(float(self.burst), level + (now - at) * self.rate)
        if size > level:
            self._level[tenant] = (level, now)
            return (size - level) / self.rate
        self._level[tenant] = (level - size, now)
        return 0.0

    def refusal(self, wait_s: float) -> tuple[str, int]:
        """The 429 message and the ``Retry-After`` seconds for a body refused for ``wait_s``."""
        return (
            f"this key sent more large request bodies than the server accepts "
            f"(--tenant-body-rate: {self.rate / 2**20:g} MiB per second, bodies over 64 KiB); "
            f"retry in {wait_s:.1f} s",
            max(1, math.ceil(wait_s)),
        )
