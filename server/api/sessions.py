"""The HTTP session API over :class:`server.kv.registry.control.SessionControl`.

Routes sit under ``/v1`` and so behind the same bearer-key check as the OpenAI routes; each
request acts for its own tenant (a session of another tenant is a 404). Registry calls are
blocking SQLite (or Redis) work and run in a worker thread. With ``--no-kv-offload`` every
route answers 503, and so does a route whose sessions' Redis (``--kv-redis-url``) is
unreachable (the message says so).
"""

from __future__ import annotations

from collections.abc import Callable
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
router = APIRouter(
    prefix="/v1/sessions", tags=["sessions"], responses=error_responses(400, 401, 503)
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


async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking control call in a thread, mapping its errors to HTTP codes."""
    return cast(T, await _guard(run_in_threadpool, fn, *args, **kwargs))


async def _guard(runner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from server.kv.registry.control import RegistryUnavailable, SessionExists, SessionNotFound

    try:
        return await runner(*args, **kwargs)
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
    """``GET /v1/sessions?limit=100&offset=0``: this tenant's sessions, most recent first."""
    control = _control(request)
    limit = _int_param(request, "limit", 100, 1, 1000)
    offset = _int_param(request, "offset", 0, 0, 2**31)
    infos = await _call(control.list, _tenant(request), limit=limit, offset=offset)
    return SessionList(data=infos)


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
        control.create, sid, _tenant(request), ttl_seconds=body.ttl_seconds, pinned=body.pinned
    )


@router.get("/{session_id}", response_model=Session, responses=_ONE)
async def get_session(session_id: SessionId, request: Request) -> Session:
    """``GET /v1/sessions/{id}``; 404 when unknown."""
    control = _control(request)
    check_session_id(session_id)
    return await _call(control.get, session_id, _tenant(request))


@router.patch(
    "/{session_id}",
    response_model=Session,
    responses=error_responses(404, 422),
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
    freed = await _call(control.delete, session_id, _tenant(request))
    if freed:
        await control.settle()  # the engine removes the blocks and their files before we answer
    return SessionDeleted(id=session_id, freed_blocks=freed)


async def _set_pin(
    session_id: str, request: Request, pinned: bool, pin_ttl: float | None = None
) -> Session:
    control = _control(request)
    check_session_id(session_id)
    return await _call(
        control.update, session_id, _tenant(request), pinned=pinned, pin_ttl_seconds=pin_ttl
    )


@router.post(
    "/{session_id}/pin",
    response_model=Session,
    responses=error_responses(404, 422),
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
    return await _call(control.copy, session_id, target, _tenant(request), overwrite=body.overwrite)
