"""The first step of a lookup: a request's next blocks that some tier holds, by their hashes.

Scheduler side (no torch, never blocks): the local tiers (RAM, disk) from the index, then,
with Redis, the blocks after them in one existence check on the Redis thread
(:class:`~server.kv.scheduler.redis_lookups.RedisLookups`), together with the tails another
replica saved after them. The scheduler then adds the tail, a block shared up to a token
inside it, or a shifted hit (:mod:`server.kv.scheduler.shifted`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from server.kv.keys import block_key
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.redis_lookups import RedisLookups, local_or_redis
from server.kv.scheduler.tails import TailBook


def find_blocks(
    request: Any,
    start: int,
    end: int,
    index: BlockIndex,
    redis: RedisLookups | None,
    tails: TailBook,
) -> tuple[list[str], list[str], Callable[[str], str | None]] | None:
    """Keys and tiers of the request's blocks ``start ..`` (before ``end``) found in a row,
    and the tier lookup for what continues them (a tail Redis holds counts); None while the
    Redis check is outstanding ("not yet")."""
    hashes = request.block_hashes
    keys: list[str] = []
    tiers: list[str] = []
    for i in range(start, end):
        key = block_key(hashes[i])
        tier = index.tier_of(key)
        if tier is None:
            break
        keys.append(key)
        tiers.append(tier)
    if redis is None or start + len(keys) >= end:
        return keys, tiers, index.tier_of
    rest = [block_key(h) for h in hashes[start + len(keys) : end]]
    # Tails another replica saved continue one of these blocks: ask in the same trip.
    after = tails.after(keys[-1:] + rest)
    answer = redis.exists(request.request_id, rest + after)
    if answer is None:
        return None
    for key, found in zip(rest, answer, strict=False):
        if not found:
            break
        keys.append(key)
        tiers.append("redis")
    in_redis = {k for k, found in zip(after, answer[len(rest) :], strict=True) if found}
    return keys, tiers, functools.partial(local_or_redis, index.tier_of, in_redis)
