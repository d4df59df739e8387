"""The HTTP session API over :class:`server.kv.registry.control.SessionControl`.

Routes sit under ``/v1`` and so behind the same bearer-key check as the OpenAI routes; each
request acts for its own tenant (a session of another tenant is a 404). Registry calls are
blocking SQLite (or Redis) work and run in a worker thread; none waits behind generation (see
:mod:`server.kv.registry.control`). With ``--no-kv-offload`` every
route answers 503, and so does a route whose sessions' Redis (``--kv-redis-url``) is
unreachable (the message says so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

from fastapi import APIRouter, Path, Request
from starlette.concurrency import run_in_threadpool

from langgraph_kvcache.contract import (
    UNSET,
    InvalidSessionId,
    InvalidTTL,
    PrefetchResult,
    Session,
    SessionDeleted,
    SessionList,
)
from server.api.protocol import (
    SESSION_ID_SCHEMA,
    APIError,
    SessionCopy,
    SessionCreate,
    SessionPin,
    SessionUpdate,
    body_schema,
    check_session_id,
    error_responses,
    parse_body,
)

if TYPE_CHECKING:
    from server.kv.registry.control import SessionControl

T = TypeVar("T")
DEFAULT_SESSION_CALLS_PER_KEY = 8
"""Session API calls one tenant may have in flight (``--session-calls-per-key``)."""
router = APIRouter(
    prefix="/v1/sessions", tags=["sessions"], responses=error_responses(400, 401, 429, 503)
)
_ONE = error_responses(404)

OFFLOAD_OFF = (
    "the session API needs the KV offload connector, and this server runs with "
    "--no-kv-offload (plain vLLM prefix caching); restart it without that flag"
)


def _control(request: Request) -> SessionControl:
    control = getattr(request.app.state, "session_control", None)
    if control is None:
        raise APIError(503, OFFLOAD_OFF)
    return cast("SessionControl", control)


def _tenant(request: Request) -> str:
    return cast(str, request.app.state.key_ring.tenant(request.headers))


class TenantGate:
    """Session API calls in flight per tenant, so that one key cannot take every worker thread
    (Starlette's pool has 40): past ``limit`` a call gets 429 at once. Used on the event loop
    only, so a plain counter suffices."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: dict[str, int] = {}

    @contextlib.contextmanager
    def enter(self, tenant: str) -> Iterator[None]:
        """Count one call of ``tenant`` for the block's duration; 429 past the limit."""
        held = self._in_flight.get(tenant, 0)
        if held >= self.limit:
            raise APIError(
                429,
                f"this key has {held} session API calls in flight, the most the server "
                f"allows (--session-calls-per-key); wait for them and retry",
                retry_after=1,
            )
        self._in_flight[tenant] = held + 1
        try:
            yield
        finally:
            left = self._in_flight[tenant] - 1
            if left:
                self._in_flight[tenant] = left
            else:
                del self._in_flight[tenant]


def _gate(request: Request) -> TenantGate:
    state = request.app.state
    gate = getattr(state, "session_gate", None)
    if gate is None:
        config = getattr(state, "lgkv_config", None)
        limit = getattr(config, "session_calls_per_key", DEFAULT_SESSION_CALLS_PER_KEY)
        gate = state.session_gate = TenantGate(limit)
    return cast(TenantGate, gate)


async def _call(request: Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking control call in a thread (at most the per-key limit of them for the
    caller's tenant), mapping its errors to HTTP codes."""
    with _gate(request).enter(_tenant(request)):
        return cast(T, await _guard(run_in_threadpool, fn, *args, **kwargs))


async def _guard(runner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from server.kv.registry.control import (
        QuotaExceeded,
        RegistryUnavailable,
        SessionExists,
        SessionNotFound,
    )

    try:
        return await runner(*args, **kwargs)
    except QuotaExceeded as exc:  # a tenant quota: 409 (pins) or 429 (sessions)
        raise APIError(exc.status, str(exc)) from exc
    except RegistryUnavailable as exc:  # sessions in Redis, and Redis is down
        raise APIError(503, str(exc)) from exc
    except SessionNotFound as exc:
        raise APIError(404, str(exc) or "no such session") from exc
    except SessionExists as exc:
        raise APIError(409, str(exc) or "the session exists") from exc
    except (InvalidSessionId, InvalidTTL) as exc:
        raise APIError(400, str(exc)) from exc
    except ValueError as exc:  # the registry's own argument checks (e.g. a TTL <= 0)
        raise APIError(400, str(exc)) from exc


SessionId = Annotated[str, Path(description="The session id.", json_schema_extra=SESSION_ID_SCHEMA)]


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(400, f"query parameter {name} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise APIError(400, f"query parameter {name} must be in {lo}..{hi}, got {value}")
    return value


@router.get("", response_model=SessionList)
async def list_sessions(request: Request) -> SessionList:
    """``GET /v1/sessions?limit=100&after=<cursor>``: this tenant's sessions, most recent
    first; ``next_cursor`` continues the listing (``after``), null on the last page.
    ``offset`` still skips rows, at a cost that grows with it."""
    control = _control(request)
    limit = _int_param(request, "limit", 100, 1, 1000)
    offset = _int_param(request, "offset", 0, 0, 2**31)
    after = request.query_params.get("after") or None
    infos, cursor = await _call(
        request, control.page, _tenant(request), limit=limit, offset=offset, after=after
    )
    return SessionList(data=infos, next_cursor=cursor)


@router.post(
    "",
    status_code=201,
    response_model=Session,
    responses=error_responses(409, 422),
    openapi_extra=body_schema(SessionCreate),
)
async def create_session(request: Request) -> Session:
    """``POST /v1/sessions`` -> 201 Session; 409 when the id exists."""
    control = _control(request)
    body = cast(SessionCreate, parse_body(SessionCreate, await request.body()))
    sid = check_session_id(body.id, field="id")
    return await _call(
        request,
        control.create,
        sid,
        _tenant(request),
        ttl_seconds=body.ttl_seconds,
        pinned=body.pinned,
    )


@router.get("/{session_id}", response_model=Session, responses=_ONE)
async def get_session(session_id: SessionId, request: Request) -> Session:
    """``GET /v1/sessions/{id}``; 404 when unknown."""
    control = _control(request)
    check_session_id(session_id)
    return await _call(request, control.get, session_id, _tenant(request))


@router.patch(
    "/{session_id}",
    response_model=Session,
    responses=error_responses(404, 409, 422),
    openapi_extra=body_schema(SessionUpdate),
)
async def update_session(session_id: SessionId, request: Request) -> Session:
    """``PATCH /v1/sessions/{id}`` with ``ttl_seconds``, ``pinned`` and/or ``pin_ttl_seconds``
    (a pin lease; implies ``pinned``)."""
    control = _control(request)
    check_session_id(session_id)
    body = cast(SessionUpdate, parse_body(SessionUpdate, await request.body()))
    ttl = body.ttl_seconds if "ttl_seconds" in body.model_fields_set else UNSET
    return await _call(
        request,
        control.update,
        session_id,
        _tenant(request),
        ttl_seconds=ttl,
        pinned=body.pinned,
        pin_ttl_seconds=body.pin_ttl_seconds,
    )


@router.delete("/{session_id}", response_model=SessionDeleted, responses=_ONE)
async def delete_session(session_id: SessionId, request: Request) -> SessionDeleted:
    """``DELETE /v1/sessions/{id}``: drop the session and the blocks only it used."""
    control = _control(request)
    check_session_id(session_id)
    freed = await _call(request, control.delete, session_id, _tenant(request))
    removed = True
    if freed:  # the engine removes the blocks and their files before we answer (bounded)
        from server.kv.registry.control import DELETE_SETTLE_S

        removed = await control.settle(DELETE_SETTLE_S)
    return SessionDeleted(id=session_id, freed_blocks=freed, files_removed=removed)


async def _set_pin(
    session_id: str, request: Request, pinned: bool, pin_ttl: float | None = None
) -> Session:
    control = _control(request)
    check_session_id(session_id)
    return await _call(
        request,
        control.update,
        session_id,
        _tenant(request),
        pinned=pinned,
        pin_ttl_seconds=pin_ttl,
    )


@router.post(
    "/{session_id}/pin",
    response_model=Session,
    responses=error_responses(404, 409, 422),
    openapi_extra=body_schema(SessionPin, required=False),
)
async def pin_session(session_id: SessionId, request: Request) -> Session:
    """``POST /v1/sessions/{id}/pin``: keep this session's blocks (never evicted from disk,
    RAM left last); with ``{"pin_ttl_seconds": s}`` for ``s`` seconds only (a lease)."""
    body = cast(SessionPin, parse_body(SessionPin, await request.body(), empty_ok=True))
    return await _set_pin(session_id, request, True, body.pin_ttl_seconds)


@router.post("/{session_id}/unpin", response_model=Session, responses=_ONE)
async def unpin_session(session_id: SessionId, request: Request) -> Session:
    """``POST /v1/sessions/{id}/unpin`` (drops any lease)."""
    return await _set_pin(session_id, request, False)


@router.post("/{session_id}/prefetch", response_model=PrefetchResult, responses=_ONE)
async def prefetch_session(session_id: SessionId, request: Request) -> PrefetchResult:
    """``POST /v1/sessions/{id}/prefetch``: bring the session's blocks from disk into RAM."""
    control = _control(request)
    check_session_id(session_id)
    tenant = _tenant(request)
    with _gate(request).enter(tenant):
        counts = await _guard(control.prefetch, session_id, tenant)
    return PrefetchResult(session_id, blocks=counts["blocks"], ram_blocks=counts["ram_blocks"])


@router.post(
    "/{session_id}/copy",
    status_code=201,
    response_model=Session,
    responses=error_responses(404, 409, 422),
    openapi_extra=body_schema(SessionCopy),
)
async def copy_session(session_id: SessionId, request: Request) -> Session:
    """``POST /v1/sessions/{id}/copy`` -> 201 the new session (blocks shared, not copied)."""
    control = _control(request)
    check_session_id(session_id)
    body = cast(SessionCopy, parse_body(SessionCopy, await request.body()))
    target = check_session_id(body.target_id, field="target_id")
    tenant = _tenant(request)
    return await _call(request, control.copy, session_id, target, tenant, overwrite=body.overwrite)
