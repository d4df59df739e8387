"""Session-aware eviction order: who goes first when a tier is full.

Each block inherits the outlook of the sessions that reference it. A session's *lateness* is
``idle / expected_gap``: the time since its last turn divided by its own mean turn gap
(``default_gap_s`` before it has two turns; never less than ``min_gap_s``). A session well
past its usual gap is unlikely to come back soon and goes first; one used a moment ago that
usually returns within its gap stays. A block shared by several sessions takes the most
favourable (smallest) lateness. Blocks no session references (content-only reuse) use their
own last access and the default gap. Pinned sessions' blocks are never evicted from disk and
leave RAM last (and only for disk: a pinned block not yet on disk stays in RAM). A pin with a
lease (``pin_until``) pins until that time, checked at each decision.

Sessions a client manages through the session API (a checkpointer registers its threads,
prefetches them on resume, forks them) are live conversations with an owner that will come
back: their blocks go only after every block of unmanaged sessions and of no session, and their
expected gap is at least a tenth of their TTL, so a thread within its TTL stays "expected".
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from server.kv.keys import parse_tail_key
from server.kv.registry.sql import SessionRow

SessionKey = tuple[str, str]
"""(tenant, session id)."""


@dataclass
class SessionOutlook:
    """What the policy knows about one session."""

    last_used_at: float
    """Unix time of the session's last finished turn."""
    expected_gap_s: float
    """Mean seconds between the session's turns (or the default)."""
    pinned: bool
    """Pinned sessions are kept."""
    managed: bool = False
    """Managed through the session API (see the module doc)."""
    pin_until: float | None = None
    """When the pin's lease lapses (unix seconds); None: no lease."""

    def pinned_at(self, now: float) -> bool:
        """Pinned, and its lease (if any) not lapsed at ``now``."""
        return self.pinned and (self.pin_until is None or self.pin_until > now)


class EvictionPolicy:
    """Ranks blocks for eviction from the sessions that reference them."""

    def __init__(self, default_gap_s: float, min_gap_s: float) -> None:
        self.default_gap_s = default_gap_s
        self.min_gap_s = min_gap_s
        self._sessions: dict[SessionKey, SessionOutlook] = {}
        self._refs: dict[str, set[SessionKey]] = defaultdict(set)
        self._blocks_of: dict[SessionKey, list[str]] = {}

    def load(self, sessions: list[SessionRow], refs: list[tuple[str, str, str]]) -> None:
        """Replace the known state with a registry snapshot."""
        self._sessions = {(s.tenant, s.id): self._outlook(s) for s in sessions}
        self._refs = defaultdict(set)
        self._blocks_of = defaultdict(list)
        for tenant, sid, key in refs:
            self._refs[key].add((tenant, sid))
            self._blocks_of[(tenant, sid)].append(key)

    def record(self, session: SessionRow, keys: list[str]) -> None:
        """Update one session after a turn (or a registry change)."""
        skey = (session.tenant, session.id)
        for old in self._blocks_of.get(skey, []):
            self._refs[old].discard(skey)
        self._sessions[skey] = self._outlook(session)
        self._blocks_of[skey] = list(keys)
        for key in keys:
            self._refs[key].add(skey)

    def forget(self, tenant: str, session_id: str) -> None:
        """Drop a session that is gone from the registry (deleted or expired)."""
        skey = (tenant, session_id)
        for old in self._blocks_of.pop(skey, []):
            self._refs[old].discard(skey)
        self._sessions.pop(skey, None)

    def note_turn(self, tenant: str, session_id: str, keys: list[str], now: float) -> None:
        """A turn of the session just finished (before the registry has recorded it): its
        block list and last use, with the gap statistics known so far."""
        skey = (tenant, session_id)
        for old in self._blocks_of.get(skey, []):
            self._refs[old].discard(skey)
        known = self._sessions.get(skey)
        gap = known.expected_gap_s if known else max(self.default_gap_s, self.min_gap_s)
        self._sessions[skey] = SessionOutlook(
            last_used_at=now,
            expected_gap_s=gap,
            pinned=known.pinned if known else False,
            managed=known.managed if known else False,
            pin_until=known.pin_until if known else None,
        )
        self._blocks_of[skey] = list(keys)
        for key in keys:
            self._refs[key].add(skey)

    def keys_of(self, tenant: str, session_id: str) -> list[str]:
        """The session's block keys as the policy last learnt them."""
        return list(self._blocks_of.get((tenant, session_id), []))

    def is_managed(self, key: str) -> bool:
        """True if a managed session references the block."""
        return any(
            self._sessions[s].managed for s in self._refs.get(key, ()) if s in self._sessions
        )

    def is_referenced(self, key: str) -> bool:
        """True if a known session lists the block."""
        return any(s in self._sessions for s in self._refs.get(key, ()))

    def is_pinned(self, key: str, now: float | None = None) -> bool:
        """True if a session pinned at ``now`` (default: the current time) references it."""
        now = time.time() if now is None else now
        return any(
            self._sessions[s].pinned_at(now) for s in self._refs.get(key, ()) if s in self._sessions
        )

    def lateness(self, key: str, last_access: float, now: float | None = None) -> float:
        """How overdue the block's most promising session is (larger: evict sooner)."""
        now = time.time() if now is None else now
        owners = [self._sessions[s] for s in self._refs.get(key, ()) if s in self._sessions]
        if not owners:
            return max(0.0, now - last_access) / self.default_gap_s
        return min(max(0.0, now - o.last_used_at) / o.expected_gap_s for o in owners)

    def order(self, candidates: list[tuple[str, float]], *, allow_pinned: bool) -> list[str]:
        """Keys of ``candidates`` (key, last access) in eviction order, first victim first.

        Pinned blocks come last when ``allow_pinned`` and are left out otherwise. Among
        blocks of equal outlook (one session's), its tail goes first: the full blocks before
        it are worth more, and the tail is useless without them."""
        now = time.time()
        ranked: list[tuple[int, int, float, int, float, str]] = []
        for key, last_access in candidates:
            pinned = self.is_pinned(key, now)
            if pinned and not allow_pinned:
                continue
            lateness = self.lateness(key, last_access, now)
            whole = int(parse_tail_key(key) is None)
            ranked.append(
                (int(pinned), int(self.is_managed(key)), -lateness, whole, last_access, key)
            )
        ranked.sort()
        return [r[5] for r in ranked]

    def _outlook(self, s: SessionRow) -> SessionOutlook:
        gap = max(s.gap_mean if s.gap_count > 0 else self.default_gap_s, self.min_gap_s)
        if s.managed and s.ttl_seconds:
            gap = max(gap, s.ttl_seconds / 10)
        return SessionOutlook(
            last_used_at=s.last_used_at,
            expected_gap_s=gap,
            pinned=s.pinned,
            managed=s.managed,
            pin_until=s.pin_until,
        )
