"""Session control for the API process. No torch, no vLLM at import.

How the API process reaches the engine process
-----------------------------------------------
vLLM runs the scheduler (and our scheduler-side connector) in the engine-core process, often
not the API process, and that loop sleeps while it has no requests. Two channels connect them:

1. The registry (SQLite, WAL) for everything that must hold when a call returns. ``delete``
   removes the session's rows, unlinks the files of blocks no other session references, and
   appends those keys to the ``drops`` table; the engine's scheduler reads new drops before any
   lookup (and every step), so it can never serve a dropped block from its index, and frees the
   RAM slots. A missing file is a miss in any case, never a wrong answer. ``copy``, pins and
   TTLs are rows the engine re-reads (``PRAGMA data_version`` tells it when something changed).
2. The engine's own request queue for work that must run in the engine now: ``prefetch``
   submits a one-token request carrying ``extra_args={"lgkv_op": "prefetch", ...}`` through
   ``engine_client.generate``. This wakes an idle engine; the connector sees the op in
   ``get_num_new_matched_tokens``, moves the session's blocks disk -> RAM, holds the request
   until the copies finished, publishes block locations to the registry and lets the dummy
   request run (one token). ``collective_rpc`` was not used: it reaches workers only, not the
   scheduler that owns the index and the RAM slots.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from pathlib import Path

from langgraph_kvcache.contract import (
    PREFETCH_OP,
    UNSET,
    XARG_OP,
    XARG_SESSION,
    XARG_TENANT,
    InvalidSessionId,
    Session,
    TierUsage,
    Unset,
    check_session_id,
    check_ttl,
)
from server.kv.registry import Registry, SessionRow, TierCount
from server.kv.settings import REGISTRY_FILE
from server.kv.tiers.disk import remove_block_files

log = logging.getLogger(__name__)

_COUNTERS = (
    'lgkv_hit_blocks_total{tier="ram"}',
    'lgkv_hit_blocks_total{tier="disk"}',
    'lgkv_hit_blocks_total{tier="redis"}',
    "lgkv_miss_blocks_total",
    "lgkv_saved_blocks_total",
    "lgkv_load_seconds_sum",
    "lgkv_load_seconds_count",
    "lgkv_save_seconds_sum",
    "lgkv_save_seconds_count",
    'lgkv_evicted_blocks_total{tier="ram"}',
    'lgkv_evicted_blocks_total{tier="disk"}',
    'lgkv_evicted_blocks_total{tier="redis"}',
    'lgkv_tier_bytes{tier="ram"}',
    'lgkv_tier_bytes{tier="disk"}',
    'lgkv_tier_bytes{tier="redis"}',
    'lgkv_tier_blocks{tier="ram"}',
    'lgkv_tier_blocks{tier="disk"}',
    'lgkv_tier_blocks{tier="redis"}',
)


class SessionNotFound(LookupError):
    """No such session for this tenant (HTTP 404)."""


class SessionExists(ValueError):
    """The target session id is taken (HTTP 409); pass overwrite=True to replace it."""


__all__ = [
    "UNSET",
    "InvalidSessionId",
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
        disk_dir: Path | None = None,
        default_ttl_s: float | None = None,
        engine_client: object | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.disk_dir = Path(disk_dir) if disk_dir is not None else self.cache_dir / "blocks"
        self.default_ttl_s = default_ttl_s
        self.engine_client = engine_client
        self.registry = Registry(self.cache_dir / REGISTRY_FILE)

    # ----------------------------------------------------------------- queries

    def list(self, tenant: str, *, limit: int = 100, offset: int = 0) -> list[Session]:
        """A tenant's live sessions, most recently used first."""
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must be >= 0")
        self._purge()
        rows = self.registry.list_sessions(tenant, limit, offset)
        return [self._info(r) for r in rows if _readable(r)]

    def get(self, session_id: str, tenant: str) -> Session:
        """One session; :class:`SessionNotFound` if unknown, expired or another tenant's."""
        check_session_id(session_id)
        self._purge()
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
        self._purge()
        ttl = ttl_seconds if ttl_seconds is not None else self.default_ttl_s
        if not self.registry.create_session(tenant, session_id, ttl_seconds=ttl, pinned=pinned):
            raise SessionExists(f"session {session_id!r} already exists")
        return self.get(session_id, tenant)

    def update(
        self,
        session_id: str,
        tenant: str,
        *,
        ttl_seconds: float | Unset | None = UNSET,
        pinned: bool | None = None,
    ) -> Session:
        """Change TTL (None removes it) and/or the pin."""
        check_session_id(session_id)
        set_ttl = not isinstance(ttl_seconds, Unset)
        ttl = None if isinstance(ttl_seconds, Unset) else check_ttl(ttl_seconds)
        self._purge()
        if not self.registry.update_session(
            tenant, session_id, set_ttl=set_ttl, ttl_seconds=ttl, pinned=pinned
        ):
            raise SessionNotFound(f"session {session_id!r} not found")
        return self.get(session_id, tenant)

    def delete(self, session_id: str, tenant: str) -> int:
        """Delete a session and free its blocks no other session uses; return how many.

        The files of the freed blocks are unlinked before this returns; the engine drops the
        same blocks from RAM at its next step (see the module docstring).
        """
        check_session_id(session_id)
        orphans = self.registry.delete_session(tenant, session_id)
        if orphans is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        self._free(orphans)
        return len(orphans)

    def copy(
        self, source_id: str, target_id: str, tenant: str, *, overwrite: bool = False
    ) -> Session:
        """Fork a session: the target gets the source's block list (blocks are shared)."""
        check_session_id(source_id)
        check_session_id(target_id)
        self._purge()
        if source_id == target_id:
            raise SessionExists(f"session {target_id!r} is the source itself")
        result = self.registry.copy_session(tenant, source_id, target_id, overwrite=overwrite)
        if result == "no_source":
            raise SessionNotFound(f"session {source_id!r} not found")
        if result == "target_exists":
            raise SessionExists(
                f"session {target_id!r} already exists; pass overwrite=true to replace it"
            )
        return self.get(target_id, tenant)

    async def prefetch(self, session_id: str, tenant: str) -> dict[str, int]:
        """Move the session's blocks disk -> RAM in the engine now; return block counts."""
        check_session_id(session_id)
        self._purge()
        row = self._row(session_id, tenant)
        self.registry.mark_managed(tenant, session_id)
        if self.engine_client is not None and row.num_blocks:
            from vllm import SamplingParams  # the API process has vLLM loaded already

            params = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                extra_args={XARG_OP: PREFETCH_OP, XARG_SESSION: session_id, XARG_TENANT: tenant},
            )
            generate = self.engine_client.generate  # type: ignore[attr-defined]
            request_id = f"lgkv-prefetch-{uuid.uuid4().hex}"
            async for _ in generate({"prompt_token_ids": [0]}, params, request_id):
                pass
        usage = self.registry.tier_usage(tenant, session_id)
        return {"blocks": row.num_blocks, "ram_blocks": usage["ram"].blocks}

    def metrics(self) -> dict[str, float]:
        """Prometheus samples (engine counters from the registry)."""
        stored = self.registry.stats()
        out = {name: float(stored.get(name, 0.0)) for name in _COUNTERS}
        out["lgkv_sessions"] = float(self.registry.count_sessions())
        return out

    def close(self) -> None:
        """Close the registry connection."""
        with contextlib.suppress(Exception):
            self.registry.close()

    # ----------------------------------------------------------------- helpers

    def _row(self, session_id: str, tenant: str) -> SessionRow:
        row = self.registry.get_session(tenant, session_id)
        if row is None or not _readable(row):
            raise SessionNotFound(f"session {session_id!r} not found")
        return row

    def _info(self, row: SessionRow) -> Session:
        usage: dict[str, TierCount] = self.registry.tier_usage(row.tenant, row.id)
        return Session(
            id=row.id,
            tenant=row.tenant,
            num_tokens=row.num_tokens,
            num_blocks=row.num_blocks,
            turns=row.turns,
            created_at=row.created_at,
            last_used_at=row.last_used_at,
            pinned=row.pinned,
            ttl_seconds=row.ttl_seconds,
            expires_at=row.expires_at,
            tiers={k: TierUsage(v.blocks, v.bytes) for k, v in usage.items()},
        )

    def _purge(self) -> None:
        self._free(self.registry.purge_expired(time.time()))

    def _free(self, keys: list[str]) -> None:
        if keys:
            remove_block_files(self.disk_dir, keys)
            self.registry.add_drops(keys)


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
