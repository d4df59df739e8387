"""Sessions in Redis: the shared part of the registry when ``--kv-redis-url`` is set.

:class:`RedisSessions` implements :class:`server.kv.registry.api.SessionStore` over the key
layout of :mod:`server.kv.registry.lua`: every write is one Lua script (atomic, so several
replicas and API processes may write at once), every multi-key read one MULTI/EXEC. Keys sit
under ``lgkv:reg:{<namespace>}:``; replicas that serve the same model under the same name
share a namespace (:func:`server.connector_config.redis_namespace`), other models and test runs use
their own.

The feeds are Redis Streams, not pub/sub: an entry stays until the stream is trimmed (to about
:data:`server.kv.registry.sql.DROPS_KEPT` entries), so an engine that was away for a while
(a network blip, a restart: it saves its drops position locally) reads what it missed. A
reader that fell behind the trimmed part reloads the whole snapshot (changes) or logs that it
missed drops (their blocks then leave its tiers by eviction).

A Redis that is down, loading or timing out raises :class:`RegistryUnavailable` (an
``OSError``): HTTP 503 in the API process, a retried job on the engine's registry thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from server.kv.registry import lua
from server.kv.registry.api import RegistryUnavailable, join_snapshot, purge_in_batches
from server.kv.registry.page import parse_session_cursor
from server.kv.registry.redis_feeds import RedisFeeds
from server.kv.registry.sql import DROPS_KEPT, SessionRow

T = TypeVar("T")
SEP = "\x1f"
"""Between tenant and session id in key names (never in a session id; see the contract)."""
PURGE_BATCH = 100
"""Most sessions one purge script deletes (and leases it lifts): Redis runs nothing else
meanwhile, so a backlog of expired sessions goes in many short scripts, never one long one."""
SNAPSHOT_CHUNK = 10_000
"""About how many sessions one chunk of :meth:`RedisSessions.iter_policy_snapshot` holds."""


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _expired(row: SessionRow, now: float) -> bool:
    return row.expires_at is not None and row.expires_at < now


class RedisSessions(RedisFeeds):
    """Sessions, block lists and the changes/drops streams of one namespace in Redis."""

    def __init__(self, url: str, namespace: str, *, timeout_s: float = 2.0) -> None:
        import redis

        if not namespace:
            raise ValueError("the Redis session registry needs a namespace")
        self.url = url
        self.namespace = namespace
        self.prefix = f"lgkv:reg:{{{namespace}}}:"
        self._flags_indexed = False
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self._down = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.BusyLoadingError,
            OSError,
        )
        self._scripts = {
            name: self._client.register_script(getattr(lua, name))
            for name in (
                "CREATE", "UPDATE", "MARK_MANAGED", "RECORD_TURN", "DELETE", "COPY", "PURGE",
                "ADD_DROPS",
            )
        }  # fmt: skip

    # ------------------------------------------------------------------ plumbing

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._down as exc:
            raise RegistryUnavailable(
                f"the session registry in Redis ({self.url}) is unreachable: {exc}; "
                "retry when Redis is back"
            ) from exc

    def _run(self, script: str, *args: object) -> Any:
        argv = [self.prefix, DROPS_KEPT, *args]
        return self._call(lambda: self._scripts[script](keys=[], args=argv))

    def _member(self, tenant: str, session_id: str) -> str:
        return f"{tenant}{SEP}{session_id}"

    def _rows(self, members: list[tuple[str, str]], *, keys: bool) -> list[tuple[Any, Any]]:
        """(row hash, block count or list) of each member, read in one transaction."""
        out: list[tuple[Any, Any]] = []
        for i in range(0, len(members), 500):
            chunk = members[i : i + 500]

            def read(chunk: list[tuple[str, str]] = chunk) -> list[Any]:
                pipe = self._client.pipeline(transaction=True)
                for tenant, sid in chunk:
                    m = self._member(tenant, sid)
                    pipe.hgetall(self.prefix + "s:" + m)
                    if keys:
                        pipe.lrange(self.prefix + "b:" + m, 0, -1)
                    else:
                        pipe.llen(self.prefix + "b:" + m)
                return pipe.execute()

            got = self._call(read)
            out.extend(zip(got[0::2], got[1::2], strict=True))
        return out

    @staticmethod
    def _row(tenant: str, session_id: str, h: dict[str, str], num_blocks: int) -> SessionRow:
        ttl = h.get("ttl")
        return SessionRow(
            tenant=tenant,
            id=session_id,
            num_tokens=int(h["num_tokens"]),
            turns=int(h["turns"]),
            created_at=float(h["created_at"]),
            last_used_at=float(h["last_used_at"]),
            pinned=h.get("pinned") == "1",
            ttl_seconds=None if ttl in (None, "") else float(ttl),
            gap_count=int(h.get("gap_count", 0)),
            gap_mean=float(h.get("gap_mean", 0)),
            managed=h.get("managed") == "1",
            pin_until=None if h.get("pin_until") in (None, "") else float(h["pin_until"]),
            num_blocks=num_blocks,
        )

    # ------------------------------------------------------------------ reads

    def ping(self) -> None:
        """Raise :class:`RegistryUnavailable` if Redis does not answer."""
        self._call(self._client.ping)

    def data_version(self) -> int:
        """The namespace's write counter."""
        return int(self._call(lambda: self._client.get(self.prefix + "ver")) or 0)

    def get_session(self, tenant: str, session_id: str) -> SessionRow | None:
        """The session with its block count, or None."""
        ((h, n),) = self._rows([(tenant, session_id)], keys=False)
        return self._row(tenant, session_id, h, int(n)) if h else None

    def list_sessions(
        self, tenant: str, limit: int, offset: int = 0, *, after: str | None = None
    ) -> list[SessionRow]:
        """A tenant's sessions, most recently used first (ties by id, descending): ``limit``
        of them after the row the cursor ``after`` names, skipping ``offset`` more. Rank
        reads of the tenant's zset: O(log n) to find the page, whichever page."""
        key = self.prefix + "t:" + tenant
        if limit <= 0:
            return []
        if after is None:
            ids = self._call(lambda: self._client.zrevrange(key, offset, offset + limit - 1))
        else:
            ids = self._page_after(key, parse_session_cursor(after), limit, offset)
        rows = self._rows([(tenant, sid) for sid in ids], keys=False)
        pairs = zip(ids, rows, strict=True)
        return [self._row(tenant, sid, h, int(n)) for sid, (h, n) in pairs if h]

    def _page_after(
        self, key: str, cursor: tuple[float, str], limit: int, offset: int
    ) -> list[str]:
        """Ids after (last used at, id) in the zset's reverse order: from the rank of the
        first entry not newer than it (ZCOUNT), past the ties at or before its id."""
        last, sid = cursor
        pos = int(self._call(lambda: self._client.zcount(key, f"({last!r}", "+inf")))
        out: list[str] = []
        skip = offset
        while len(out) < limit:
            want = limit - len(out) + skip + 16
            got = self._call(
                lambda p=pos, w=want: self._client.zrevrange(key, p, p + w - 1, withscores=True)
            )
            for member, score in got:
                if score == last and member >= sid:
                    continue  # at the cursor's time, not after its id: on an earlier page
                if skip:
                    skip -= 1
                    continue
                out.append(member)
                if len(out) == limit:
                    break
            if len(got) < want:
                break
            pos += len(got)
        return out

    def count_sessions(self, tenant: str | None = None) -> int:
        """Sessions of every tenant in the namespace, or of ``tenant`` (set sizes: O(1))."""
        if tenant is None:
            return int(self._call(lambda: self._client.scard(self.prefix + "all")))
        return int(self._call(lambda: self._client.zcard(self.prefix + "t:" + tenant)))

    def pinned_sessions(self, tenant: str, now: float) -> list[SessionRow]:
        """The tenant's sessions pinned at ``now`` (a lapsed lease or an expired session is
        not), from its pin set: O(its pins)."""
        rows = self._flagged(tenant, "pin")
        return [r for r in rows if r.pinned_at(now) and not _expired(r, now)]

    def managed_sessions(self, tenant: str) -> list[SessionRow]:
        """The tenant's managed sessions that have not expired: O(its managed sessions)."""
        now = time.time()
        return [r for r in self._flagged(tenant, "mgd") if r.managed and not _expired(r, now)]

    def _flagged(self, tenant: str, flag: str) -> list[SessionRow]:
        self._index_flags()
        key = f"{self.prefix}{flag}:{tenant}"
        ids = sorted(self._call(lambda: set(self._client.sscan_iter(key, count=1000))))
        rows = self._rows([(tenant, sid) for sid in ids], keys=False)
        return [
            self._row(tenant, sid, h, int(n)) for sid, (h, n) in zip(ids, rows, strict=True) if h
        ]

    def _index_flags(self) -> None:
        """Once per namespace written by older versions: put its pinned and managed sessions
        into the per-tenant sets the scripts keep since (SSCAN in chunks; idempotent)."""
        if self._flags_indexed:
            return
        if int(self._call(lambda: self._client.get(self.prefix + "layout")) or 0) < 2:
            cursor: int = 0
            while True:
                cursor, members = self._call(
                    lambda c=cursor: self._client.sscan(self.prefix + "all", c, count=1000)
                )
                pairs = [tuple(m.split(SEP, 1)) for m in members]
                for (tenant, sid), (h, _) in zip(pairs, self._rows(pairs, keys=False), strict=True):
                    for flag, field in (("pin", "pinned"), ("mgd", "managed")):
                        if h.get(field) == "1":
                            self._call(
                                lambda f=flag, t=tenant, s=sid: self._client.sadd(
                                    f"{self.prefix}{f}:{t}", s
                                )
                            )
                if int(cursor) == 0:
                    break
            self._call(lambda: self._client.set(self.prefix + "layout", 2))
        self._flags_indexed = True

    def session_keys(self, tenant: str, session_id: str) -> list[str]:
        """The session's block keys in prefix order."""
        m = self._member(tenant, session_id)
        return list(self._call(lambda: self._client.lrange(self.prefix + "b:" + m, 0, -1)))

    def session_state(self, tenant: str, session_id: str) -> tuple[SessionRow | None, list[str]]:
        """Row and block keys, read in one transaction."""
        ((h, keys),) = self._rows([(tenant, session_id)], keys=True)
        if not h:
            return None, []
        return self._row(tenant, session_id, h, len(keys)), list(keys)

    def policy_snapshot(self) -> tuple[list[SessionRow], list[tuple[str, str, str]]]:
        """Every session and every (tenant, session, key) reference (the chunks of
        :meth:`iter_policy_snapshot`, joined)."""
        return join_snapshot(self.iter_policy_snapshot())

    def iter_policy_snapshot(
        self, chunk: int = SNAPSHOT_CHUNK
    ) -> Iterator[tuple[list[SessionRow], list[tuple[str, str, str]]]]:
        """The policy snapshot in chunks of about ``chunk`` sessions (SSCAN of the session
        set, each session's row and block list read in one transaction; a session SSCAN
        returns twice is yielded once). Read :meth:`change_seq` before the first chunk: a
        session written while the chunks stream is in :meth:`changes_after` that seq."""
        seen: set[str] = set()
        cursor: int = 0
        while True:
            cursor, members = self._call(
                lambda c=cursor: self._client.sscan(self.prefix + "all", c, count=max(1, chunk))
            )
            fresh = sorted(m for m in members if m not in seen)
            seen.update(fresh)
            pairs = [tuple(m.split(SEP, 1)) for m in fresh]
            sessions: list[SessionRow] = []
            refs: list[tuple[str, str, str]] = []
            for (tenant, sid), (h, keys) in zip(pairs, self._rows(pairs, keys=True), strict=True):
                if h:
                    sessions.append(self._row(tenant, sid, h, 0))
                    refs.extend((tenant, sid, k) for k in keys)
            if sessions:
                yield sessions, refs
            if int(cursor) == 0:
                return

    # ------------------------------------------------------------------ writes

    def create_session(
        self, tenant: str, session_id: str, *, ttl_seconds: float | None, pinned: bool
    ) -> bool:
        """Insert an empty managed session (an expired one is deleted first)."""
        now = repr(time.time())
        got = self._run("CREATE", tenant, session_id, now, _num(ttl_seconds), int(pinned))
        return bool(got)

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
        """Change TTL and/or pin (``pin_ttl_s``: a lease); False if unknown."""
        now = time.time()
        pin = "" if pinned is None else int(pinned)
        until = None if not pinned or pin_ttl_s is None else now + pin_ttl_s
        args = (int(set_ttl), _num(ttl_seconds), pin, _num(until), repr(now))
        return bool(self._run("UPDATE", tenant, session_id, *args))

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
        """Record a finished request of a session."""
        when = repr(time.time() if now is None else float(now))
        self._run(
            "RECORD_TURN", tenant, session_id, when, int(num_tokens), _num(default_ttl_s), *keys
        )

    def mark_managed(self, tenant: str, session_id: str) -> None:
        """Note that a client manages the session."""
        self._run("MARK_MANAGED", tenant, session_id)

    def delete_session(self, tenant: str, session_id: str) -> list[str] | None:
        """Delete and record the freed keys as drops, atomically; None if unknown."""
        got = self._run("DELETE", tenant, session_id)
        return [str(k) for k in got[1:]] if int(got[0]) else None

    def copy_session(self, tenant: str, source: str, target: str, *, overwrite: bool) -> str:
        """Fork ``source`` into ``target``."""
        return str(self._run("COPY", tenant, source, target, int(overwrite), repr(time.time())))

    def purge_expired(self, now: float | None = None) -> list[str]:
        """Delete expired sessions and lift lapsed leases, in bounded scripts
        (:meth:`purge_expired_batch`) until none is due; concurrent purges record each drop
        once."""
        now = time.time() if now is None else float(now)
        return purge_in_batches(self.purge_expired_batch, now)

    def purge_expired_batch(
        self, now: float | None = None, *, limit: int = PURGE_BATCH
    ) -> tuple[list[str], bool]:
        """One purge script: up to ``limit`` expired sessions and lapsed leases; (freed keys,
        whether more is due). Nothing due: two sorted-set range reads."""
        when = repr(time.time() if now is None else float(now))
        got = self._run("PURGE", when, max(1, int(limit)))
        return sorted(str(k) for k in got[1:]), bool(int(got[0]))

    def clear(self) -> int:
        """Delete every key of the namespace (tests and tools); how many."""

        def run() -> int:
            names = list(self._client.scan_iter(match=self.prefix + "*"))
            for i in range(0, len(names), 500):
                self._client.delete(*names[i : i + 500])
            return len(names)

        return self._call(run)

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()
