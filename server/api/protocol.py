"""Request bodies of the session API and the one JSON error shape of the server.

Errors are ``{"error": {"message": str, "type": str, "code": int}}`` (the shape vLLM's OpenAI
routes use too), raised as :class:`APIError` and rendered by :func:`api_error_handler`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from server.kv.control import SESSION_ID_RE  # the syntax of contracts.md 1 (no torch)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An HTTP error with a message that tells the client what to change."""

    def __init__(self, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _TYPES.get(status, "server_error")


def error_body(status: int, message: str, type_: str | None = None) -> dict[str, Any]:
    """The JSON error body for ``status``."""
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPES.get(status, "server_error"),
            "code": status,
        }
    }


def error_response(status: int, message: str, type_: str | None = None) -> JSONResponse:
    """A JSON error response."""
    return JSONResponse(error_body(status, message, type_), status_code=status)


async def api_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """FastAPI exception handler for :class:`APIError`."""
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.type)


def check_session_id(value: object, *, field: str = "session id") -> str:
    """Return ``value`` if it is a valid session id, else raise a 400 :class:`APIError`."""
    if not isinstance(value, str) or not SESSION_ID_RE.match(value):
        raise APIError(
            400,
            f"invalid {field} {value!r}: use 1-255 characters from A-Z a-z 0-9 . _ : @ | = + -,"
            " starting with a letter or digit",
        )
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SessionCreate(_Body):
    """``POST /v1/sessions``."""

    id: str
    ttl_seconds: float | None = Field(default=None, gt=0)
    pinned: bool = False


class SessionUpdate(_Body):
    """``PATCH /v1/sessions/{id}``; absent fields stay as they are."""

    ttl_seconds: float | None = Field(default=None, gt=0)
    pinned: bool | None = None


class SessionCopy(_Body):
    """``POST /v1/sessions/{id}/copy``."""

    target_id: str
    overwrite: bool = False


def parse_body(model: type[BaseModel], raw: bytes, *, empty_ok: bool = False) -> BaseModel:
    """Validate a JSON body against ``model``; 400 for bad JSON, 422 naming the bad fields."""
    if not raw.strip():
        if empty_ok:
            return model()
        raise APIError(422, f"a JSON object body is required ({_fields(model)})")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError(422, f"the body must be a JSON object ({_fields(model)})")
    # Ints are fine where floats are expected (strict mode would reject 60 for a float).
    for key, value in data.items():
        if key == "ttl_seconds" and isinstance(value, int) and not isinstance(value, bool):
            data[key] = float(value)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
            for err in exc.errors()
        )
        raise APIError(422, f"invalid body: {problems}") from exc


def _fields(model: type[BaseModel]) -> str:
    return "fields: " + ", ".join(model.model_fields)


# Response shapes, for the OpenAPI schema (the routes build the same JSON from SessionInfo).


class TierUsageOut(BaseModel):
    """What one tier holds of a session."""

    blocks: int
    bytes: int


class SessionOut(BaseModel):
    """A session: one conversation's KV (contracts.md section 4)."""

    id: str
    object: str = "session"
    tenant: str
    num_tokens: int
    num_blocks: int
    turns: int
    created_at: float
    last_used_at: float
    pinned: bool
    ttl_seconds: float | None
    expires_at: float | None
    tiers: dict[str, TierUsageOut] = Field(description='keys "ram", "disk", "redis"')


class SessionListOut(BaseModel):
    """``GET /v1/sessions``."""

    object: str = "list"
    data: list[SessionOut]


class SessionDeletedOut(BaseModel):
    """``DELETE /v1/sessions/{id}``."""

    id: str
    object: str = "session.deleted"
    deleted: bool = True
    freed_blocks: int


class PrefetchOut(BaseModel):
    """``POST /v1/sessions/{id}/prefetch``: blocks of the session, and how many are in RAM."""

    id: str
    object: str = "session.prefetch"
    blocks: int
    ram_blocks: int


class ErrorDetail(BaseModel):
    """The error itself."""

    message: str
    type: str
    code: int


class ErrorOut(BaseModel):
    """Every error the server answers: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorDetail


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a JSON body the route parses by hand (:func:`parse_body`)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the error codes a route can answer."""
    return {code: {"model": ErrorOut, "description": _TYPES.get(code, "error")} for code in codes}
