"""The requests the scheduler side follows, and what it found for each.

Pure bookkeeping, no vLLM import: :func:`track` reads a request's session from its
``sampling_params.extra_args`` (the keys of :mod:`langgraph_kvcache.contract`: session id,
tenant, control op) the first time the scheduler side sees it, and keeps a :class:`Tracked`
until the request finishes; a :class:`Lookup` holds one ``get_num_new_matched_tokens``
answer until vLLM allocates the request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from langgraph_kvcache.contract import (
    DEFAULT_TENANT,
    REUSE_SHIFTED,
    XARG_OP,
    XARG_REUSE,
    XARG_SESSION,
    XARG_TENANT,
)
from server.kv.groups import BlockRef
from server.kv.scheduler.shifted import ShiftedHit
from server.kv.scheduler.tails import TailHit


@dataclass
class Tracked:
    """A request the scheduler side follows until it finishes."""

    request: Any
    block_ids: list[BlockRef] = field(default_factory=list)
    saved_upto: int = 0
    session: tuple[str, str] | None = None
    """``(tenant, session id)``, or None for a request outside any session."""
    op: str | None = None
    """A control op carried by the request (prefetch), if any."""
    loading: bool = False
    """An asynchronous load of the request is (or may be) in flight: no tail save."""
    shifted: bool = False
    """The request asked for shifted reuse (:mod:`server.kv.scheduler.shifted`)."""
    exact_tokens: int = 0
    """Tokens its load reads at their stored positions (before any shifted block)."""
    moved: list[int] = field(default_factory=list)
    """Per shifted block its load fills, the tokens read from another position."""


@dataclass
class Lookup:
    """What a lookup found: from block ``start``, ``keys`` in ``tiers``, and the tail."""

    start: int
    keys: list[str]
    tiers: list[str]
    misses: int
    tail: TailHit | None = None
    shifted: ShiftedHit | None = None
    """Blocks after ``keys`` filled from other positions (then ``tail`` is None)."""


def track(tracked: dict[str, Tracked], request: Any) -> Tracked:
    """The request's :class:`Tracked` in ``tracked`` (by request id), added on first sight."""
    found = tracked.get(request.request_id)
    if found is None:
        extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
        sid, tenant = extra.get(XARG_SESSION), extra.get(XARG_TENANT) or DEFAULT_TENANT
        session = (str(tenant), str(sid)) if isinstance(sid, str) and sid else None
        op = extra.get(XARG_OP)
        found = Tracked(
            request,
            session=session,
            op=op if isinstance(op, str) else None,
            shifted=extra.get(XARG_REUSE) == REUSE_SHIFTED,
        )
        tracked[request.request_id] = found
    return found
