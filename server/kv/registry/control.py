"""Session control for the API process. No torch, no vLLM at import.

How the API process reaches the engine process
-----------------------------------------------
vLLM runs the scheduler (and our scheduler-side connector) in the engine-core process, often
not the API process, and that loop sleeps while it has no requests. Two channels connect them:

One owner of each piece of state: the engine owns expiry and block files; this process records
requests and reads state.

1. The registry (SQLite, WAL; with ``--kv-redis-url`` the sessions and feeds in Redis, shared by
   every replica, see :mod:`server.kv.registry.shared`) records requests. ``delete`` removes
   the session's rows and, in the same transaction, appends the keys of blocks no other
   session references to the ``drops`` feed; the engine's registry thread (every replica's,
   with Redis) reads new drops (and, from the ``changes`` feed, every session written:
   ``copy``, pins, TTLs) within about 50 ms, and its scheduler applies them at its next step:
   it stops serving the dropped blocks, frees their RAM slots and has the worker remove their
   files. Expired sessions are hidden from every read here;
   the engine purges them (every few seconds, and at each sync).
2. The engine's own request queue for work that must run in the engine now. ``prefetch``
   submits a one-token request carrying ``extra_args={XARG_OP: PREFETCH_OP, ...}`` through
   ``engine_client.generate``; this wakes an idle engine, the connector sees the op in
   ``get_num_new_matched_tokens``, moves the session's blocks disk -> RAM and holds the
   request until the copies finished. :meth:`SessionControl.settle` submits a ``SYNC_OP``
   request the same way after a delete: it finishes once the engine has applied the drops and
   removed the files, so a ``DELETE`` answers when the blocks are gone. ``collective_rpc`` was
   not used: it reaches workers only, not the scheduler that owns the index and the RAM slots.

The session routes never wait behind generation: they read and change the registry directly.
Pins, TTLs, copies and deletes reach the engine through the registry's feeds (point 1). The
engine records a finished turn on its registry thread moments after the request finished; so
that a read or change of a session sees every turn of it that this process served before the
call, a call waits for those records only (:class:`server.kv.registry.turn_watch.TurnWatch`,
bounded, never through the engine's queue). The engine's queue is used where the engine itself
must act: ``prefetch`` (bounded by ``PREFETCH_WAIT_S``; the copy goes on after the answer) and
the removal of a deleted session's files (:meth:`SessionControl.settle`, bounded by
``DELETE_SETTLE_S``; the answer says whether the files are gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from pathlib import Path

from langgraph_kvcache.contract import (
    PREFETCH_OP,
    SYNC_OP,
    UNSET,
    XARG_OP,
    XARG_SESSION,
    XARG_TENANT,
    InvalidSessionId,
    Session,
    TierUsage,
    Unset,
    check_pin_update,
    check_session_id,
    check_ttl,
)
from server.kv.registry.api import RegistryUnavailable
from server.kv.registry.drop_watch import DropWatcher
from server.kv.registry.page import parse_session_cursor, session_cursor
from server.kv.registry.quotas import GenerationAdmission, QuotaExceeded, TenantQuotas
from server.kv.registry.samples import registry_samples
from server.kv.registry.shared import SharedRegistry, open_registry
from server.kv.registry.sql import SessionRow, TierCount
from server.kv.registry.turn_watch import TurnWatch
from server.kv.settings import REGISTRY_FILE

log = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 60.0
"""Longest wait for the engine to apply drops when another replica's drops wake it."""
DELETE_SETTLE_S = 10.0
"""Longest wait of ``DELETE`` for the engine to remove the freed blocks' files (then it answers
``files_removed: false``; the engine removes them at its next step)."""
PREFETCH_WAIT_S = 1.0
"""Longest wait of ``prefetch`` for the engine's copy disk -> RAM (then it answers with the
blocks in RAM so far; the copy goes on)."""
PREFETCH_BUSY_WAIT_S = 0.05
"""The same while the engine generates: its one-token request may wait for a batch slot, and
a caller never needs the copy to have finished (the next turn loads what is still on disk)."""


class SessionNotFound(LookupError):
    """No such session for this tenant (HTTP 404)."""


class SessionExists(ValueError):
    """The target session id is taken (HTTP 409); pass overwrite=True to replace it."""


__all__ = [
    "UNSET",
    "InvalidSessionId",
    "QuotaExceeded",
    "RegistryUnavailable",
    "Session",
    "SessionControl",
    "SessionExists",
    "SessionNotFound",
    "TierUsage",
    "Unset",
]


class SessionControl:
    """Session lifecycle over the registry, plus prefetch through the engine's request queue."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        default_ttl_s: float | None = None,
        engine_client: object | None = None,
        redis_url: str | None = None,
        namespace: str = "default",
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.default_ttl_s = default_ttl_s
        self.engine_client = engine_client
        self.registry = open_registry(
            self.cache_dir / REGISTRY_FILE, redis_url=redis_url, namespace=namespace
        )
        """Sessions in the SQLite file, or in Redis (shared by the replicas) with
        ``redis_url``; this replica's block locations and counters in the file either way."""
        self.quotas = quotas or TenantQuotas()
        """Per-tenant bounds checked before a change is recorded (:mod:`.quotas`)."""
        self.admission = GenerationAdmission(self.registry, self.quotas)
        """The session quota of generations that name a new session."""
        self.turns = TurnWatch()
        """This process's turns whose records the registry may not show yet; the request
        middleware reports every generation of a named session to it."""
        self._watcher: DropWatcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The event loop the engine client runs on (built inside it, as the app does)."""
        if engine_client is not None:
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()

    # ----------------------------------------------------------------- queries

    def list(
        self, tenant: str, *, limit: int = 100, offset: int = 0, after: str | None = None
    ) -> list[Session]:
        """A tenant's live sessions, most recently used first (see :meth:`page`)."""
        return self.page(tenant, limit=limit, offset=offset, after=after)[0]

    def page(
        self, tenant: str, *, limit: int = 100, offset: int = 0, after: str | None = None
    ) -> tuple[list[Session], str | None]:
        """A page of a tenant's live sessions, most recently used first, and the cursor of the
        next page (None after the last). ``after`` is a cursor a page returned (keyset paging,
        the same cost on every page); ``offset`` skips rows after it (kept for older clients:
        its cost grows with the offset). ValueError for a malformed cursor."""
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must be >= 0")
        if after is not None:
            parse_session_cursor(after)
        self.catch_up(tenant)
        rows = self.registry.list_sessions(tenant, limit, offset, after=after)
        cursor = session_cursor(rows[-1]) if rows and len(rows) == limit else None
        return [self._info(r) for r in rows if _readable(r) and not _expired(r)], cursor

    def get(self, session_id: str, tenant: str) -> Session:
        """One session; :class:`SessionNotFound` if unknown, expired or another tenant's."""
        check_session_id(session_id)
        self.catch_up(tenant, session_id)
        return self._info(self._row(session_id, tenant))

    # --------------------------------------------------------------- mutations

    def create(
        self,
        session_id: str,
        tenant: str,
        *,
        ttl_seconds: float | None = None,
        pinned: bool = False,
    ) -> Session:
        """Create an empty session; :class:`SessionExists` if the id is taken."""
        check_session_id(session_id)
        check_ttl(ttl_seconds)
        ttl = ttl_seconds if ttl_seconds is not None else self.default_ttl_s
        self.catch_up(tenant, session_id)
        self.quotas.check_new_session(self.registry, tenant)
        if pinned:
            self.quotas.check_pin(self.registry, tenant, session_id, None, time.time())
        created = self.registry.create_session(tenant, session_id, ttl_seconds=ttl, pinned=pinned)
        self.admission.forget(tenant)  # after the change: no count read before it stays
        if not created:
            raise SessionExists(f"session {session_id!r} already exists")
        return self._info(self._row(session_id, tenant))

    def update(
        self,
        session_id: str,
        tenant: str,
        *,
        ttl_seconds: float | Unset | None = UNSET,
        pinned: bool | None = None,
        pin_ttl_seconds: float | None = None,
    ) -> Session:
        """Change TTL (None removes it) and/or the pin; ``pin_ttl_seconds`` pins for that long
        (a lease, renewed by each pin) and implies ``pinned``."""
        check_session_id(session_id)
        set_ttl = not isinstance(ttl_seconds, Unset)
        ttl = None if isinstance(ttl_seconds, Unset) else check_ttl(ttl_seconds)
        lease = check_ttl(pin_ttl_seconds, field="pin_ttl_seconds")
        pinned = check_pin_update(pinned, lease)
        self.quotas.check_lease(lease)
        self.catch_up(tenant, session_id)
        if pinned:
            self._row(session_id, tenant)  # 404 first
            self.quotas.check_pin(self.registry, tenant, session_id, lease, time.time())
        if not self.registry.update_session(
            tenant, session_id, set_ttl=set_ttl, ttl_seconds=ttl, pinned=pinned, pin_ttl_s=lease
        ):
            raise SessionNotFound(f"session {session_id!r} not found")
        return self._info(self._row(session_id, tenant))

    def delete(self, session_id: str, tenant: str) -> int:
        """Delete a session and free its blocks no other session uses; return how many.

        Records the delete; the engine drops the freed blocks and removes their files at its
        next step, or at once through :meth:`settle` (see the module docstring).
        """
        check_session_id(session_id)
        self.catch_up(tenant, session_id)  # no late record of a served turn brings it back
        orphans = self.registry.delete_session(tenant, session_id)
        self.admission.forget(tenant)
        if orphans is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return len(orphans)

    async def settle(self, timeout_s: float | None = None) -> bool:
        """Have the engine apply recorded deletes and expiries now; returns True once the freed
        blocks are out of every tier and their files are gone (no engine: at once), False when
        the engine did not confirm within ``timeout_s`` (it goes on, and applies them at its
        next step anyway)."""
        op = asyncio.ensure_future(self._engine_op(SYNC_OP, {}))
        try:
            await asyncio.wait_for(asyncio.shield(op), timeout_s)
        except TimeoutError:
            log.warning("the engine did not apply a delete within %.0f s; it will", timeout_s)
            return False
        return True

    def copy(
        self, source_id: str, target_id: str, tenant: str, *, overwrite: bool = False
    ) -> Session:
        """Fork a session: the target gets the source's block list (blocks are shared)."""
        check_session_id(source_id)
        check_session_id(target_id)
        if source_id == target_id:
            raise SessionExists(f"session {target_id!r} is the source itself")
        self.catch_up(tenant, source_id)
        self.catch_up(tenant, target_id)
        if self.registry.get_session(tenant, target_id) is None:
            self.quotas.check_new_session(self.registry, tenant)
        result = self.registry.copy_session(tenant, source_id, target_id, overwrite=overwrite)
        self.admission.forget(tenant)
        if result == "no_source":
            raise SessionNotFound(f"session {source_id!r} not found")
        if result == "target_exists":
            raise SessionExists(
                f"session {target_id!r} already exists; pass overwrite=true to replace it"
            )
        return self._info(self._row(target_id, tenant))

    async def prefetch(
        self, session_id: str, tenant: str, *, wait_s: float | None = None
    ) -> dict[str, int]:
        """Move the session's blocks disk -> RAM in the engine now; return block counts (the
        blocks in RAM when the copy finished, or after ``wait_s``, by default
        :data:`PREFETCH_WAIT_S`, or :data:`PREFETCH_BUSY_WAIT_S` while generations run: the
        copy goes on). Registry calls run in a worker thread, never on the event loop."""
        check_session_id(session_id)
        if wait_s is None:
            wait_s = PREFETCH_BUSY_WAIT_S if self.turns.generating() else PREFETCH_WAIT_S
        row = await asyncio.to_thread(self._prefetch_row, session_id, tenant)
        if row.num_blocks:
            op = asyncio.ensure_future(
                self._engine_op(PREFETCH_OP, {XARG_SESSION: session_id, XARG_TENANT: tenant})
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(op), wait_s)
        usage = await asyncio.to_thread(self.registry.tier_usage, tenant, session_id)
        return {"blocks": row.num_blocks, "ram_blocks": usage["ram"].blocks}

    def _prefetch_row(self, session_id: str, tenant: str) -> SessionRow:
        self.catch_up(tenant, session_id)  # its first turn may be finishing right now
        row = self._row(session_id, tenant)
        if row.managed or self.quotas.may_mark_managed(self.registry, tenant, session_id):
            self.registry.mark_managed(tenant, session_id)
        return row

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of the registry (:func:`.samples.registry_samples`)."""
        return registry_samples(self.registry)

    def watch_drops(self) -> None:
        """With sessions in Redis: wake this replica's engine (a ``sync``) whenever any
        replica records drops, so an idle engine removes the freed blocks at once rather than
        at its next request. Call on the engine client's event loop; no-op without Redis."""
        if not isinstance(self.registry, SharedRegistry) or self._watcher is not None:
            return
        loop = self._loop

        def wake() -> None:
            if loop is not None and not loop.is_closed():
                future = asyncio.run_coroutine_threadsafe(self.settle(), loop)
                with contextlib.suppress(Exception):
                    future.result(timeout=SETTLE_TIMEOUT_S)

        self._watcher = DropWatcher(self.registry.sessions, wake)

    def close(self) -> None:
        """Stop the drops watcher; close the registry connections."""
        if self._watcher is not None:
            self._watcher.close()
        with contextlib.suppress(Exception):
            self.registry.close()

    def catch_up(self, tenant: str, session_id: str | None = None) -> None:
        """Wait until the registry shows every turn of the session (every session of
        ``tenant`` when ``session_id`` is None) that this process served before the call
        (:class:`TurnWatch`; bounded, and free when none is pending). Never waits for the
        engine's queue. Raises :class:`RegistryUnavailable` first when the sessions' Redis
        does not answer."""
        self.registry.ping()  # Redis down: RegistryUnavailable (503) now
        self.turns.wait(tenant, session_id, self._last_used)

    def _last_used(self, tenant: str, session_id: str) -> float | None:
        row = self.registry.get_session(tenant, session_id)
        return None if row is None else row.last_used_at

    # ----------------------------------------------------------------- helpers

    async def _engine_op(self, op: str, args: dict[str, str]) -> None:
        """Run a control operation in the engine as a one-token request (see the module doc)."""
        if self.engine_client is None:
            return
        from vllm import SamplingParams  # the API process has vLLM loaded already

        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, extra_args={XARG_OP: op, **args}
        )
        generate = self.engine_client.generate  # type: ignore[attr-defined]
        async for _ in generate({"prompt_token_ids": [0]}, params, f"lgkv-{op}-{uuid.uuid4().hex}"):
            pass

    def _row(self, session_id: str, tenant: str) -> SessionRow:
        row = self.registry.get_session(tenant, session_id)
        if row is None or not _readable(row) or _expired(row):
            raise SessionNotFound(f"session {session_id!r} not found")
        return row

    def _info(self, row: SessionRow) -> Session:
        usage: dict[str, TierCount] = self.registry.tier_usage(row.tenant, row.id)
        pinned = row.pinned_at(time.time())
        return Session(
            id=row.id,
            tenant=row.tenant,
            num_tokens=row.num_tokens,
            num_blocks=row.num_blocks,
            turns=row.turns,
            created_at=row.created_at,
            last_used_at=row.last_used_at,
            pinned=pinned,
            ttl_seconds=row.ttl_seconds,
            expires_at=row.expires_at,
            pin_expires_at=row.pin_until if pinned else None,
            tiers={k: TierUsage(v.blocks, v.bytes) for k, v in usage.items()},
        )


def _readable(row: SessionRow) -> bool:
    """False (and one warning) for a stored row no answer can carry: a non-finite time or TTL
    (written by an older version); such a session is skipped, never breaks a listing."""
    values = (row.created_at, row.last_used_at, row.ttl_seconds)
    if all(v is None or math.isfinite(v) for v in values):
        return True
    log.warning(
        "session registry: skipping session %r of tenant %r: non-finite time or TTL %r "
        "(delete it with DELETE /v1/sessions/%s)",
        row.id, row.tenant, values, row.id,
    )  # fmt: skip
    return False


def _expired(row: SessionRow) -> bool:
    """Past its TTL: gone for every reader, though the engine may not have purged it yet."""
    return row.expires_at is not None and row.expires_at < time.time()
