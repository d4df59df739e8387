"""A kinetic tournament: the first of a set of entries whose rank moves with time.

Each entry's rank at time ``t`` is ``(rank, -lateness(t), tail)`` (smallest first), where
``lateness(t) = max(0, t - start) / gap`` is the eviction policy's line (see
:mod:`server.kv.scheduler.policy`) and ``rank`` and ``tail`` do not move. Lines of different
gaps cross, so a static heap cannot keep them in order; a kinetic tournament can, while time
only moves forward: a complete binary tree whose every node holds the winner of its two
children *and the time until which that comparison certainly holds* (its certificate). A
query at time ``t`` first recomputes the nodes whose certificate ran out before ``t`` (and
their ancestors, while the winner changes), then reads the root. Inserting, removing or
re-keying an entry recomputes one leaf-to-root path: O(log n). Each certificate failure costs
O(log n) once; two lines cross at most once, so over a stretch of time with no updates a
tournament of n lines sees O(n log n) failures in all, far fewer than there are queries in
practice.

Comparisons use exactly the floating-point expressions of
:meth:`server.kv.scheduler.policy.EvictionPolicy.order`, so a query's answer is that method's
first key, not an approximation. Certificates are computed conservatively (they end a little
*before* two lines could compare differently under rounding): an early end costs one extra
recomputation, never a wrong order.
"""

from __future__ import annotations

import heapq
import math
from typing import Protocol

INF = math.inf
_EPS = 2.0**-52
_MARGIN = 64 * _EPS
"""Relative gap two latenesses must keep for their float comparison to be certain."""


class Entry(Protocol):
    """What the tournament reads of an entry (:class:`~.eviction_order.Candidate`)."""

    rank: tuple[int, int]
    start: float
    gap: float
    tail: tuple[int, float, str]
    leaf: int


def lateness(e: Entry, t: float) -> float:
    """The entry's lateness at ``t``, computed as the policy computes it."""
    return max(0.0, t - e.start) / e.gap


def first(a: Entry, b: Entry, t: float) -> bool:
    """True if ``a`` ranks before ``b`` at time ``t`` (ties broken as the policy does)."""
    if a.rank != b.rank:
        return a.rank < b.rank
    la, lb = lateness(a, t), lateness(b, t)
    if la != lb:
        return la > lb
    return a.tail < b.tail


def holds_until(w: Entry, o: Entry, t: float) -> float:
    """A time up to which (inclusive) ``w``, first at ``t``, certainly stays before ``o``."""
    if w.rank != o.rank or (w.start == o.start and w.gap == o.gap):
        return INF  # nothing moves between them
    lw, lo = w.start, o.start
    if w.gap == o.gap and lw <= lo and w.tail < o.tail:
        return INF  # parallel, w never behind (float subtraction and division are monotone)
    s = t
    if s <= lw and s <= lo:  # both at 0: the tail decides until one starts to rise
        if lo < lw:
            return lo
        s = lo  # w rises first (or both at once): both rise from ``lo`` on
    elif s <= lw:  # o rises, w is still 0: w cannot be first (ranked by a stale call)
        return t
    elif s <= lo:  # w rises, o is 0 until lo
        s = lo
    # Both rise from s on: w stays first while fw(1 - m) > fo(1 + m), a line in time.
    fw, fo = (s - lw) / w.gap, (s - lo) / o.gap
    g = fw * (1 - _MARGIN) - fo * (1 + _MARGIN)
    if g <= 0:
        return s
    slope = (1 - _MARGIN) / w.gap - (1 + _MARGIN) / o.gap
    if slope >= 0:
        return INF
    span = g / -slope
    return max(s, s + span - 4 * _EPS * (abs(s) + span))


MAX_PRESIZE = 1 << 20
"""The largest tree built ahead of its entries (past it, the tree doubles as it fills)."""


class KineticTournament:
    """Entries ranked at a time that only moves forward; O(log n) per change and event."""

    def __init__(self, capacity: int = 1) -> None:
        """``capacity``: the entries expected (a tier's budget in blocks), so that the tree is
        built at its size once, empty, rather than rebuilt (every node recomputed, about 3 s
        at 2^20 entries) each time the population passes a power of two."""
        cap = 1 << max(0, min(int(capacity), MAX_PRESIZE) - 1).bit_length()
        self._cap = cap
        self._win: list[Entry | None] = [None] * (2 * cap)
        """Node -> winner of its subtree (leaves at ``cap .. 2 cap - 1``, root at 1)."""
        self._ver: list[int] = [0] * (2 * cap)
        self._until: list[float] = [INF] * (2 * cap)
        self._events: list[tuple[float, int, int]] = []
        """(certificate end, node, node version): lazy, stale versions are skipped."""
        self._free: list[int] = [cap + i for i in range(cap - 1, -1, -1)]
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def top(self) -> Entry | None:
        """The first entry at the time of the last :meth:`advance` (or change)."""
        return self._win[1]

    def insert(self, e: Entry, now: float) -> None:
        """Add ``e`` (its ``leaf`` must be -1)."""
        if not self._free:
            self._grow(now)
        leaf = self._free.pop()
        self._win[leaf] = e
        e.leaf = leaf
        self.size += 1
        self._fix(leaf // 2, now, e)

    def remove(self, e: Entry, now: float) -> None:
        """Take ``e`` out (``leaf`` becomes -1)."""
        leaf = e.leaf
        self._win[leaf] = None
        self._free.append(leaf)
        e.leaf = -1
        self.size -= 1
        self._fix(leaf // 2, now, e)

    def update(self, e: Entry, now: float) -> None:
        """``e``'s rank, line or tail changed: put it in its place."""
        self._fix(e.leaf // 2, now, e)

    def advance(self, now: float) -> None:
        """Recompute every comparison whose certificate ended before ``now``."""
        events = self._events
        while events and events[0][0] < now:
            _, node, ver = heapq.heappop(events)
            if ver == self._ver[node]:
                self._fix(node, now, None)
        if len(events) > 4 * self._cap + 64:
            self._compact()

    def entries(self) -> list[Entry]:
        """Every entry (for rebuilds)."""
        return [e for e in self._win[self._cap :] if e is not None]

    def rebuild(self, entries: list[Entry], now: float) -> None:
        """Start over with ``entries`` ranked at ``now`` (time went backwards)."""
        cap = self._cap  # never below the size it was built for
        while cap < len(entries):
            cap *= 2
        self._reset(cap)
        for i, e in enumerate(entries):
            self._win[cap + i] = e
            e.leaf = cap + i
        self._free = list(range(2 * cap - 1, cap + len(entries) - 1, -1))
        self.size = len(entries)
        for node in range(cap - 1, 0, -1):
            self._compute(node, now)

    # ----------------------------------------------------------------- helpers

    def _reset(self, cap: int) -> None:
        self._cap = cap
        self._win = [None] * (2 * cap)
        self._ver = [0] * (2 * cap)
        self._until = [INF] * (2 * cap)
        self._events = []

    def _grow(self, now: float) -> None:
        old, cap = self._win, self._cap
        self._reset(2 * cap)
        for i in range(cap):
            e = old[cap + i]
            self._win[2 * cap + i] = e
            if e is not None:
                e.leaf = 2 * cap + i
        self._free = [2 * cap + i for i in range(2 * cap - 1, cap - 1, -1)]
        self._free += [2 * cap + i for i in range(cap) if old[cap + i] is None]
        for node in range(2 * cap - 1, 0, -1):
            self._compute(node, now)

    def _compact(self) -> None:
        self._events = [
            (u, n, self._ver[n]) for n, u in enumerate(self._until[: self._cap]) if u != INF
        ]
        heapq.heapify(self._events)

    def _compute(self, node: int, now: float) -> None:
        """Recompute ``node``'s winner and certificate from its children."""
        a, b = self._win[2 * node], self._win[2 * node + 1]
        self._ver[node] += 1
        if a is None or b is None:
            self._win[node] = a if b is None else b
            self._until[node] = INF
            return
        w, o = (a, b) if first(a, b, now) else (b, a)
        self._win[node] = w
        until = holds_until(w, o, now)
        self._until[node] = until
        if until != INF:
            heapq.heappush(self._events, (until, node, self._ver[node]))

    def _fix(self, node: int, now: float, changed: Entry | None) -> None:
        """Recompute ``node`` and its ancestors while their winner changes (or is
        ``changed``, whose key moved)."""
        win = self._win
        while node >= 1:
            before = win[node]
            self._compute(node, now)
            after = win[node]
            if after is before and after is not changed and before is not changed:
                return
            node //= 2
