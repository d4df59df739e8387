"""The session registry's two interfaces: the session part (shared) and the local part.

A registry serves two kinds of state:

- **Sessions** (:class:`SessionStore`): each session's row (tenant, tokens, turns, times, pin,
  TTL, gap statistics, managed flag) and ordered block list, and the two feeds the engines
  read as increments: ``changes`` (every session written) and ``drops`` (block keys freed by
  a delete or an expiry). With several replicas this part is shared (Redis:
  :class:`server.kv.registry.redis.RedisSessions`), so any replica answers for any session.
- **Local state** (:class:`LocalState`): where this replica holds each block (RAM, disk,
  Redis flags and bytes, read by ``tier_usage``) and this engine's counters and gauges
  (``/metrics``). Always the SQLite file in the replica's cache folder.

:class:`server.kv.registry.Registry` (SQLite) implements both and is the default;
:class:`server.kv.registry.shared.SharedRegistry` composes Redis sessions with the SQLite
local part. :func:`server.kv.registry.shared.open_registry` picks one.

Feed positions (:data:`Cursor`) are opaque to callers: SQLite row numbers, Redis stream ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from server.kv.registry.sql import SessionRow, TierCount

Cursor = int | str
"""A position in a feed (``changes`` or ``drops``): only compared by the store that gave it."""


SnapshotChunk = tuple[list[SessionRow], list[tuple[str, str, str]]]
"""Sessions and their (tenant, session id, key) references in block order."""


def join_snapshot(chunks: Iterable[SnapshotChunk]) -> SnapshotChunk:
    """The chunks of an ``iter_policy_snapshot``, joined (the whole snapshot at once)."""
    sessions: list[SessionRow] = []
    refs: list[tuple[str, str, str]] = []
    for rows, chunk_refs in chunks:
        sessions.extend(rows)
        refs.extend(chunk_refs)
    return sessions, refs


def purge_in_batches(
    purge_batch: Callable[[float], tuple[list[str], bool]], now: float
) -> list[str]:
    """Run ``purge_batch(now)`` (one bounded, short transaction) until nothing more is due;
    the keys it freed, sorted."""
    freed: set[str] = set()
    while True:
        keys, more = purge_batch(now)
        freed.update(keys)
        if not more:
            return sorted(freed)


class RegistryUnavailable(OSError):
    """The shared session registry (Redis) cannot be reached now. The session API answers
    HTTP 503 with this message; the engine's registry thread retries."""


class SessionStore(Protocol):
    """Sessions, their block lists, and the ``changes`` / ``drops`` feeds.

    Every write is atomic: a reader never sees half of it, and a delete and the drops it
    records land together. Methods raise :class:`RegistryUnavailable` when the store cannot
    be reached.
    """

    def ping(self) -> None:
        """Raise :class:`RegistryUnavailable` if the store cannot be reached (cheap)."""

    def get_session(self, tenant: str, session_id: str) -> SessionRow | None:
        """The session with its block count, or None if unknown (an expired one that is not
        purged yet is returned: readers check :attr:`SessionRow.expires_at`)."""

    def list_sessions(
        self, tenant: str, limit: int, offset: int = 0, *, after: str | None = None
    ) -> list[SessionRow]:
        """A tenant's sessions, most recently used first (ties by id, descending): up to
        ``limit`` of them, after the row the page cursor ``after`` names
        (:func:`server.kv.registry.page.session_cursor` of a page's last row; ValueError when
        malformed), skipping ``offset`` more. With a cursor a page costs O(log n + limit)
        whichever page it is; ``offset`` is kept for compatibility (its cost grows with it).
        Rows may be expired ones not purged yet."""

    def count_sessions(self, tenant: str | None = None) -> int:
        """Number of sessions of all tenants, or of ``tenant`` (kept counts: O(1))."""

    def create_session(
        self, tenant: str, session_id: str, *, ttl_seconds: float | None, pinned: bool
    ) -> bool:
        """Insert an empty managed session; False if it exists (an expired one counts as gone:
        it is deleted and its blocks recorded as drops).

        Every write treats a session past its TTL as missing, though the engine may not have
        purged it yet: update and copy answer as for an unknown session (an expired copy
        target is free: deleted, its freed blocks dropped), and a turn recorded for one
        starts it over as a new session."""

    def update_session(
        self,
        tenant: str,
        session_id: str,
        *,
        set_ttl: bool,
        ttl_seconds: float | None,
        pinned: bool | None,
        pin_ttl_s: float | None = None,
    ) -> bool:
        """Change TTL (when ``set_ttl``) and/or pin, mark managed; False if unknown or
        expired. A pin
        with ``pin_ttl_s`` is a lease: the session is pinned for that many seconds, then an
        ordinary session again (:meth:`purge_expired` clears lapsed leases; readers treat a
        lapsed lease as unpinned at once). Unpinning drops any lease."""

    def record_turn(
        self,
        tenant: str,
        session_id: str,
        keys: list[str],
        num_tokens: int,
        *,
        default_ttl_s: float | None,
        now: float | None = None,
    ) -> None:
        """Record a finished request: block list, tokens, turn count and gap statistics (a
        session expired by ``now`` starts over: turn 1, the default TTL, unpinned)."""

    def mark_managed(self, tenant: str, session_id: str) -> None:
        """Note that a client manages the session."""

    def pinned_sessions(self, tenant: str, now: float) -> list[SessionRow]:
        """The tenant's sessions pinned at ``now`` (not a lapsed lease, not expired; rows
        without block counts): O(the tenant's pins), for its pin quotas."""

    def managed_sessions(self, tenant: str) -> list[SessionRow]:
        """The tenant's managed sessions that have not expired (rows without block counts):
        O(the tenant's managed sessions)."""

    def session_keys(self, tenant: str, session_id: str) -> list[str]:
        """The session's block keys in prefix order."""

    def delete_session(self, tenant: str, session_id: str) -> list[str] | None:
        """Delete a session; record and return its keys no other session references (None:
        unknown)."""

    def copy_session(self, tenant: str, source: str, target: str, *, overwrite: bool) -> str:
        """Fork ``source`` into ``target``: "ok", "no_source" (unknown or expired) or
        "target_exists" (an expired target does not count)."""

    def purge_expired(self, now: float | None = None) -> list[str]:
        """Delete every expired session, record and return the freed keys; unpin sessions
        whose pin lease lapsed. Idempotent: two callers at once delete each session once and
        record its drops once. Runs :meth:`purge_expired_batch` until nothing is due, so no
        transaction or script is longer than one batch; with nothing due it costs a few
        index reads (no write lock)."""

    def purge_expired_batch(
        self, now: float | None = None, *, limit: int = ...
    ) -> tuple[list[str], bool]:
        """One bounded purge step (up to ``limit`` sessions, one short transaction or
        script): (the freed keys, whether more is due)."""

    def policy_snapshot(self) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
        """All sessions and all (tenant, session id, key) references (O(n): the chunks of
        :meth:`iter_policy_snapshot` joined)."""

    def iter_policy_snapshot(
        self, chunk: int = ...
    ) -> Iterator[tuple[list[SessionRow], list[tuple[str, str, str]]]]:
        """The snapshot in chunks of about ``chunk`` sessions, each with its sessions' block
        references in order; each chunk is one short read, so a consumer can take it in
        steps. Read :meth:`change_seq` first: sessions written while it streams come again
        in :meth:`changes_after` that position."""

    def session_state(self, tenant: str, session_id: str) -> tuple[SessionRow | None, list[str]]:
        """A session's row and block keys, read together."""

    def change_seq(self) -> Cursor:
        """The newest ``changes`` position."""

    def changes_after(self, seq: Cursor) -> tuple[Cursor, list[tuple[str, str]] | None]:
        """Sessions written after ``seq`` (distinct, in order of their last change), with the
        newest position; None instead of the list when entries after ``seq`` were trimmed
        (reload :meth:`policy_snapshot`)."""

    def add_drops(self, keys: Iterable[str]) -> None:
        """Record freed block keys."""

    def drops_after(self, seq: Cursor) -> tuple[Cursor, list[str]]:
        """Drops newer than ``seq``: (the newest position, their keys)."""

    def last_drop_seq(self) -> Cursor:
        """The newest ``drops`` position."""

    def data_version(self) -> int:
        """A number that changes when another connection writes (cheap change check)."""

    def close(self) -> None:
        """Close the connection (idempotent)."""


class LocalState(Protocol):
    """This replica's block locations and engine counters (never shared)."""

    def set_block_tiers(self, updates: dict[str, tuple[bool, bool, bool, int]]) -> None:
        """Publish where blocks are: key -> (in RAM, on disk, in Redis, bytes)."""

    def reset_block_tiers(self) -> None:
        """Forget all published locations."""

    def block_usage(self, keys: Iterable[str]) -> dict[str, TierCount]:
        """Blocks and bytes per tier of the distinct ``keys``."""

    def add_stats(self, counters: dict[str, float], gauges: dict[str, float]) -> None:
        """Add counter deltas and overwrite gauges."""

    def stats(self) -> dict[str, float]:
        """All stored counters and gauges."""

    def get_cursor(self, name: str) -> str | None:
        """A feed position saved by :meth:`set_cursor` (None: none)."""

    def set_cursor(self, name: str, value: str) -> None:
        """Save a feed position (the engine resumes the shared drops feed from it)."""


class EngineRegistry(SessionStore, LocalState, Protocol):
    """What the engine's registry thread and the API process use: both parts, plus where the
    engine resumes the drops feed after a restart."""

    def tier_usage(self, tenant: str, session_id: str) -> dict[str, TierCount]:
        """Blocks and bytes of a session's distinct blocks per tier, as this replica holds
        them."""

    def resume_drops(self) -> Cursor:
        """Where a starting engine reads the drops feed from."""

    def drops_read(self, seq: Cursor) -> None:
        """The engine applied the drops up to ``seq`` (saved where a restart resumes)."""
