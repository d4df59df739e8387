"""Map LangGraph threads (and subgraph namespaces) to server session ids.

A server session is named by a string matching :data:`SESSION_ID_PATTERN` (contracts.md, 1).
One LangGraph thread owns one session for its root graph, and one more per subgraph that calls
the model, so that every conversation the server sees is one growing prefix:

``session_id_for("t1")``                         -> ``"t1"``
``session_id_for("t1", "research:1f0e...-...")`` -> ``"t1|research"``
``session_id_for("t1", "a:<id>|b:<id>")``        -> ``"t1|a|b"``

Task ids (the ``:<uuid>`` after each node name) change on every step, so they are dropped and a
subgraph keeps one stable session across steps. Ids that do not fit the syntax (odd characters, a
``|`` inside the thread id, too long) are replaced by a readable prefix plus a sha256 digest, so
the mapping is deterministic and does not depend on the process. Every session of a thread starts
with :func:`thread_session_prefix` followed by ``|``; the checkpointer uses that to drop a
thread's subgraph sessions along with the thread.

Further down: helpers that read the configuration of the running graph (the ``RunnableConfig``
that LangGraph puts in a context variable while a node runs), and the session records the
server's session API returns (:class:`Session`, :class:`TierUsage`, :class:`PrefetchResult`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import var_child_runnable_config

__all__ = [
    "SESSION_ID_PATTERN",
    "PrefetchResult",
    "Session",
    "TierUsage",
    "current_config",
    "graph_namespace",
    "is_valid_session_id",
    "session_id_for",
    "session_id_from_config",
    "thread_session_prefix",
    "validate_session_id",
]

SESSION_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@|=+\-]{0,254}$")
"""The server's session id syntax (contracts.md, section 1)."""

MAX_SESSION_ID_LENGTH = 255
MAX_THREAD_PART_LENGTH = 200
"""Thread ids up to this length that fit the syntax (and hold no ``|``) are used unchanged."""

_NS_SEP = "|"  # LangGraph's separator between namespace levels (langgraph NS_SEP)
_NS_END = ":"  # LangGraph's separator between a node name and its task id (langgraph NS_END)
_TASK_ID_KEY = "__pregel_task_id"  # configurable key LangGraph sets while a task runs
_DIGEST_CHARS = 24
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@=+\-]")  # "|" is unsafe inside one part


def is_valid_session_id(session_id: str) -> bool:
    """Whether ``session_id`` matches the server's session id syntax."""
    return bool(SESSION_ID_PATTERN.fullmatch(session_id))


def validate_session_id(session_id: str) -> str:
    """Return ``session_id`` unchanged, or raise ``ValueError`` saying what a valid id is."""
    if not isinstance(session_id, str) or not is_valid_session_id(session_id):
        raise ValueError(
            f"Invalid session id {session_id!r}: it must be 1-255 characters, start with a letter "
            "or digit, and use only letters, digits and . _ : @ | = + -. "
            "Use session_id_for(thread_id) to derive a valid id from any thread id."
        )
    return session_id


def _hashed(text: str, keep: int) -> str:
    """A readable, syntax-safe prefix of ``text`` plus a sha256 digest of all of it."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:_DIGEST_CHARS]
    prefix = _UNSAFE.sub("-", text)[:keep]
    return f"{prefix}={digest}" if prefix else f"h={digest}"


def thread_session_prefix(thread_id: str | int) -> str:
    """The session id of a thread's root graph; subgraph sessions extend it with ``|<ns>``.

    Equal to ``str(thread_id)`` when that is at most 200 characters, fits the syntax and holds no
    ``|``; otherwise a deterministic ``<prefix>=<sha256 digest>`` form of at most 57 characters
    that starts with a letter or digit.
    """
    text = str(thread_id)
    if (
        text
        and len(text) <= MAX_THREAD_PART_LENGTH
        and _NS_SEP not in text
        and is_valid_session_id(text)
    ):
        return text
    hashed = _hashed(text, keep=32)
    return hashed if hashed[0].isalnum() else f"t{hashed}"


def strip_task_ids(checkpoint_ns: str) -> str:
    """``"a:<id>|b:<id>"`` -> ``"a|b"``: keep node names, drop per-step task ids."""
    if not checkpoint_ns:
        return ""
    return _NS_SEP.join(part.split(_NS_END, 1)[0] for part in checkpoint_ns.split(_NS_SEP))


def session_id_for(thread_id: str | int, checkpoint_ns: str = "") -> str:
    """The server session id for a thread's graph at ``checkpoint_ns`` (``""``: the root graph).

    ``checkpoint_ns`` is a graph's checkpoint namespace as LangGraph writes it (node names and
    task ids, e.g. ``"research:1f0e..."``); task ids are removed so the id is stable across steps.
    The result always matches :data:`SESSION_ID_PATTERN` and depends only on the arguments.
    """
    head = thread_session_prefix(thread_id)
    ns = strip_task_ids(checkpoint_ns)
    if not ns:
        return head
    room = MAX_SESSION_ID_LENGTH - len(head) - 1
    if len(ns) > room or _UNSAFE.search(ns.replace(_NS_SEP, "")):
        ns = _hashed(ns, keep=min(16, room - _DIGEST_CHARS - 1))
    return f"{head}{_NS_SEP}{ns}"


def current_config() -> RunnableConfig | None:
    """The ``RunnableConfig`` of the running graph node or runnable, or ``None`` outside one.

    Same source as ``langgraph.config.get_config()``, without raising outside a runnable.
    """
    return var_child_runnable_config.get()


def graph_namespace(configurable: Mapping[str, Any]) -> str:
    """The checkpoint namespace of the graph that is running, from a node's ``configurable``.

    While a node runs, LangGraph sets ``checkpoint_ns`` to the graph's namespace followed by the
    node's own ``name:<task id>`` segment; that last segment is removed here, so every node of
    the root graph maps to ``""`` and every node of a subgraph to the subgraph's namespace. A
    namespace given by hand (no running task) is returned unchanged.
    """
    ns = str(configurable.get("checkpoint_ns") or "")
    task_id = configurable.get(_TASK_ID_KEY)
    if ns and task_id:
        parent, _, last = ns.rpartition(_NS_SEP)
        if last.endswith(f"{_NS_END}{task_id}"):
            return parent
    return ns


def session_id_from_config(config: RunnableConfig | Mapping[str, Any] | None) -> str | None:
    """The session id for a config's ``thread_id`` (and graph namespace), or ``None`` if none.

    An explicit ``configurable["session_id"]`` wins (validated); otherwise the id is
    ``session_id_for(thread_id, graph_namespace(configurable))``.
    """
    if not config:
        return None
    configurable = config.get("configurable") or {}
    explicit = configurable.get("session_id")
    if explicit is not None:
        return validate_session_id(str(explicit))
    thread_id = configurable.get("thread_id")
    if thread_id is None or thread_id == "":
        return None
    return session_id_for(thread_id, graph_namespace(configurable))


# ----------------------------------------------------------------------------- server records
@dataclass(frozen=True)
class TierUsage:
    """How much of a session lives in one storage tier."""

    blocks: int
    """Number of the session's KV blocks held by the tier."""
    bytes: int
    """Bytes those blocks take in the tier."""


@dataclass(frozen=True)
class Session:
    """A server session (contracts.md 4): the KV cache of one thread's graph or subgraph."""

    id: str
    """Session id (see :func:`session_id_for`)."""
    tenant: str
    """Tenant owning the session (derived by the server from the API key)."""
    num_tokens: int
    """Tokens of the conversation prefix whose KV the session holds."""
    num_blocks: int
    """KV blocks the session references."""
    turns: int
    """Requests that have named this session."""
    created_at: float
    """Creation time, unix seconds."""
    last_used_at: float
    """Time of the last request or API call that used the session, unix seconds."""
    pinned: bool
    """Pinned sessions are never evicted and never expire."""
    ttl_seconds: float | None
    """Idle time after which the session expires; ``None``: never."""
    expires_at: float | None
    """When the session expires if unused, unix seconds; ``None``: never."""
    tiers: dict[str, TierUsage] = field(default_factory=dict)
    """Usage per tier, keyed ``"ram"``, ``"disk"``, ``"redis"``."""

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
                tiers={
                    str(name): TierUsage(blocks=int(u["blocks"]), bytes=int(u["bytes"]))
                    for name, u in (data.get("tiers") or {}).items()
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a Session: {exc!r}") from exc


@dataclass(frozen=True)
class PrefetchResult:
    """Answer of the prefetch endpoint: the session's KV is in RAM now."""

    id: str
    """The session prefetched."""
    blocks: int
    """Blocks of the session."""
    ram_blocks: int
    """Blocks in RAM once the prefetch finished."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrefetchResult:
        """Parse the prefetch answer; ``ValueError`` if it is malformed."""
        try:
            return cls(str(data["id"]), int(data["blocks"]), int(data["ram_blocks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a prefetch answer: {exc!r}") from exc


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
