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

from langgraph_kvcache.contract import (
    MAX_TTL_SECONDS,
    MIN_TTL_SECONDS,
    SESSION_ID_PATTERN,
    InvalidSessionId,
)
from langgraph_kvcache.contract import check_session_id as _check_session_id

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An HTTP error with a message that tells the client what to change."""

    def __init__(
        self, status: int, message: str, type_: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _TYPES.get(status, "server_error")
        self.retry_after = retry_after
        """Seconds for a ``Retry-After`` header (a refusal that passes with time), or None."""


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
    response = error_response(exc.status, exc.message, exc.type)
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


SESSION_ID_SCHEMA: dict[str, Any] = {
    "pattern": SESSION_ID_PATTERN.pattern,
    "minLength": 1,
    "maxLength": 255,
}
"""JSON Schema of a session id, for the OpenAPI document (the routes check ids themselves and
answer 400 naming the rule)."""


def check_session_id(value: object, *, field: str = "session id") -> str:
    """Return ``value`` if it is a valid session id, else raise a 400 :class:`APIError`."""
    try:
        return _check_session_id(value, field=field)
    except InvalidSessionId as exc:
        raise APIError(400, str(exc)) from None


def _ttl_field(default: Any = None) -> Any:
    return Field(
        default=default,
        ge=MIN_TTL_SECONDS,
        le=MAX_TTL_SECONDS,
        allow_inf_nan=False,
        description=(
            f"Seconds of idle time before the session expires, {MIN_TTL_SECONDS:g} to "
            f"{MAX_TTL_SECONDS:g}; null: never."
        ),
    )


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SessionCreate(_Body):
    """``POST /v1/sessions``."""

    id: str = Field(json_schema_extra=SESSION_ID_SCHEMA)
    ttl_seconds: float | None = _ttl_field()
    pinned: bool = False


def _pin_ttl_field() -> Any:
    return Field(
        default=None,
        ge=MIN_TTL_SECONDS,
        le=MAX_TTL_SECONDS,
        allow_inf_nan=False,
        description=(
            "Pin as a lease: the session stays pinned this many seconds "
            f"({MIN_TTL_SECONDS:g} to {MAX_TTL_SECONDS:g}), then is an ordinary session again; "
            "each pin renews it. Null or absent: pinned until unpinned."
        ),
    )


class SessionUpdate(_Body):
    """``PATCH /v1/sessions/{id}``; absent fields stay as they are. A pin lease
    (``pin_ttl_seconds``) with ``"pinned": false`` contradicts itself: the schema excludes it
    and the server answers 400 (:func:`~langgraph_kvcache.contract.check_pin_update`)."""

    model_config = ConfigDict(  # merged with _Body's (extra="forbid", strict)
        json_schema_extra={
            "not": {
                "required": ["pinned", "pin_ttl_seconds"],
                "properties": {"pinned": {"const": False}, "pin_ttl_seconds": {"type": "number"}},
            }
        },
    )

    ttl_seconds: float | None = _ttl_field()
    pinned: bool | None = None
    pin_ttl_seconds: float | None = _pin_ttl_field()


class SessionPin(_Body):
    """``POST /v1/sessions/{id}/pin`` (the body is optional)."""

    pin_ttl_seconds: float | None = _pin_ttl_field()


class SessionCopy(_Body):
    """``POST /v1/sessions/{id}/copy``."""

    target_id: str = Field(json_schema_extra=SESSION_ID_SCHEMA)
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
        if (
            key in ("ttl_seconds", "pin_ttl_seconds")
            and isinstance(value, int)
            and not isinstance(value, bool)
        ):
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


class ErrorDetail(BaseModel):
    """The error itself."""

    message: str
    type: str
    code: int


class ErrorOut(BaseModel):
    """Every error the server answers: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorDetail


def body_schema(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` documenting a JSON body the route parses by hand (:func:`parse_body`)."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the error codes a route can answer."""
    return {code: {"model": ErrorOut, "description": _TYPES.get(code, "error")} for code in codes}
