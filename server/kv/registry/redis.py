"""Sessions in Redis: the shared part of the registry when ``--kv-redis-url`` is set.

:class:`RedisSessions` implements :class:`server.kv.registry.api.SessionStore` over the key
layout of :mod:`server.kv.registry.lua`: every write is one Lua script (atomic, so several
replicas and API processes may write at once), every multi-key read one MULTI/EXEC. Keys sit
under ``lgkv:reg:{<namespace>}:``; replicas that serve the same model under the same name
share a namespace (:func:`server.config.redis_namespace`), other models and test runs use
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

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from server.kv.registry import lua
from server.kv.registry.api import RegistryUnavailable
from server.kv.registry.sql import DROPS_KEPT, SessionRow

log = logging.getLogger(__name__)

T = TypeVar("T")
SEP = "\x1f"
"""Between tenant and session id in key names (never in a session id; see the contract)."""
NO_ID = "0-0"
"""The stream position before every entry."""


def _stream_id(value: str | bytes) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _pos(seq: object) -> str:
    """A stream position; 0 (where a SQLite feed starts) reads as the start."""
    return NO_ID if str(seq) == "0" else str(seq)


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class RedisSessions:
    """Sessions, block lists and the changes/drops streams of one namespace in Redis."""

    def __init__(self, url: str, namespace: str, *, timeout_s: float = 2.0) -> None:
        import redis

        if not namespace:
            raise ValueError("the Redis session registry needs a namespace")
        self.url = url
        self.namespace = namespace
        self.prefix = f"lgkv:reg:{{{namespace}}}:"
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

    def _last_id(self, stream: str) -> str:
        got = self._call(lambda: self._client.xrevrange(self.prefix + stream, count=1))
        return str(got[0][0]) if got else NO_ID

    def _after(self, stream: str, seq: str) -> list[tuple[str, dict[str, str]]]:
        out: list[tuple[str, dict[str, str]]] = []
        start = f"({seq}"
        while True:
            batch = self._call(
                lambda s=start: self._client.xrange(self.prefix + stream, min=s, count=10_000)
            )
            out.extend(batch)
            if len(batch) < 10_000:
                return out
            start = f"({batch[-1][0]}"

    def _trimmed_after(self, stream: str, seq: str) -> bool:
        """True if entries newer than ``seq`` may have been trimmed away: the stream lost
        entries (``entries-added`` > ``length``) and holds none at or before ``seq``. (When
        it was trimmed exactly up to ``seq`` this says True too: a reload, never a gap.)"""

        def info() -> dict[str, Any] | None:
            try:
                return dict(self._client.xinfo_stream(self.prefix + stream))
            except Exception as exc:  # no stream yet: nothing was trimmed
                if "no such key" in str(exc).lower():
                    return None
                raise

        got = self._call(info)
        if not got or int(got.get("entries-added", 0)) <= int(got.get("length", 0)):
            return False
        first = got.get("first-entry")
        return first is None or _stream_id(first[0]) > _stream_id(seq)

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

    def list_sessions(self, tenant: str, limit: int, offset: int) -> list[SessionRow]:
        """A tenant's sessions, most recently used first (ties by id)."""
        ids = self._call(
            lambda: self._client.zrevrange(self.prefix + "t:" + tenant, offset, offset + limit - 1)
        )
        rows = self._rows([(tenant, sid) for sid in ids], keys=False)
        pairs = zip(ids, rows, strict=True)
        out = [self._row(tenant, sid, h, int(n)) for sid, (h, n) in pairs if h]
        return sorted(out, key=lambda r: (-r.last_used_at, r.id))

    def count_sessions(self) -> int:
        """Sessions of every tenant in the namespace."""
        return int(self._call(lambda: self._client.scard(self.prefix + "all")))

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
        """Every session and every (tenant, session, key) reference."""
        members = sorted(self._call(lambda: self._client.smembers(self.prefix + "all")))
        pairs = [tuple(m.split(SEP, 1)) for m in members]
        sessions: list[SessionRow] = []
        refs: list[tuple[str, str, str]] = []
        for (tenant, sid), (h, keys) in zip(pairs, self._rows(pairs, keys=True), strict=True):
            if h:
                sessions.append(self._row(tenant, sid, h, 0))
                refs.extend((tenant, sid, k) for k in keys)
        return sessions, refs

    def change_seq(self) -> str:
        """The newest ``changes`` stream id."""
        return self._last_id("changes")

    def changes_after(self, seq: str) -> tuple[str, list[tuple[str, str]] | None]:
        """Sessions written after ``seq``; None when the stream was trimmed past it."""
        seq = _pos(seq)
        entries = self._after("changes", seq)
        if not entries:
            return seq, []
        newest = str(entries[-1][0])
        if self._trimmed_after("changes", seq):
            return newest, None
        latest = {(f["t"], f["s"]): i for i, (_, f) in enumerate(entries)}
        return newest, sorted(latest, key=latest.__getitem__)

    def drops_after(self, seq: str) -> tuple[str, list[str]]:
        """Freed keys after ``seq`` (a warning if some were trimmed before they were read)."""
        seq = _pos(seq)
        entries = self._after("drops", seq)
        if entries and self._trimmed_after("drops", seq):
            log.warning(
                "session registry: drops after %s were trimmed before this engine read them; "
                "their blocks leave its tiers by eviction",
                seq,
            )
        keys = [k for _, f in entries for k in f["keys"].split()]
        return (str(entries[-1][0]) if entries else seq), keys

    def last_drop_seq(self) -> str:
        """The newest ``drops`` stream id."""
        return self._last_id("drops")

    def wait_drops(self, seq: str, block_ms: int = 1000) -> str:
        """Block up to ``block_ms`` for drops after ``seq``; the newest drops id then (``seq``
        when none came). Keep ``block_ms`` below the socket timeout."""

        def read() -> Any:
            return self._client.xread({self.prefix + "drops": seq}, count=1000, block=block_ms)

        got = self._call(read)
        return str(got[0][1][-1][0]) if got and got[0][1] else seq

    def drop_position_valid(self, seq: str) -> bool:
        """Whether reading drops after ``seq`` misses nothing (none trimmed past it)."""
        return not self._trimmed_after("drops", _pos(seq))

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
        pin = "" if pinned is None else int(pinned)
        until = None if not pinned or pin_ttl_s is None else time.time() + pin_ttl_s
        args = (int(set_ttl), _num(ttl_seconds), pin, _num(until))
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
        """Delete expired sessions (atomic: concurrent purges record each drop once)."""
        when = repr(time.time() if now is None else float(now))
        return sorted(str(k) for k in self._run("PURGE", when))

    def add_drops(self, keys: Iterable[str]) -> None:
        """Record freed block keys for every replica."""
        keys = list(keys)
        if keys:
            self._run("ADD_DROPS", *keys)

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
