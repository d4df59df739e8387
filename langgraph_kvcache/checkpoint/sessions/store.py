"""The tables that tie threads to KV-cache server sessions, and the SQL operations on them.

Two tables, created by the last migration in :mod:`..migrations` (so a plain saver has them
too, empty, and never queries them):

- ``checkpoint_kv_sessions``: one row per (``thread_id``, namespace) a run has touched, with
  the server session id (:func:`~langgraph_kvcache.sessions.session_id_for`) and the last time
  a run used it (unix seconds; drives ``sweep_expired``). The namespace is stored without its
  task ids (``"a|b"``), as the session id is derived from it.
- ``checkpoint_kv_outbox``: session API calls owed to the server, each written in the
  transaction of the change that owes it and removed once made; replayed in ``id`` order
  (``uuid6``: time-ordered). Rows stay while the server is down or slow (``attempts``,
  ``last_error``) and survive the process.

Operations are generators of :class:`~langgraph_kvcache.checkpoint.base.Stmt`, like the
saver's own, so the sync and async keepers run them through their saver's runner, alone or
inside the saver's own transaction (:mod:`.keeper`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langgraph.checkpoint.base.id import uuid6
from sqlalchemy import (
    Column,
    Double,
    Integer,
    MetaData,
    Table,
    Text,
    bindparam,
    delete,
    func,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from langgraph_kvcache.checkpoint.base import Op, Stmt
from langgraph_kvcache.checkpoint.schema import checkpoints
from langgraph_kvcache.sessions import session_id_for, strip_task_ids

_metadata = MetaData()

kv_sessions = Table(
    "checkpoint_kv_sessions",
    _metadata,
    Column("thread_id", Text, primary_key=True),
    Column("checkpoint_ns", Text, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("last_used_at", Double, nullable=False),
)
"""(thread, namespace) -> server session, with its last use."""

kv_outbox = Table(
    "checkpoint_kv_outbox",
    _metadata,
    Column("id", Text, primary_key=True),
    Column("op", Text, nullable=False),
    Column("session_id", Text, nullable=False),
    Column("target_id", Text),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text),
)
"""Pending session API calls, oldest ``id`` first."""

CallOp = Literal["register", "delete", "copy"]

_CHUNK = 500


@dataclass(frozen=True)
class SessionCall:
    """One session API call the saver owes the server."""

    op: CallOp
    """``register``: create the session with the saver's TTL (or set the TTL if it exists);
    ``delete``: drop it and its KV; ``copy``: fork it into ``target_id``."""
    session_id: str
    """The session acted on (the source of a copy)."""
    target_id: str | None = None
    """The new session of a ``copy``."""


@dataclass(frozen=True)
class PendingCall:
    """An outbox row."""

    id: str
    """Time-ordered row id."""
    call: SessionCall
    """The call to replay."""
    attempts: int
    """Failed attempts so far (0: not tried yet, or the process died while trying)."""


def _upsert(dialect: str) -> Callable[..., Any]:
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


def _chunks(items: Sequence[str]) -> list[Sequence[str]]:
    return [items[i : i + _CHUNK] for i in range(0, len(items), _CHUNK)]


def op_touch(dialect: str, rows: Sequence[tuple[str, str]], now: float) -> Op[None]:
    """Record that a run used each (thread, namespace) at ``now`` (insert or update)."""
    params = [
        {"thread_id": t, "checkpoint_ns": ns, "session_id": session_id_for(t, ns), "now": now}
        for t, ns in rows
    ]
    if not params:
        return
    c = kv_sessions.c
    stmt = _upsert(dialect)(kv_sessions).values(
        thread_id=bindparam("thread_id", type_=Text),
        checkpoint_ns=bindparam("checkpoint_ns", type_=Text),
        session_id=bindparam("session_id", type_=Text),
        last_used_at=bindparam("now", type_=Double),
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[c.thread_id, c.checkpoint_ns],
        set_={"last_used_at": stmt.excluded.last_used_at},
    )
    yield Stmt(stmt, params if len(params) > 1 else params[0])


def op_namespaces(thread_ids: Sequence[str]) -> Op[list[tuple[str, str]]]:
    """The (thread, namespace) pairs recorded for ``thread_ids``."""
    c = kv_sessions.c
    out: list[tuple[str, str]] = []
    for chunk in _chunks(list(thread_ids)):
        rows = yield Stmt(
            select(c.thread_id, c.checkpoint_ns).where(c.thread_id.in_(chunk)), fetch=True
        )
        out.extend((r["thread_id"], r["checkpoint_ns"]) for r in rows)
    return out


def op_thread_namespaces(thread_ids: Sequence[str]) -> Op[list[tuple[str, str]]]:
    """The (thread, namespace) pairs of ``thread_ids`` that have a session: those recorded,
    and those of their stored checkpoints (task ids stripped). The checkpoints commit with the
    graph's step, while a namespace's row is recorded by a background job (or by another
    process) that may not have run yet; so a delete or a copy made right after a run still
    finds every subgraph's session."""
    recorded = yield from op_namespaces(thread_ids)
    c = checkpoints.c
    stored: list[tuple[str, str]] = []
    for chunk in _chunks(list(thread_ids)):
        rows = yield Stmt(
            select(c.thread_id, c.checkpoint_ns).where(c.thread_id.in_(chunk)).distinct(),
            fetch=True,
        )
        stored.extend((r["thread_id"], strip_task_ids(r["checkpoint_ns"])) for r in rows)
    return list(dict.fromkeys([*recorded, *stored]))


def op_forget(thread_ids: Sequence[str]) -> Op[list[str]]:
    """Delete the rows of ``thread_ids``; returns the session ids of their recorded rows and
    checkpoints (run it before the checkpoints are deleted)."""
    pairs = yield from op_thread_namespaces(thread_ids)
    for chunk in _chunks(list(thread_ids)):
        yield Stmt(delete(kv_sessions).where(kv_sessions.c.thread_id.in_(chunk)))
    return [session_id_for(t, ns) for t, ns in pairs]


def op_threads_without_checkpoints(thread_ids: Sequence[str]) -> Op[list[str]]:
    """Those of ``thread_ids`` that have no checkpoint left."""
    c = checkpoints.c
    kept: set[str] = set()
    for chunk in _chunks(list(thread_ids)):
        rows = yield Stmt(select(c.thread_id).where(c.thread_id.in_(chunk)).distinct(), fetch=True)
        kept.update(r["thread_id"] for r in rows)
    return [t for t in thread_ids if t not in kept]


def op_expired(cutoff: float, limit: int) -> Op[list[str]]:
    """Up to ``limit`` threads (by id) whose every session was last used before ``cutoff``."""
    c = kv_sessions.c
    rows = yield Stmt(
        select(c.thread_id)
        .group_by(c.thread_id)
        .having(func.max(c.last_used_at) < cutoff)
        .order_by(c.thread_id)
        .limit(limit),
        fetch=True,
    )
    return [r["thread_id"] for r in rows]


def op_enqueue(calls: Sequence[SessionCall]) -> Op[None]:
    """Append ``calls`` to the outbox, in order (run it in the transaction of the change that
    owes them, so they are committed together)."""
    if not calls:
        return
    rows = [
        {
            "id": str(uuid6()),
            "op": call.op,
            "session_id": call.session_id,
            "target_id": call.target_id,
            "attempts": 0,
            "last_error": None,
        }
        for call in calls
    ]
    yield Stmt(kv_outbox.insert(), rows)


def op_pending(limit: int) -> Op[list[PendingCall]]:
    """The oldest ``limit`` outbox rows."""
    o = kv_outbox.c
    rows = yield Stmt(select(kv_outbox).order_by(o.id).limit(limit), fetch=True)
    return [
        PendingCall(
            id=r["id"],
            call=SessionCall(op=r["op"], session_id=r["session_id"], target_id=r["target_id"]),
            attempts=r["attempts"],
        )
        for r in rows
    ]


def op_done(row_id: str) -> Op[None]:
    """Remove a replayed (or abandoned) outbox row."""
    yield Stmt(delete(kv_outbox).where(kv_outbox.c.id == row_id))


def op_failed(row_id: str, error: str) -> Op[None]:
    """Count one more failed attempt of an outbox row."""
    o = kv_outbox.c
    yield Stmt(
        update(kv_outbox)
        .where(o.id == row_id)
        .values(attempts=o.attempts + 1, last_error=error[:500])
    )
