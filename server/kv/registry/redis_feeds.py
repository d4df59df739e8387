"""The Redis session registry's two feeds as Redis Streams: ``changes`` (every session
written) and ``drops`` (block keys freed), read by each engine as increments.

:class:`RedisFeeds` is a mixin of :class:`server.kv.registry.redis.RedisSessions`, which owns
the client and the scripts (``_client``, ``_call``, ``_run``, ``prefix``); the scripts of
:mod:`server.kv.registry.lua` append the entries, trimmed to about
:data:`server.kv.registry.sql.DROPS_KEPT` each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

log = logging.getLogger("server.kv.registry.redis")

T = TypeVar("T")
NO_ID = "0-0"
"""The stream position before every entry."""


def _stream_id(value: str | bytes) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _pos(seq: object) -> str:
    """A stream position; 0 (where a SQLite feed starts) reads as the start."""
    return NO_ID if str(seq) == "0" else str(seq)


class RedisFeeds:
    """The ``changes`` and ``drops`` streams over the host's Redis client."""

    prefix: str
    _client: Any

    def _call(self, fn: Callable[[], T]) -> T:
        raise NotImplementedError  # the host class's

    def _run(self, script: str, *args: object) -> Any:
        raise NotImplementedError  # the host class's

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

    def add_drops(self, keys: Iterable[str]) -> None:
        """Record freed block keys for every replica."""
        keys = list(keys)
        if keys:
            self._run("ADD_DROPS", *keys)
