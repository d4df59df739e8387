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

import heapq
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
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


class _Refs:
    """What the policy keeps per block about its known sessions (O(1) to update)."""

    __slots__ = ("lease_heap", "leased", "managed", "owners", "pinned", "rep")

    def __init__(self) -> None:
        self.owners = 0
        """Known sessions that list the block."""
        self.managed = 0
        """Of them, managed ones."""
        self.pinned = 0
        """Of them, pinned without a lease."""
        self.leased: dict[SessionKey, float] | None = None
        """Of them, pinned with a lease: when each lease lapses."""
        self.lease_heap: list[tuple[float, SessionKey]] = []
        """(-lease end, session) of ``leased``, a heap; entries ``leased`` no longer holds
        are skipped when they reach the top (so the latest lease is O(1) amortized)."""
        self.rep: SessionKey | None = None
        """An owner whose lateness line stands for the block's (the last one noted)."""

    def latest_lease(self) -> float:
        """The latest lease end of the pinned owners with a lease (-inf: none)."""
        leased, heap = self.leased, self.lease_heap
        if not leased:
            heap.clear()
            return -math.inf
        while leased.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        return -heap[0][0]


Listener = Callable[[Iterable[str] | None], None]
"""Told the blocks whose outlook changed (None: every block)."""

SnapshotItem = tuple[SessionKey, SessionRow | None, list[str]]
"""One session of a snapshot: its key, its row (None: references without a row) and keys."""


def group_snapshot(
    sessions: list[SessionRow], refs: list[tuple[str, str, str]]
) -> dict[SessionKey, SnapshotItem]:
    """A snapshot chunk as one item per session (in order), its keys in order: the registry
    thread does this, so the scheduler thread takes the items one by one."""
    keys: dict[SessionKey, list[str]] = {(s.tenant, s.id): [] for s in sessions}
    for tenant, sid, key in refs:
        keys.setdefault((tenant, sid), []).append(key)
    rows = {(s.tenant, s.id): s for s in sessions}
    return {skey: (skey, rows.get(skey), got) for skey, got in keys.items()}


class _Stream:
    """A snapshot streaming in (:meth:`EvictionPolicy.begin_stream`)."""

    __slots__ = ("seen", "stale", "touched")

    def __init__(self, stale: list[SessionKey]) -> None:
        self.stale = stale
        """Sessions known when it began: those it does not list are forgotten at its end."""
        self.seen: set[SessionKey] = set()
        """Sessions it listed (kept only while ``stale`` is not empty)."""
        self.touched: set[SessionKey] = set()
        """Sessions changed meanwhile (turns, registry changes): newer than the snapshot."""


class EvictionPolicy:
    """Ranks blocks for eviction from the sessions that reference them.

    :meth:`order` ranks a list of candidates from scratch (the reference ranking, O(n log n)).
    The index keeps its tiers' candidates in :class:`~.eviction_order.EvictionOrder`s instead,
    which read :meth:`line_of` and are told by :attr:`listener` which blocks changed; both
    give the same victims in the same order.
    """

    def __init__(
        self, default_gap_s: float, min_gap_s: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.default_gap_s = default_gap_s
        self.min_gap_s = min_gap_s
        self.clock = clock
        """Unix time of a decision (tests replace it)."""
        self.listener: Listener | None = None
        self._sessions: dict[SessionKey, SessionOutlook] = {}
        self._refs: dict[str, set[SessionKey]] = defaultdict(set)
        self._blocks_of: dict[SessionKey, list[str]] = {}
        self._agg: dict[str, _Refs] = {}
        self._stream: _Stream | None = None

    def load(self, sessions: list[SessionRow], refs: list[tuple[str, str, str]]) -> None:
        """Replace the known state with a registry snapshot."""
        self._sessions = {(s.tenant, s.id): self._outlook(s) for s in sessions}
        self._refs = defaultdict(set)
        self._blocks_of = defaultdict(list, {skey: [] for skey in self._sessions})
        self._agg = {}
        for tenant, sid, key in refs:
            skey = (tenant, sid)
            self._blocks_of[skey].append(key)
            if skey not in self._refs[key]:
                self._refs[key].add(skey)
                known = self._sessions.get(skey)
                if known is not None:
                    self._add(key, skey, known)
        if self.listener is not None:
            self.listener(None)

    # A snapshot in steps: begin_stream, stream each item of its chunks, then sweep until it
    # returns True. Afterwards the policy is what ``load`` of the same snapshot gives, with
    # every change noted meanwhile (record, forget, note_turn) applied after it.

    def begin_stream(self) -> None:
        """A registry snapshot starts to stream in (the incremental form of :meth:`load`;
        O(sessions known) once, a list copy). Call it when its first chunk arrives: every
        change noted from then on is newer than its items. A snapshot that begins before the
        last one ended replaces it (the changes noted since that one began still count)."""
        touched = self._stream.touched if self._stream is not None else set()
        self._stream = _Stream(list(self._blocks_of))
        self._stream.touched = touched

    def stream(self, item: SnapshotItem) -> None:
        """Take one session of the streaming snapshot (O(its blocks), as :meth:`record`)."""
        skey, row, keys = item
        st = self._stream
        assert st is not None, "stream() before begin_stream()"
        if skey in st.touched:
            return  # changed since the snapshot was read: the newer state stays
        if st.stale:
            st.seen.add(skey)
        if row is not None:
            self._set(skey, self._outlook(row), keys)
            return
        self._set(skey, None, [])  # references without a session row: listed, never ranked
        self._blocks_of[skey] = list(keys)
        for key in keys:
            self._refs[key].add(skey)

    def sweep(self, limit: int) -> bool:
        """After the last item: forget up to ``limit`` sessions known before the snapshot that
        it does not list; True once none is left (the stream has ended)."""
        st = self._stream
        if st is None:
            return True
        while st.stale and limit > 0:
            skey = st.stale.pop()
            limit -= 1
            if skey not in st.seen and skey not in st.touched and skey in self._blocks_of:
                self._set(skey, None, [])
        if st.stale:
            return False
        self._stream = None
        return True

    def _touch(self, skey: SessionKey) -> None:
        if self._stream is not None:
            self._stream.touched.add(skey)

    def record(self, session: SessionRow, keys: list[str]) -> None:
        """Update one session after a turn (or a registry change)."""
        self._touch((session.tenant, session.id))
        self._set((session.tenant, session.id), self._outlook(session), keys)

    def forget(self, tenant: str, session_id: str) -> None:
        """Drop a session that is gone from the registry (deleted or expired)."""
        self._touch((tenant, session_id))
        self._set((tenant, session_id), None, [])

    def note_turn(self, tenant: str, session_id: str, keys: list[str], now: float) -> None:
        """A turn of the session just finished (before the registry has recorded it): its
        block list and last use, with the gap statistics known so far."""
        skey = (tenant, session_id)
        self._touch(skey)
        known = self._sessions.get(skey)
        gap = known.expected_gap_s if known else max(self.default_gap_s, self.min_gap_s)
        outlook = SessionOutlook(
            last_used_at=now,
            expected_gap_s=gap,
            pinned=known.pinned if known else False,
            managed=known.managed if known else False,
            pin_until=known.pin_until if known else None,
        )
        self._set(skey, outlook, keys)

    def keys_of(self, tenant: str, session_id: str) -> list[str]:
        """The session's block keys as the policy last learnt them."""
        return list(self._blocks_of.get((tenant, session_id), []))

    def is_managed(self, key: str) -> bool:
        """True if a managed session references the block."""
        agg = self._agg.get(key)
        return agg is not None and agg.managed > 0

    def is_referenced(self, key: str) -> bool:
        """True if a known session lists the block."""
        agg = self._agg.get(key)
        return agg is not None and agg.owners > 0

    def is_pinned(self, key: str, now: float | None = None) -> bool:
        """True if a session pinned at ``now`` (default: the current time) references it."""
        now = self.clock() if now is None else now
        return self.pin_end(key) > now

    def pin_end(self, key: str) -> float:
        """Until when the block is pinned: ``inf`` (a pin without lease), the latest lease of
        its pinned sessions, or ``-inf`` (not pinned)."""
        agg = self._agg.get(key)
        if agg is None:
            return -math.inf
        if agg.pinned:
            return math.inf
        return agg.latest_lease()

    def lateness(self, key: str, last_access: float, now: float | None = None) -> float:
        """How overdue the block's most promising session is (larger: evict sooner)."""
        now = self.clock() if now is None else now
        owners = [self._sessions[s] for s in self._refs.get(key, ()) if s in self._sessions]
        if not owners:
            return max(0.0, now - last_access) / self.default_gap_s
        return min(max(0.0, now - o.last_used_at) / o.expected_gap_s for o in owners)

    def line_of(self, key: str, last_access: float) -> tuple[float, float, bool]:
        """(start, gap, exact) of a line ``max(0, t - start) / gap`` that is the block's
        lateness at every ``t`` when ``exact`` (no session or one), else a bound above it
        (one owner's line: the block takes the smallest). O(1)."""
        agg = self._agg.get(key)
        if agg is None or agg.owners == 0:
            return last_access, self.default_gap_s, True
        rep, refs = agg.rep, self._refs[key]
        if rep is None or rep not in self._sessions or rep not in refs:
            rep = agg.rep = next(s for s in refs if s in self._sessions)
        o = self._sessions[rep]
        return o.last_used_at, o.expected_gap_s, agg.owners == 1

    def lowest_line(self, key: str, now: float) -> tuple[float, float]:
        """(start, gap) of the owner whose lateness at ``now`` is the block's (the smallest).
        O(owners): only for shared blocks that reach the front of an eviction order."""
        best: tuple[float, float, float] | None = None
        for s in self._refs.get(key, ()):
            o = self._sessions.get(s)
            if o is None:
                continue
            late = max(0.0, now - o.last_used_at) / o.expected_gap_s
            if best is None or late < best[0]:
                best = (late, o.last_used_at, o.expected_gap_s)
        assert best is not None, "lowest_line of a block no session lists"
        return best[1], best[2]

    def order(self, candidates: list[tuple[str, float]], *, allow_pinned: bool) -> list[str]:
        """Keys of ``candidates`` (key, last access) in eviction order, first victim first.

        Pinned blocks come last when ``allow_pinned`` and are left out otherwise. Among
        blocks of equal outlook (one session's), its tail goes first: the full blocks before
        it are worth more, and the tail is useless without them. The reference ranking:
        the index's :class:`~.eviction_order.EvictionOrder` gives the same victims."""
        now = self.clock()
        ranked: list[tuple[int, int, float, int, float, str]] = []
        for key, last_access in candidates:
            owners = [self._sessions[s] for s in self._refs.get(key, ()) if s in self._sessions]
            pinned = any(o.pinned_at(now) for o in owners)
            if pinned and not allow_pinned:
                continue
            lateness = self.lateness(key, last_access, now)
            whole = int(parse_tail_key(key) is None)
            managed = any(o.managed for o in owners)
            ranked.append((int(pinned), int(managed), -lateness, whole, last_access, key))
        ranked.sort()
        return [r[5] for r in ranked]

    # ----------------------------------------------------------------- helpers

    def _set(self, skey: SessionKey, outlook: SessionOutlook | None, keys: list[str]) -> None:
        """Replace one session's outlook and block list (None: forget it); O(its blocks)."""
        old_keys = self._blocks_of.pop(skey, [])
        old = self._sessions.pop(skey, None)
        for key in old_keys:
            refs = self._refs.get(key)
            if refs is None or skey not in refs:
                continue
            refs.discard(skey)
            if old is not None:
                self._sub(key, skey, old)
            if not refs:
                del self._refs[key]
        if outlook is not None:
            self._sessions[skey] = outlook
            self._blocks_of[skey] = list(keys)
            for key in keys:
                refs = self._refs[key]
                if skey not in refs:
                    refs.add(skey)
                    self._add(key, skey, outlook)
        if self.listener is not None:
            self.listener(dict.fromkeys([*old_keys, *keys]))

    def _add(self, key: str, skey: SessionKey, o: SessionOutlook) -> None:
        agg = self._agg.get(key)
        if agg is None:
            agg = self._agg[key] = _Refs()
        agg.owners += 1
        agg.managed += o.managed
        agg.rep = skey
        if o.pinned and o.pin_until is None:
            agg.pinned += 1
        elif o.pinned:
            agg.leased = agg.leased or {}
            agg.leased[skey] = o.pin_until
            heapq.heappush(agg.lease_heap, (-o.pin_until, skey))
            if len(agg.lease_heap) > 2 * len(agg.leased) + 8:
                agg.lease_heap = [(-end, s) for s, end in agg.leased.items()]
                heapq.heapify(agg.lease_heap)

    def _sub(self, key: str, skey: SessionKey, o: SessionOutlook) -> None:
        agg = self._agg[key]
        agg.owners -= 1
        agg.managed -= o.managed
        if o.pinned and o.pin_until is None:
            agg.pinned -= 1
        elif o.pinned and agg.leased is not None:
            agg.leased.pop(skey, None)
            agg.leased = agg.leased or None
        if agg.rep == skey:
            agg.rep = None
        if agg.owners == 0:
            del self._agg[key]

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
