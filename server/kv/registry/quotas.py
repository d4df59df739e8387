"""Per-tenant quotas: what one key may hold so that it cannot take the cache from the others.

Checked in the API process, against the registry, before a change is recorded:

- sessions: creating a session or copying into a new one past ``max_sessions`` of the tenant
  is refused with 429 (a generation that names a new session past it too: the request
  middleware asks :meth:`TenantQuotas.check_new_session`);
- pins: a pin whose session, with the tenant's other pinned sessions, would fill more than
  ``pin_share`` of a tier (RAM or disk; a session counts its whole block list) is refused
  with 409; so is a pin without a lease once the tenant holds ``max_unleased_pins`` of them,
  and one with a lease longer than ``max_pin_lease_s`` (a well-formed request the server's
  policy refuses: the schema allows leases up to 366 days);
- managed marks (a prefetched session ranks after every other block): a tenant's managed
  sessions are bounded by the same share; past it a prefetch still runs but marks nothing.

Pinned blocks as a whole are bounded by the engine (``--kv-pin-share``): past that share of a
tier, further pinned blocks rank like unpinned ones (:mod:`server.kv.scheduler.eviction_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.kv.registry.api import EngineRegistry
    from server.kv.registry.sql import SessionRow

TIERS = ("ram", "disk")


class QuotaExceeded(Exception):
    """A tenant's change would pass one of its quotas; ``status`` is the HTTP answer (409 for
    a pin, 429 for sessions) and the message names the quota and its flag."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TenantQuotas:
    """The per-tenant bounds (server flags; see docs/operations.md, "Tenants and quotas")."""

    max_sessions: int = 100_000
    """Sessions one tenant may hold (``--tenant-max-sessions``)."""
    pin_share: float = 0.25
    """Share of each tier one tenant's pinned (and, apart, managed) sessions may fill
    (``--tenant-pin-share``)."""
    max_unleased_pins: int = 16
    """Pins without a lease one tenant may hold (``--tenant-max-unleased-pins``)."""
    max_pin_lease_s: float = 86_400.0
    """Longest pin lease in seconds (``--max-pin-lease``)."""
    tier_bytes: dict[str, int] = field(default_factory=dict)
    """Budget of each tier in bytes (``ram``, ``disk``; a tier absent or 0 has no bound)."""

    def check_lease(self, lease_s: float | None) -> None:
        """409 for a lease longer than :attr:`max_pin_lease_s`."""
        if lease_s is not None and lease_s > self.max_pin_lease_s:
            raise QuotaExceeded(
                409,
                f"pin_ttl_seconds={lease_s:g} is longer than the server allows "
                f"({self.max_pin_lease_s:g} s, --max-pin-lease); pin for less and renew",
            )

    def check_new_session(self, registry: EngineRegistry, tenant: str) -> None:
        """429 when ``tenant`` holds :attr:`max_sessions` sessions already."""
        held = registry.count_sessions(tenant)
        if held >= self.max_sessions:
            raise QuotaExceeded(
                429,
                f"this key holds {held} sessions, the most the server allows "
                f"(--tenant-max-sessions {self.max_sessions}); delete sessions or let their "
                "TTLs expire",
            )

    def check_pin(
        self,
        registry: EngineRegistry,
        tenant: str,
        session_id: str,
        lease_s: float | None,
        now: float,
    ) -> None:
        """409 when pinning ``session_id`` (for ``lease_s``, None: no lease) would pass the
        tenant's pin quotas; the session's own earlier pin does not count twice."""
        self.check_lease(lease_s)
        others = [r for r in registry.pinned_sessions(tenant, now) if r.id != session_id]
        if lease_s is None:
            unleased = sum(1 for r in others if r.pin_until is None)
            if unleased >= self.max_unleased_pins:
                raise QuotaExceeded(
                    409,
                    f"this key holds {unleased} pins without a lease, the most the server "
                    f"allows (--tenant-max-unleased-pins {self.max_unleased_pins}); pin with "
                    "pin_ttl_seconds, or unpin another session",
                )
        self._check_share(registry, tenant, [*others, session_id], "pinned")

    def may_mark_managed(self, registry: EngineRegistry, tenant: str, session_id: str) -> bool:
        """Whether marking ``session_id`` managed keeps the tenant's managed sessions within
        :attr:`pin_share` of each tier."""
        others = [r for r in registry.managed_sessions(tenant) if r.id != session_id]
        try:
            self._check_share(registry, tenant, [*others, session_id], "managed")
        except QuotaExceeded:
            return False
        return True

    def _check_share(
        self,
        registry: EngineRegistry,
        tenant: str,
        sessions: list[SessionRow | str],
        what: str,
    ) -> None:
        """409 when ``sessions`` (rows, or the id of the session being marked) would fill more
        than :attr:`pin_share` of a tier. A session counts its whole block list in each tier
        (every save is written through to disk; a pinned block leaves RAM last), at the
        tier's bytes per block, so the cost is one indexed row read per session."""
        blocks = 0
        for row in sessions:
            if isinstance(row, str):
                found = registry.get_session(tenant, row)
                blocks += found.num_blocks if found is not None else 0
            else:
                blocks += row.num_blocks
        if not blocks:
            return
        per_block = _bytes_per_block(registry, tenant, sessions)
        for tier in TIERS:
            budget = self.tier_bytes.get(tier, 0)
            limit = int(budget * self.pin_share)
            used = blocks * per_block.get(tier, 0)
            if budget and used > limit:
                raise QuotaExceeded(
                    409,
                    f"{what} sessions of this key would hold {used} bytes of the {tier} tier, "
                    f"over its quota of {limit} bytes ({self.pin_share:.0%} of {budget}, "
                    "--tenant-pin-share); unpin or delete other sessions first",
                )


def _bytes_per_block(
    registry: EngineRegistry, tenant: str, sessions: list[SessionRow | str]
) -> dict[str, int]:
    """Bytes one block takes in each tier: from the engine's published tier gauges, else
    from the sessions' own tier usage (a fresh server before its first publish)."""
    stats = registry.stats()
    out: dict[str, int] = {}
    for tier in TIERS:
        blocks = stats.get(f'lgkv_tier_blocks{{tier="{tier}"}}', 0.0)
        nbytes = stats.get(f'lgkv_tier_bytes{{tier="{tier}"}}', 0.0)
        if blocks > 0:
            out[tier] = int(nbytes / blocks)
    for row in sessions:
        if all(tier in out for tier in TIERS):
            break
        usage = registry.tier_usage(tenant, row if isinstance(row, str) else row.id)
        for tier in TIERS:
            if tier not in out and usage[tier].blocks:
                out[tier] = usage[tier].bytes // usage[tier].blocks
    return out


class GenerationAdmission:
    """Whether a generation may name a session: past the tenant's :attr:`~TenantQuotas.
    max_sessions` only sessions that exist already. The tenant's count is read at most once a
    second (in a worker thread), so a generation under quota costs no registry call; a burst
    of generations naming new sessions may pass the quota by what arrives within that second.
    The session routes' own creates, copies and deletes refresh it (:meth:`forget`)."""

    REFRESH_S = 1.0

    def __init__(self, registry: EngineRegistry, quotas: TenantQuotas) -> None:
        self.registry = registry
        self.quotas = quotas
        self._counts: dict[str, tuple[int, float]] = {}

    def forget(self, tenant: str) -> None:
        """Read ``tenant``'s count afresh at its next generation (its sessions changed)."""
        self._counts.pop(tenant, None)

    async def admit(self, tenant: str, session_id: str) -> None:
        """Raise :class:`QuotaExceeded` (429) when ``session_id`` is new and ``tenant`` is at
        its session quota."""
        import asyncio
        import time

        known = self._counts.get(tenant)
        now = time.monotonic()
        if known is None or now - known[1] > self.REFRESH_S:
            count = await asyncio.to_thread(self.registry.count_sessions, tenant)
            if len(self._counts) > 100_000:
                self._counts.clear()
            self._counts[tenant] = known = (count, now)
        if known[0] < self.quotas.max_sessions:
            return
        if await asyncio.to_thread(self.registry.get_session, tenant, session_id) is None:
            self.quotas.check_new_session(self.registry, tenant)
