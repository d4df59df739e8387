"""Name the session and tenant of chat/completion requests for the KV connector (contracts.md 1).

:class:`SessionRequestMiddleware` is a pure ASGI middleware in front of vLLM's own OpenAI routes.
It caps every request body (HTTP 413 past ``max_body_bytes``) and rewrites the JSON body of
``/v1/chat/completions`` and ``/v1/completions`` with :func:`rewrite_body`, so vLLM's serving
code receives ``vllm_xargs = {..., "session_id": sid, "tenant": tenant}`` (copied by vLLM into
``SamplingParams.extra_args``, where the connector reads them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.protocol import APIError, check_session_id, error_response

REWRITTEN_PATHS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_TENANT = "default"
SALT_PREFIX = "lgkv-"


def tenant_of_key(api_key: str) -> str:
    """The tenant of a bearer key: the first 16 hex characters of its sha256."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:16]


def tenant_from_headers(headers: Headers, api_keys: Sequence[str]) -> str:
    """``"default"`` when the server has no keys, else the tenant of the bearer key.

    Key checking itself is vLLM's authentication middleware (401 before any route runs); a
    request without a bearer token here gets an unusable tenant and is rejected there.
    """
    if not api_keys:
        return DEFAULT_TENANT
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "unauthenticated"
    return tenant_of_key(token)


def rewrite_body(body: dict[str, Any], tenant: str, *, salted: bool) -> dict[str, Any]:
    """Move the session named by ``prompt_cache_key``/``session_id``/``vllm_xargs.session_id``
    into ``vllm_xargs`` with the tenant, and salt the KV of keyed tenants.

    Raises:
        APIError: 400 when the names disagree, a session id is malformed or
            ``vllm_xargs`` is not an object.
    """
    out = dict(body)
    xargs = out.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    elif not isinstance(xargs, dict):
        raise APIError(400, "vllm_xargs must be a JSON object")
    xargs = dict(xargs)
    named: dict[str, object] = {}
    for field in ("prompt_cache_key", "session_id"):
        value = out.pop(field, None)
        if value is not None:
            named[field] = value
    if xargs.get("session_id") is not None:
        named["vllm_xargs.session_id"] = xargs["session_id"]
    for field, value in named.items():
        check_session_id(value, field=field)
    if len(set(named.values())) > 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in named.items())
        raise APIError(400, f"the request names two different sessions ({listed}); send one")
    if named:
        xargs["session_id"] = next(iter(named.values()))
    xargs["tenant"] = tenant
    out["vllm_xargs"] = xargs
    if salted:
        out["cache_salt"] = SALT_PREFIX + tenant
    return out


class _TooLarge(Exception):
    pass


class SessionRequestMiddleware:
    """Body size cap for every request plus :func:`rewrite_body` on the completion routes."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, api_keys: Sequence[str]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_keys = tuple(api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        try:
            body = await self._read(receive)
        except _TooLarge:
            await self._too_large(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in REWRITTEN_PATHS:
            try:
                body = self._rewrite(body, headers)
            except APIError as err:
                await error_response(err.status, err.message, err.type)(scope, receive, send)
                return
        scope = dict(scope)
        scope["headers"] = [
            (k, v) for k, v in scope["headers"] if k.lower() != b"content-length"
        ] + [(b"content-length", str(len(body)).encode())]
        await self.app(scope, _replay(body, receive), send)

    def _rewrite(self, body: bytes, headers: Headers) -> bytes:
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        tenant = tenant_from_headers(headers, self.api_keys)
        return json.dumps(rewrite_body(data, tenant, salted=bool(self.api_keys))).encode()

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        msg = f"request body over {limit} bytes; send less (the server's --max-body-bytes)"
        await error_response(413, msg)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: http.disconnect, as from the real connection

    return replay
