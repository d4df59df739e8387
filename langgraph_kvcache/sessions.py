"""Map LangGraph threads (and subgraph namespaces) to server session ids.

A server session is named by a string matching :data:`SESSION_ID_PATTERN` (defined, with the
session records, in :mod:`langgraph_kvcache.contract`).
One LangGraph thread owns one session for its root graph, and one more per subgraph that calls
the model, so that every conversation the server sees is one growing prefix:

``session_id_for("t1")``                         -> ``"t1"``
``session_id_for("t1", "research:1f0e...-...")`` -> ``"t1|research"``
``session_id_for("t1", "a:<id>|b:<id>")``        -> ``"t1|a|b"``

Task ids (the ``:<uuid>`` after each node name) change on every step, so they are dropped and a
subgraph keeps one stable session across steps. Ids that do not fit the syntax (odd characters, a
``|`` or ``=`` inside the thread id, too long) are replaced by a readable prefix, ``=`` and a
sha256 digest, so the mapping is deterministic, does not depend on the process, and is
one-to-one: an id used unchanged never holds ``=``. Every session of a thread starts
with :func:`thread_session_prefix` followed by ``|``; the checkpointer uses that to drop a
thread's subgraph sessions along with the thread.

Further down: helpers that read the configuration of the running graph (the ``RunnableConfig``
that LangGraph puts in a context variable while a node runs). The session records the server's
session API returns (:class:`Session`, :class:`TierUsage`, :class:`PrefetchResult`) are
re-exported from :mod:`langgraph_kvcache.contract`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import var_child_runnable_config

from langgraph_kvcache.contract import (
    SESSION_ID_PATTERN,
    PrefetchResult,
    Session,
    TierUsage,
    check_session_id,
    is_valid_session_id,
)

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

MAX_SESSION_ID_LENGTH = 255
MAX_THREAD_PART_LENGTH = 200
"""Thread ids up to this length that fit the syntax (and hold no ``|``) are used unchanged."""

_NS_SEP = "|"  # LangGraph's separator between namespace levels (langgraph NS_SEP)
_NS_END = ":"  # LangGraph's separator between a node name and its task id (langgraph NS_END)
_TASK_ID_KEY = "__pregel_task_id"  # configurable key LangGraph sets while a task runs
_DIGEST_CHARS = 24
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@=+\-]")  # "|" is unsafe inside one part
_DIGEST_SEP = "="
"""Only a digest form holds it: an id used unchanged never does, so no two inputs map to one id."""


def validate_session_id(session_id: str) -> str:
    """Return ``session_id`` unchanged, or raise ``InvalidSessionId`` (a ``ValueError``) saying
    what a valid id is."""
    return check_session_id(session_id)


def _hashed(text: str, keep: int) -> str:
    """A readable, syntax-safe prefix of ``text`` plus a sha256 digest of all of it."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:_DIGEST_CHARS]
    prefix = _UNSAFE.sub("-", text).replace(_DIGEST_SEP, "-")[:keep]
    return f"{prefix or 'h'}{_DIGEST_SEP}{digest}"


def thread_session_prefix(thread_id: str | int) -> str:
    """The session id of a thread's root graph; subgraph sessions extend it with ``|<ns>``.

    Equal to ``str(thread_id)`` when that is at most 200 characters, fits the syntax and holds no
    ``|`` or ``=``; otherwise a deterministic ``<prefix>=<sha256 digest>`` form of at most 57
    characters that starts with a letter or digit. Only that form holds ``=``, so two thread ids
    never share a session (``"user 1"`` and ``"user-1=<its digest>"`` differ).
    """
    text = str(thread_id)
    if (
        text
        and len(text) <= MAX_THREAD_PART_LENGTH
        and _NS_SEP not in text
        and _DIGEST_SEP not in text
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
    if len(ns) > room or _UNSAFE.search(ns.replace(_NS_SEP, "")) or _DIGEST_SEP in ns:
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
