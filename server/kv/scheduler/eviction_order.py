"""One tier's eviction candidates, kept in the policy's order as they change.

:class:`EvictionOrder` holds the blocks a tier may evict and yields them in exactly the order
:meth:`EvictionPolicy.order <server.kv.scheduler.policy.EvictionPolicy.order>` would rank
them at the time of the call, without ranking them all: each candidate is an entry of a
:class:`~.tournament.KineticTournament` keyed by ``(pinned, managed)``, its lateness line and
``(whole, last access, key)``. What moves the key, and what re-keys it (O(log n) each):

- the block's state (it enters or leaves the tier, its last access changes): the index calls
  :meth:`put` or :meth:`discard`;
- its sessions (a turn, a registry change, a pin, a session forgotten): the policy's listener,
  for the blocks of that session only;
- time: lateness lines cross (the tournament's certificates) and pin leases lapse (a deadline
  heap here, drained at each call).

A block one session lists (or none) has an exact line. A block several sessions list takes the
smallest of their latenesses; its entry carries one owner's line, an upper bound, and is
checked when it reaches the front: if another owner is less late at that time, the entry takes
that owner's line and goes back (O(owners), once per such correction). Blocks that may not
leave the tier while pinned (the disk tier's, and RAM blocks not on disk) wait outside the
tournament until their pin lapses. Time going backwards (a clock step) rebuilds the order.

The pin share (``--kv-pin-share``): at most ``pin_limit`` candidates rank as pinned (held:
parked, or ranked after every unpinned block). A block pinned past that ranks as an unpinned
one (its managed mark kept) and may be evicted like one, so pinned blocks as a whole never
take more than the share of the tier from unpinned sessions. It waits in FIFO order and is
held when a held block leaves, is unpinned or its lease lapses (O(log n) each); a smaller
limit (the disk budget cut) lets go of the newest held blocks. Without a limit, or below
it, the order is exactly the policy's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator

from server.kv.keys import parse_tail_key
from server.kv.scheduler.policy import EvictionPolicy
from server.kv.scheduler.tournament import KineticTournament, lateness


class Candidate:
    """One block in one tier's order."""

    __slots__ = (
        "exact",
        "gap",
        "keep_pinned",
        "key",
        "leaf",
        "pin_end",
        "queued",
        "rank",
        "start",
        "tail",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.rank: tuple[int, int] = (0, 0)
        """(pinned now, managed)."""
        self.start = 0.0
        self.gap = 1.0
        """The lateness line ``max(0, t - start) / gap``."""
        self.exact = True
        """The line is the block's lateness (False: an upper bound, see the module doc)."""
        self.tail: tuple[int, float, str] = (1, 0.0, key)
        """(whole block, last access, key): the tie-breakers."""
        self.pin_end = -math.inf
        self.keep_pinned = False
        """Wait outside the order while pinned."""
        self.leaf = -1
        """The tournament's leaf, -1 while outside it."""
        self.queued = -1
        """Its turn in the queue of blocks pinned past the pin limit (-1: not queued)."""


class EvictionOrder:
    """A tier's candidates in eviction order (see the module doc)."""

    def __init__(
        self, policy: EvictionPolicy, pin_limit: int | None = None, capacity: int = 1
    ) -> None:
        self.policy = policy
        self.now = policy.clock()
        """The time of the last call that ranked; changes between calls are ranked at it
        (it never goes back without a rebuild)."""
        self._kt = KineticTournament(capacity)
        self._members: dict[str, Candidate] = {}
        self._leases: list[tuple[float, str]] = []
        """(pin end, key) of pinned members whose pin lapses, lazily deleted."""
        self._pin_limit = pin_limit
        """Members that may rank as pinned at once (None: every pinned member)."""
        self._held: dict[str, Candidate] = {}
        """With a pin limit: the members ranked as pinned, oldest first."""
        self._queue: list[tuple[int, str]] = []
        """(turn, key) of members pinned past the limit, lazily deleted."""
        self._turns = 0

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, key: str) -> bool:
        return key in self._members

    @property
    def pinned_held(self) -> int:
        """Members ranked as pinned now (with a pin limit; tests and gauges)."""
        return len(self._held)

    def set_pin_limit(self, limit: int) -> None:
        """Change the pin limit of an order built with one (the tier's budget changed): past
        a smaller one the newest held blocks rank as unpinned; a larger one holds queued
        blocks. O(k log n) for the k blocks that change."""
        if self._pin_limit is None:
            raise ValueError("this order was built without a pin limit")
        self._pin_limit = limit
        while len(self._held) > limit:
            _, c = self._held.popitem()
            self._enqueue(c)
            self._rekey(c)
        self._fill()

    def put(self, key: str, last_access: float, *, keep_pinned: bool) -> None:
        """Add the block or re-key it from its current state and sessions. ``keep_pinned``:
        it may not be evicted while pinned. O(log n)."""
        c = self._members.get(key)
        if c is None:
            c = self._members[key] = Candidate(key)
            c.tail = (int(parse_tail_key(key) is None), last_access, key)
            self._describe(c, last_access, keep_pinned)
        else:
            before = (c.rank, c.start, c.gap, c.exact, c.tail, c.keep_pinned)
            self._describe(c, last_access, keep_pinned)
            if before == (c.rank, c.start, c.gap, c.exact, c.tail, c.keep_pinned):
                return
        self._place(c)
        self._fill()

    def discard(self, key: str) -> None:
        """Forget the block (it left the tier). O(log n)."""
        c = self._members.pop(key, None)
        if c is None:
            return
        if c.leaf != -1:
            self._kt.remove(c, self.now)
        c.queued = -1
        if self._held.pop(key, None) is not None:
            self._fill()

    def keys(self) -> list[str]:
        """Every candidate's key (tests and rebuilds)."""
        return list(self._members)

    def victims(
        self,
        now: float,
        protect: set[str],
        *,
        allow_pinned: bool,
        valid: Callable[[str], bool] | None = None,
    ) -> Iterator[str]:
        """Candidates in the policy's order at ``now``, first victim first, leaving out
        ``protect`` (and pinned blocks unless ``allow_pinned``). The caller evicts each key
        it is given (which takes it out) before asking for the next; a candidate ``valid``
        rejects is dropped (its state changed outside the index). Use it in a ``with
        contextlib.closing(...)`` or run it to the end: skipped entries go back on close."""
        self._advance(now)
        held: list[Candidate] = []
        try:
            while True:
                c = self._kt.top()
                if c is None or (c.rank[0] and not allow_pinned):
                    return
                if not c.exact and self._tighten(c, now):
                    continue
                if valid is not None and not valid(c.key):
                    self.discard(c.key)
                    continue
                if c.key in protect:
                    self._kt.remove(c, now)
                    held.append(c)
                    continue
                yield c.key
                if self._members.get(c.key) is c and c.leaf != -1:
                    self._kt.remove(c, now)  # not evicted after all: keep it out of this run
                    held.append(c)
        finally:
            for c in held:
                if self._members.get(c.key) is c and c.leaf == -1:
                    self._place(c)

    # ----------------------------------------------------------------- helpers

    def _describe(self, c: Candidate, last_access: float, keep_pinned: bool) -> None:
        policy = self.policy
        c.start, c.gap, c.exact = policy.line_of(c.key, last_access)
        c.tail = (c.tail[0], last_access, c.key)
        c.keep_pinned = keep_pinned
        c.pin_end = policy.pin_end(c.key)
        pinned = c.pin_end > self.now and self._hold(c)
        if c.pin_end <= self.now:
            self._unhold(c)
        c.rank = (int(pinned), int(policy.is_managed(c.key)))
        if c.rank[0] and c.pin_end != math.inf:
            heapq.heappush(self._leases, (c.pin_end, c.key))

    def _hold(self, c: Candidate) -> bool:
        """Whether pinned ``c`` ranks as pinned (held); past the pin limit it is queued."""
        if self._pin_limit is None or c.key in self._held:
            return True
        if len(self._held) < self._pin_limit:
            self._held[c.key] = c
            c.queued = -1
            return True
        if c.queued == -1:
            self._enqueue(c)
        return False

    def _enqueue(self, c: Candidate) -> None:
        self._turns += 1
        c.queued = self._turns
        heapq.heappush(self._queue, (c.queued, c.key))
        if len(self._queue) > 2 * len(self._members) + 64:  # drop stale entries (amortized)
            self._queue = [(q, k) for q, k in self._queue if self._members.get(k) is not None]
            self._queue = [(q, k) for q, k in self._queue if self._members[k].queued == q]
            heapq.heapify(self._queue)

    def _unhold(self, c: Candidate) -> None:
        """``c`` is not pinned (any more)."""
        c.queued = -1
        self._held.pop(c.key, None)

    def _rekey(self, c: Candidate) -> None:
        """Re-rank ``c`` from its state (its pin may have moved between held and queued)."""
        self._describe(c, c.tail[1], c.keep_pinned)
        self._place(c)

    def _fill(self) -> None:
        """Hold queued pinned blocks while there is room under the pin limit."""
        limit = self._pin_limit
        while limit is not None and len(self._held) < limit and self._queue:
            turn, key = heapq.heappop(self._queue)
            c = self._members.get(key)
            if c is None or c.queued != turn:
                continue  # left, unpinned or held since
            c.queued = -1
            self._rekey(c)  # held now if it is still pinned

    def _place(self, c: Candidate) -> None:
        """Put ``c`` in the tournament, or outside it while it must stay pinned."""
        parked = bool(c.rank[0]) and c.keep_pinned
        if parked and c.leaf != -1:
            self._kt.remove(c, self.now)
        elif not parked and c.leaf == -1:
            self._kt.insert(c, self.now)
        elif not parked:
            self._kt.update(c, self.now)

    def _tighten(self, c: Candidate, now: float) -> bool:
        """Check a shared block's bound line at ``now``; True if it was re-keyed."""
        start, gap = self.policy.lowest_line(c.key, now)
        if max(0.0, now - start) / gap == lateness(c, now):
            return False
        c.start, c.gap = start, gap
        self._kt.update(c, now)
        return True

    def _advance(self, now: float) -> None:
        if now < self.now:  # the clock stepped back: rank everything again at ``now``
            self.now = now
            self._leases = []
            members = list(self._members.values())
            for c in members:
                self._describe(c, c.tail[1], c.keep_pinned)
            self._kt.rebuild([c for c in members if not (c.rank[0] and c.keep_pinned)], now)
            for c in members:
                if c.rank[0] and c.keep_pinned:
                    c.leaf = -1
            self._fill()
            return
        self.now = now
        leases = self._leases
        while leases and leases[0][0] <= now:
            end, key = heapq.heappop(leases)
            c = self._members.get(key)
            if c is not None and c.pin_end == end and c.rank[0]:
                self._describe(c, c.tail[1], c.keep_pinned)
                self._place(c)
        self._fill()
        self._kt.advance(now)
