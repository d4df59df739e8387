"""The HTTP session API (contracts.md section 4) over :class:`server.kv.control.SessionControl`.

Routes sit under ``/v1`` and so behind the same bearer-key check as the OpenAI routes; each
request acts for its own tenant (a session of another tenant is a 404). Registry calls are
blocking SQLite work and run in a worker thread. With ``--no-kv-offload`` every route answers
503.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from server.api.protocol import (
    APIError,
    PrefetchOut,
    SessionCopy,
    SessionCreate,
    SessionDeletedOut,
    SessionListOut,
    SessionOut,
    SessionUpdate,
    body_schema,
    check_session_id,
    error_responses,
    parse_body,
)

if TYPE_CHECKING:
    from server.kv.control import SessionControl

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
    from server.kv.control import InvalidSessionId, SessionExists, SessionNotFound

    try:
        return await runner(*args, **kwargs)
    except SessionNotFound as exc:
        raise APIError(404, str(exc) or "no such session") from exc
    except SessionExists as exc:
        raise APIError(409, str(exc) or "the session exists") from exc
    except InvalidSessionId as exc:
        raise APIError(400, str(exc)) from exc
    except ValueError as exc:  # the registry's own argument checks (e.g. a TTL <= 0)
        raise APIError(400, str(exc)) from exc


def _session(info: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(info.to_dict(), status_code=status)


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


@router.get("", response_model=SessionListOut)
async def list_sessions(request: Request) -> JSONResponse:
    """``GET /v1/sessions?limit=100&offset=0``: this tenant's sessions, most recent first."""
    control = _control(request)
    limit = _int_param(request, "limit", 100, 1, 1000)
    offset = _int_param(request, "offset", 0, 0, 2**31)
    infos = await _call(control.list, _tenant(request), limit=limit, offset=offset)
    return JSONResponse({"object": "list", "data": [i.to_dict() for i in infos]})


@router.post(
    "",
    status_code=201,
    response_model=SessionOut,
    responses=error_responses(409, 422),
    openapi_extra=body_schema(SessionCreate),
)
async def create_session(request: Request) -> JSONResponse:
    """``POST /v1/sessions`` -> 201 Session; 409 when the id exists."""
    control = _control(request)
    body = cast(SessionCreate, parse_body(SessionCreate, await request.body()))
    sid = check_session_id(body.id, field="id")
    info = await _call(
        control.create, sid, _tenant(request), ttl_seconds=body.ttl_seconds, pinned=body.pinned
    )
    return _session(info, 201)


@router.get("/{session_id}", response_model=SessionOut, responses=_ONE)
async def get_session(session_id: str, request: Request) -> JSONResponse:
    """``GET /v1/sessions/{id}``; 404 when unknown."""
    control = _control(request)
    check_session_id(session_id)
    return _session(await _call(control.get, session_id, _tenant(request)))


@router.patch(
    "/{session_id}",
    response_model=SessionOut,
    responses=error_responses(404, 422),
    openapi_extra=body_schema(SessionUpdate),
)
async def update_session(session_id: str, request: Request) -> JSONResponse:
    """``PATCH /v1/sessions/{id}`` with ``ttl_seconds`` and/or ``pinned``."""
    from server.kv.control import UNSET

    control = _control(request)
    check_session_id(session_id)
    body = cast(SessionUpdate, parse_body(SessionUpdate, await request.body()))
    ttl = body.ttl_seconds if "ttl_seconds" in body.model_fields_set else UNSET
    info = await _call(
        control.update, session_id, _tenant(request), ttl_seconds=ttl, pinned=body.pinned
    )
    return _session(info)


@router.delete("/{session_id}", response_model=SessionDeletedOut, responses=_ONE)
async def delete_session(session_id: str, request: Request) -> JSONResponse:
    """``DELETE /v1/sessions/{id}``: drop the session and the blocks only it used."""
    control = _control(request)
    check_session_id(session_id)
    freed = await _call(control.delete, session_id, _tenant(request))
    return JSONResponse(
        {"id": session_id, "object": "session.deleted", "deleted": True, "freed_blocks": freed}
    )


async def _set_pin(session_id: str, request: Request, pinned: bool) -> JSONResponse:
    control = _control(request)
    check_session_id(session_id)
    return _session(await _call(control.update, session_id, _tenant(request), pinned=pinned))


@router.post("/{session_id}/pin", response_model=SessionOut, responses=_ONE)
async def pin_session(session_id: str, request: Request) -> JSONResponse:
    """``POST /v1/sessions/{id}/pin``: never evict this session's blocks."""
    return await _set_pin(session_id, request, True)


@router.post("/{session_id}/unpin", response_model=SessionOut, responses=_ONE)
async def unpin_session(session_id: str, request: Request) -> JSONResponse:
    """``POST /v1/sessions/{id}/unpin``."""
    return await _set_pin(session_id, request, False)


@router.post("/{session_id}/prefetch", response_model=PrefetchOut, responses=_ONE)
async def prefetch_session(session_id: str, request: Request) -> JSONResponse:
    """``POST /v1/sessions/{id}/prefetch``: bring the session's blocks from disk into RAM."""
    control = _control(request)
    check_session_id(session_id)
    tenant = _tenant(request)
    result = await _guard(control.prefetch, session_id, tenant)
    return JSONResponse(
        {
            "id": session_id,
            "object": "session.prefetch",
            "blocks": int(result.get("blocks", 0)),
            "ram_blocks": int(result.get("ram_blocks", 0)),
        }
    )


@router.post(
    "/{session_id}/copy",
    status_code=201,
    response_model=SessionOut,
    responses=error_responses(404, 409, 422),
    openapi_extra=body_schema(SessionCopy),
)
async def copy_session(session_id: str, request: Request) -> JSONResponse:
    """``POST /v1/sessions/{id}/copy`` -> 201 the new session (blocks shared, not copied)."""
    control = _control(request)
    check_session_id(session_id)
    body = cast(SessionCopy, parse_body(SessionCopy, await request.body()))
    target = check_session_id(body.target_id, field="target_id")
    info = await _call(control.copy, session_id, target, _tenant(request), overwrite=body.overwrite)
    return _session(info, 201)
