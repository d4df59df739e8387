"""Where the registry's two parts are composed: :func:`open_registry`.

Without a Redis URL the registry is the SQLite file in the cache folder
(:class:`server.kv.registry.Registry`: sessions and local state, one node). With one,
:class:`SharedRegistry` puts sessions in Redis (:class:`RedisSessions`, shared by every
replica of the namespace) and keeps this replica's block locations, counters and feed
positions in the SQLite file (:class:`Registry`'s local part). Both offer the same methods
(:class:`server.kv.registry.api.EngineRegistry`), so the engine's registry thread and the API
process do not care which one they hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from server.kv.registry.api import EngineRegistry
from server.kv.registry.redis import PURGE_BATCH, SNAPSHOT_CHUNK, RedisSessions
from server.kv.registry.sql import SessionRow, TierCount
from server.kv.registry.sqlite import Registry


def open_registry(
    path: Path,
    *,
    redis_url: str | None = None,
    namespace: str = "",
    busy_timeout_s: float = 30.0,
) -> EngineRegistry:
    """The registry of a replica: the SQLite file at ``path``, with sessions in Redis when
    ``redis_url`` is given (under ``namespace``). Opening touches no network."""
    local = Registry(path, busy_timeout_s=busy_timeout_s)
    if not redis_url:
        return local
    return SharedRegistry(RedisSessions(redis_url, namespace), local)


class SharedRegistry:
    """Sessions in Redis, local state in SQLite (see the module docstring)."""

    def __init__(self, sessions: RedisSessions, local: Registry) -> None:
        self.sessions = sessions
        self.local = local
        self._cursor_name = f"drops:{sessions.namespace}"

    # ------------------------------------------------------------- the local part

    def set_block_tiers(self, updates: dict[str, tuple[bool, bool, bool, int]]) -> None:
        """Publish where this replica holds blocks."""
        self.local.set_block_tiers(updates)

    def reset_block_tiers(self) -> None:
        """Forget this replica's published locations."""
        self.local.reset_block_tiers()

    def block_usage(self, keys: Iterable[str]) -> dict[str, TierCount]:
        """Blocks and bytes per tier of ``keys`` on this replica."""
        return self.local.block_usage(keys)

    def tier_usage(self, tenant: str, session_id: str) -> dict[str, TierCount]:
        """A session's blocks (from Redis) as this replica holds them (from SQLite)."""
        return self.local.block_usage(self.sessions.session_keys(tenant, session_id))

    def add_stats(self, counters: dict[str, float], gauges: dict[str, float]) -> None:
        """This engine's counters and gauges."""
        self.local.add_stats(counters, gauges)

    def stats(self) -> dict[str, float]:
        """This engine's counters and gauges (this replica's ``/metrics``)."""
        return self.local.stats()

    def get_cursor(self, name: str) -> str | None:
        """A saved feed position."""
        return self.local.get_cursor(name)

    def set_cursor(self, name: str, value: str) -> None:
        """Save a feed position."""
        self.local.set_cursor(name, value)

    def resume_drops(self) -> str:
        """Where this engine stopped reading the shared drops stream (saved locally), so the
        drops recorded while it was away are applied at start; the newest position when
        none is saved or the stream was trimmed past it."""
        saved = self.local.get_cursor(self._cursor_name)
        if saved is not None and self.sessions.drop_position_valid(saved):
            return saved
        return self.sessions.last_drop_seq()

    def drops_read(self, seq: str) -> None:
        """Save the drops position (after the engine took those drops)."""
        self.local.set_cursor(self._cursor_name, str(seq))

    # ----------------------------------------------------------- the session part

    def ping(self) -> None:
        """Raise :class:`RegistryUnavailable` when Redis does not answer."""
        self.sessions.ping()

    def data_version(self) -> int:
        """Changes whenever anyone wrote sessions or drops in the namespace."""
        return self.sessions.data_version()

    def get_session(self, tenant: str, session_id: str) -> SessionRow | None:
        """The session, from Redis."""
        return self.sessions.get_session(tenant, session_id)

    def list_sessions(
        self, tenant: str, limit: int, offset: int = 0, *, after: str | None = None
    ) -> list[SessionRow]:
        """A tenant's sessions, from Redis (a page after the cursor ``after``)."""
        return self.sessions.list_sessions(tenant, limit, offset, after=after)

    def count_sessions(self, tenant: str | None = None) -> int:
        """Sessions in the namespace, or of ``tenant``."""
        return self.sessions.count_sessions(tenant)

    def create_session(
        self, tenant: str, session_id: str, *, ttl_seconds: float | None, pinned: bool
    ) -> bool:
        """Create an empty session in Redis."""
        return self.sessions.create_session(
            tenant, session_id, ttl_seconds=ttl_seconds, pinned=pinned
        )

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
        """Change TTL and/or pin in Redis."""
        return self.sessions.update_session(
            tenant,
            session_id,
            set_ttl=set_ttl,
            ttl_seconds=ttl_seconds,
            pinned=pinned,
            pin_ttl_s=pin_ttl_s,
        )

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
        """Record a finished request in Redis."""
        self.sessions.record_turn(
            tenant, session_id, keys, num_tokens, default_ttl_s=default_ttl_s, now=now
        )

    def mark_managed(self, tenant: str, session_id: str) -> None:
        """Mark the session managed in Redis."""
        self.sessions.mark_managed(tenant, session_id)

    def pinned_sessions(self, tenant: str, now: float) -> list[SessionRow]:
        """The tenant's sessions pinned at ``now``, from Redis."""
        return self.sessions.pinned_sessions(tenant, now)

    def managed_sessions(self, tenant: str) -> list[SessionRow]:
        """The tenant's managed, unexpired sessions, from Redis."""
        return self.sessions.managed_sessions(tenant)

    def session_keys(self, tenant: str, session_id: str) -> list[str]:
        """The session's block keys, from Redis."""
        return self.sessions.session_keys(tenant, session_id)

    def delete_session(self, tenant: str, session_id: str) -> list[str] | None:
        """Delete in Redis; the freed keys go to the shared drops stream."""
        return self.sessions.delete_session(tenant, session_id)

    def copy_session(self, tenant: str, source: str, target: str, *, overwrite: bool) -> str:
        """Fork in Redis."""
        return self.sessions.copy_session(tenant, source, target, overwrite=overwrite)

    def purge_expired(self, now: float | None = None) -> list[str]:
        """Purge expired sessions in Redis (any replica may; each drop is recorded once)."""
        return self.sessions.purge_expired(now)

    def purge_expired_batch(
        self, now: float | None = None, *, limit: int = PURGE_BATCH
    ) -> tuple[list[str], bool]:
        """One bounded purge script in Redis: (freed keys, whether more is due)."""
        return self.sessions.purge_expired_batch(now, limit=limit)

    def policy_snapshot(self) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
        """Every session of the namespace."""
        return self.sessions.policy_snapshot()

    def iter_policy_snapshot(
        self, chunk: int = SNAPSHOT_CHUNK
    ) -> Iterator[tuple[list[SessionRow], list[tuple[str, str, str]]]]:
        """Every session of the namespace, in chunks."""
        return self.sessions.iter_policy_snapshot(chunk)

    def session_state(self, tenant: str, session_id: str) -> tuple[SessionRow | None, list[str]]:
        """Row and keys, from Redis."""
        return self.sessions.session_state(tenant, session_id)

    def change_seq(self) -> str:
        """The newest changes stream id."""
        return self.sessions.change_seq()

    def changes_after(self, seq: str) -> tuple[str, list[tuple[str, str]] | None]:
        """Sessions written after ``seq``."""
        return self.sessions.changes_after(seq)

    def add_drops(self, keys: Iterable[str]) -> None:
        """Record freed keys for every replica."""
        self.sessions.add_drops(keys)

    def drops_after(self, seq: str) -> tuple[str, list[str]]:
        """Drops after ``seq``."""
        return self.sessions.drops_after(seq)

    def last_drop_seq(self) -> str:
        """The newest drops stream id."""
        return self.sessions.last_drop_seq()

    def close(self) -> None:
        """Close both connections."""
        self.sessions.close()
        self.local.close()
