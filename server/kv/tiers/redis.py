"""The optional Redis tier: the same checked blocks in a shared Redis, each with a TTL.

Keys are ``lgkv:<manifest fingerprint>:<block key>``, so replicas serving the same model share
blocks and a different model never reads them. With tensor parallelism each rank stores its
own shard of heads under ``lgkv:<fingerprint>:<block key>:r<rank>`` (the fingerprint counts the
TP size); the scheduler side's store (``rank=None``) finds a block only when every rank's key
exists, and removes them all. Values use the disk tier's format (header with
key, length and CRC32, then the payload). Redis decides eviction (TTL and its own memory
policy), so the scheduler side asks Redis which blocks exist instead of indexing them.

Any Redis error (down, timeout, evicted, damaged value) is an ``OSError``: the caller treats it
as a miss. After an error the store stays quiet for ``retry_after_s`` (every call is a miss)
so a dead Redis does not slow the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from server.kv.tiers.block_frame import BlockFileError, block_header, parse_block
from server.kv.tiers.manifest import Manifest

log = logging.getLogger(__name__)


class RedisUnavailable(OSError):
    """Redis is down or timed out (recently); treat as a miss."""


class RedisStore:
    """Blocks in Redis; thread-safe (redis-py clients use a connection pool)."""

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        *,
        ttl_s: float,
        timeout_s: float = 2.0,
        retry_after_s: float = 5.0,
        rank: int | None = None,
    ) -> None:
        import redis

        self.prefix = f"lgkv:{manifest.fingerprint()}:"
        self.rank = rank if manifest.tp_size > 1 else None
        ranks = manifest.ranks if self.rank is None else (self.rank,)
        self._suffixes = tuple("" if r is None else f":r{r}" for r in ranks)
        """The name endings of one block's keys: one per rank this store covers."""
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.retry_after_s = retry_after_s
        self._errors = (redis.exceptions.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._down_until = 0.0
        self._lock = threading.Lock()

    def name(self, key: str) -> str:
        """The Redis key of a block (of this store's rank)."""
        if len(self._suffixes) != 1:
            raise ValueError("a store of every tensor-parallel rank has no single Redis key")
        return self.prefix + key + self._suffixes[0]

    def names(self, key: str) -> list[str]:
        """The Redis keys of a block, one per rank this store covers."""
        return [self.prefix + key + suffix for suffix in self._suffixes]

    def write(self, key: str, payload: memoryview) -> None:
        """Store a block (this rank's shard) with the TTL."""
        data = memoryview(payload).cast("B")
        value = block_header(key, data, self.rank) + data.tobytes()
        self._call(lambda: self._client.set(self.name(key), value, px=self.ttl_ms))

    def read_into(self, key: str, out: memoryview) -> None:
        """Fill ``out`` with the block (this rank's shard; and refresh its TTL); an
        ``OSError`` says why it is a miss."""
        error = self.read_many_into([key], [out])[0]
        if error is not None:
            raise BlockFileError(error)

    def read_many_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[str | None]:
        """Fill each ``outs[i]`` with block ``keys[i]`` in one round trip (a pipeline of
        ``GETEX``, refreshing the TTLs); per block, None when it was read, else why it is a
        miss (missing, damaged, or Redis unavailable)."""
        if not keys:
            return []
        try:

            def query() -> list[bytes | None]:
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.getex(self.name(key), px=self.ttl_ms)
                return pipe.execute()

            raws = self._call(query)
        except OSError as e:
            return [str(e)] * len(keys)
        errors: list[str | None] = []
        for key, out, raw in zip(keys, outs, raws, strict=True):
            try:
                if raw is None:
                    raise BlockFileError(f"redis {key[:16]}: missing (expired or evicted)")
                parse_block(raw, key, out, f"redis {key[:16]}", self.rank)
                errors.append(None)
            except OSError as e:
                errors.append(str(e))
        return errors

    def remove(self, key: str) -> bool:
        """Delete a block (every rank's key this store covers)."""
        return bool(self._call(lambda: self._client.delete(*self.names(key))))

    def remove_many(self, keys: Sequence[str]) -> int:
        """Delete several blocks; count the Redis keys deleted."""
        if not keys:
            return 0
        names = [n for k in keys for n in self.names(k)]
        return int(self._call(lambda: self._client.delete(*names)))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` Redis holds now, every rank's shard of them (all False while
        Redis is unavailable)."""
        if not keys:
            return []
        try:

            def query() -> list[int]:
                pipe = self._client.pipeline(transaction=False)
                for k in keys:
                    for name in self.names(k):
                        pipe.exists(name)
                return pipe.execute()

            found = [bool(n) for n in self._call(query)]
        except OSError:
            return [False] * len(keys)
        per = len(self._suffixes)
        return [all(found[i * per : (i + 1) * per]) for i in range(len(keys))]

    def scan(self) -> dict[str, int]:
        """Not indexed: Redis is asked per lookup (see module docstring)."""
        return {}

    def _call(self, fn):  # type: ignore[no-untyped-def]
        if time.monotonic() < self._down_until:
            raise RedisUnavailable("redis tier unavailable (recent error)")
        try:
            return fn()
        except self._errors as e:
            with self._lock:
                if time.monotonic() >= self._down_until:
                    log.warning("redis tier unavailable for %.0f s: %s", self.retry_after_s, e)
                self._down_until = time.monotonic() + self.retry_after_s
            raise RedisUnavailable(str(e)) from e
