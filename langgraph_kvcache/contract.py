"""The one definition of what the client and the server say to each other about sessions.

Standard library only: the client imports it, and so do the server's API process and its
engine-side connector (which must not import the server's heavy parts through it).

* Session ids: :data:`SESSION_ID_PATTERN`, :func:`is_valid_session_id`,
  :func:`check_session_id` (raises :class:`InvalidSessionId`).
* TTLs: :data:`MIN_TTL_SECONDS`, :data:`MAX_TTL_SECONDS`, :func:`check_ttl` (raises
  :class:`InvalidTTL`); ``None`` means "never expires". Pin leases: :func:`check_pin_update`.
* What a generation request carries to the connector in ``SamplingParams.extra_args``
  (:data:`XARG_SESSION`, :data:`XARG_TENANT`, :data:`XARG_OP`, :data:`PREFETCH_OP`).
* The JSON answers of the session API as dataclasses: :class:`Session`, :class:`TierUsage`,
  :class:`SessionList`, :class:`SessionDeleted`, :class:`PrefetchResult`. The server's routes
  return them as their FastAPI response models; the client parses them with ``from_dict``.
* :data:`UNSET`: "leave this field as it is" in updates.
* HTTP headers: :data:`SESSION_HEADER` (requests name their session for a router),
  :data:`REPLICA_HEADER` (responses name the replica that answered).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Final

__all__ = [
    "BARRIER_OP",
    "DEFAULT_TENANT",
    "MAX_TTL_SECONDS",
    "MIN_TTL_SECONDS",
    "PREFETCH_OP",
    "REPLICA_HEADER",
    "REUSE_EXACT",
    "REUSE_MODES",
    "REUSE_SHIFTED",
    "SESSION_HEADER",
    "SESSION_ID_PATTERN",
    "SESSION_ID_RULE",
    "SYNC_OP",
    "UNSET",
    "XARG_OP",
    "XARG_REUSE",
    "XARG_SESSION",
    "XARG_TENANT",
    "InvalidSessionId",
    "InvalidTTL",
    "PrefetchResult",
    "Session",
    "SessionDeleted",
    "SessionList",
    "TierUsage",
    "Unset",
    "check_pin_update",
    "check_session_id",
    "check_ttl",
    "is_valid_session_id",
]

# ----------------------------------------------------------------------------- session ids
SESSION_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@|=+\-]{0,254}$")
"""The syntax of a session id. Ids never become file paths."""
SESSION_ID_RULE: Final = (
    "1-255 characters from A-Z a-z 0-9 . _ : @ | = + -, starting with a letter or digit"
)


class InvalidSessionId(ValueError):
    """A session id breaks :data:`SESSION_ID_PATTERN` (the server answers HTTP 400)."""


def is_valid_session_id(value: object) -> bool:
    """Whether ``value`` is a string matching :data:`SESSION_ID_PATTERN`."""
    return isinstance(value, str) and SESSION_ID_PATTERN.fullmatch(value) is not None


def check_session_id(value: object, *, field: str = "session id") -> str:
    """Return ``value`` if it is a valid session id, else raise :class:`InvalidSessionId`.

    ``field`` names the value in the message (``"session_id"``, ``"target_id"``...).
    """
    if not is_valid_session_id(value):
        raise InvalidSessionId(
            f"invalid {field} {value!r}: use {SESSION_ID_RULE} "
            "(langgraph_kvcache.session_id_for(thread_id) derives one from any thread id)"
        )
    return value  # type: ignore[return-value]


# ----------------------------------------------------------------------------- HTTP headers
SESSION_HEADER: Final = "X-Session-ID"
"""Request header naming the session a request works on. ``ChatKVCache`` and the session
client send it on every request that names a session, so a router that hashes it
(``vllm-router --policy consistent_hash``) keeps a thread on one replica. The server reads the
session from the body and the path only, never from this header."""
REPLICA_HEADER: Final = "X-LGKV-Replica"
"""Response header on every answer of the server: which replica answered (its
``--replica-id``, by default ``<hostname>:<port>``)."""


# ----------------------------------------------------------------------------- TTLs
MIN_TTL_SECONDS: Final = 1.0
"""Shortest TTL accepted: a shorter one would expire before its creation is read back."""
MAX_TTL_SECONDS: Final = 366 * 86400.0
"""Longest TTL accepted (a year); ``None`` keeps a session until it is deleted."""


class InvalidTTL(ValueError):
    """A TTL is not a finite number of seconds within the bounds (HTTP 400/422)."""


def check_ttl(value: object, *, field: str = "ttl_seconds") -> float | None:
    """Return ``value`` as float seconds (``None`` stays ``None``: never expires).

    Raises:
        InvalidTTL: not a number, not finite, or outside
            [:data:`MIN_TTL_SECONDS`, :data:`MAX_TTL_SECONDS`].
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidTTL(f"{field} must be a finite number of seconds or null, got {value!r}")
    if not MIN_TTL_SECONDS <= value <= MAX_TTL_SECONDS:
        raise InvalidTTL(
            f"{field} must be between {MIN_TTL_SECONDS:g} and {MAX_TTL_SECONDS:g} seconds "
            f"(null: never expires), got {value!r}"
        )
    return float(value)


def check_pin_update(pinned: bool | None, pin_ttl_seconds: float | None) -> bool | None:
    """The pin a session update asks for: a pin lease (``pin_ttl_seconds``) implies
    ``pinned=True``; otherwise ``pinned`` as given (``None``: leave the pin as it is).

    Raises:
        ValueError: a lease with ``pinned=False`` (leave ``pinned`` out or true).
    """
    if pin_ttl_seconds is None:
        return pinned
    if pinned is False:
        raise ValueError("pin_ttl_seconds pins the session: leave pinned out or true")
    return True


# ----------------------------------------------------------------------------- extra_args
XARG_SESSION: Final = "session_id"
"""``vllm_xargs`` / ``extra_args`` key naming the request's session."""
XARG_TENANT: Final = "tenant"
"""``extra_args`` key of the caller's tenant; set by the server only, from the API key."""
DEFAULT_TENANT: Final = "default"
"""The one tenant of a server without API keys."""
XARG_OP: Final = "lgkv_op"
"""``extra_args`` key of a control operation carried by an engine request."""
PREFETCH_OP: Final = "prefetch"
"""Value of ``extra_args[XARG_OP]`` of the engine request that performs a prefetch."""
SYNC_OP: Final = "sync"
"""Value of ``extra_args[XARG_OP]`` of the engine request that applies recorded deletes now:
it finishes once the engine has dropped the blocks and removed their files."""
XARG_REUSE: Final = "lgkv_reuse"
"""``vllm_xargs`` key of how a request reuses its session's KV: :data:`REUSE_EXACT` or
:data:`REUSE_SHIFTED` (the server's ``--kv-reuse`` when absent)."""
REUSE_EXACT: Final = "exact"
"""Reuse only a prompt's exact prefix (outputs identical to no cache)."""
REUSE_SHIFTED: Final = "shifted"
"""Also reuse the session's tokens that the prompt repeats at other positions (after a trim or
a summary), keys re-rotated: approximate KV, kept apart from exact requests' blocks."""
REUSE_MODES: Final = (REUSE_EXACT, REUSE_SHIFTED)
"""The values of :data:`XARG_REUSE`."""
BARRIER_OP: Final = "barrier"
"""Value of ``extra_args[XARG_OP]`` of the engine request that finishes once the engine's
records (turns, block locations, counters) queued before it are in the registry and the
changes recorded before it are applied; lighter than :data:`SYNC_OP` (no purge, no file
removals awaited)."""


class Unset:
    """Type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset()
"""Marker for "leave this field as it is" (e.g. ``ttl_seconds`` in an update)."""


# ----------------------------------------------------------------------------- answers
# ``__pydantic_config__`` lets FastAPI put the field docstrings into the OpenAPI schema; it is
# a plain dict, so this module does not import pydantic.
_DOCS: Final = {"use_attribute_docstrings": True}


@dataclass(frozen=True)
class TierUsage:
    """How much of a session lives in one storage tier."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _DOCS

    blocks: int
    """Number of the session's KV blocks held by the tier."""
    bytes: int
    """Bytes those blocks take in the tier."""


@dataclass(frozen=True)
class Session:
    """A server session: the KV cache of one conversation (a thread's graph or subgraph)."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _DOCS

    id: str
    """Session id (see ``langgraph_kvcache.session_id_for``)."""
    tenant: str
    """Tenant owning the session (derived by the server from the API key)."""
    num_tokens: int
    """Tokens of the conversation prefix whose KV the session holds."""
    num_blocks: int
    """KV blocks the session references, its partly filled last block (tail) included."""
    turns: int
    """Requests that have named this session."""
    created_at: float
    """Creation time, unix seconds."""
    last_used_at: float
    """Time of the last request or API call that used the session, unix seconds."""
    pinned: bool
    """Pinned now: its blocks are never evicted from disk and leave RAM only to disk, after
    every unpinned block (its TTL still applies). A pin with a lease counts until
    ``pin_expires_at``."""
    ttl_seconds: float | None
    """Idle time after which the session expires; ``None``: never."""
    expires_at: float | None
    """When the session expires if unused, unix seconds; ``None``: never."""
    pin_expires_at: float | None = None
    """When the pin's lease lapses (the session is an ordinary one again), unix seconds;
    ``None``: not pinned, or pinned until unpinned."""
    tiers: dict[str, TierUsage] = field(default_factory=dict)
    """Usage per tier, keyed ``"ram"``, ``"disk"``, ``"redis"``."""
    object: str = "session"
    """Always ``"session"``."""

    def to_dict(self) -> dict[str, Any]:
        """The session's JSON object, as the server sends it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Session:
        """Parse the server's Session JSON; ``ValueError`` says which part is malformed."""
        try:
            return cls(
                id=str(data["id"]),
                tenant=str(data["tenant"]),
                num_tokens=int(data["num_tokens"]),
                num_blocks=int(data["num_blocks"]),
                turns=int(data["turns"]),
                created_at=float(data["created_at"]),
                last_used_at=float(data["last_used_at"]),
                pinned=bool(data["pinned"]),
                ttl_seconds=_opt_float(data.get("ttl_seconds")),
                expires_at=_opt_float(data.get("expires_at")),
                pin_expires_at=_opt_float(data.get("pin_expires_at")),
                tiers={
                    str(name): TierUsage(blocks=int(u["blocks"]), bytes=int(u["bytes"]))
                    for name, u in (data.get("tiers") or {}).items()
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a Session: {exc!r}") from exc


@dataclass(frozen=True)
class SessionList:
    """``GET /v1/sessions``: a tenant's sessions, most recently used first."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _DOCS

    data: list[Session]
    """The sessions of this page."""
    next_cursor: str | None = None
    """Pass as ``after`` to list the next page; null on the last page."""
    object: str = "list"
    """Always ``"list"``."""


@dataclass(frozen=True)
class SessionDeleted:
    """``DELETE /v1/sessions/{id}``: the session is gone, with the blocks only it used."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _DOCS

    id: str
    """The session deleted."""
    freed_blocks: int
    """Blocks no other session referenced, now freed."""
    deleted: bool = True
    """Always true."""
    files_removed: bool = True
    """The engine confirmed the freed blocks are out of every tier and their files gone; false
    when it was too busy to confirm within the server's bound (it removes them at its next
    step; the session is deleted either way)."""
    object: str = "session.deleted"
    """Always ``"session.deleted"``."""


@dataclass(frozen=True)
class PrefetchResult:
    """Answer of the prefetch endpoint: the session's KV is in RAM now."""

    __pydantic_config__: ClassVar[dict[str, Any]] = _DOCS

    id: str
    """The session prefetched."""
    blocks: int
    """Blocks of the session."""
    ram_blocks: int
    """Blocks in RAM once the prefetch finished (fewer when the engine was too busy to finish
    the copy within the server's bound; the copy goes on)."""
    object: str = "session.prefetch"
    """Always ``"session.prefetch"``."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrefetchResult:
        """Parse the prefetch answer; ``ValueError`` if it is malformed."""
        try:
            return cls(str(data["id"]), int(data["blocks"]), int(data["ram_blocks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a prefetch answer: {exc!r}") from exc


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
