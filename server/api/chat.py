"""Authenticate, cap and sanitise every request; name the session and tenant of generations.

:class:`SessionRequestMiddleware` is a pure ASGI middleware in front of vLLM's own routes. For
every request, in this order and before any route runs:

1. with API keys configured, a path that is not public needs a valid bearer key: 401 before the
   body is read (:class:`server.api.auth.KeyRing`);
2. the body is capped (413 past ``max_body_bytes``), and a JSON body nesting deeper than
   :data:`server.api.body_check.MAX_JSON_DEPTH` gets 400 (read from the bytes before any parse:
   :func:`server.api.json_body.nesting_depth`); bodies over :data:`INLINE_BODY_BYTES` are
   checked and rewritten in a child process, off the server's GIL
   (:mod:`server.api.body_check`), and a key
   may have one body over :data:`LARGE_BODY_BYTES` in flight (429 before the next is read)
   and, with several keys, send bodies over :data:`INLINE_BODY_BYTES` at
   ``--tenant-body-rate`` bytes per second and make ``--tenant-session-rate`` session API
   calls per second (:mod:`server.api.body_budget`);
   with several keys, each key's generations fill at most its share of vLLM's batch
   (:mod:`server.api.fair_share`);
3. the JSON body of the generation routes (:data:`server.api.routes.GENERATION_PATHS`) is
   rewritten by :func:`server.api.generation_body.rewrite_body`, so vLLM's serving code receives
   ``vllm_xargs = {..., "session_id": sid, "tenant": tenant}`` (copied by vLLM into
   ``SamplingParams.extra_args``, where the connector reads them) and, with keys, a
   ``cache_salt`` that starts with the tenant's own salt.

Every response carries the ``X-LGKV-Replica`` header
(:data:`langgraph_kvcache.contract.REPLICA_HEADER`) naming the replica that answered.

Routes that could reach the engine without this rewrite are not served at all
(:func:`server.api.routes.restrict_routes`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from langgraph_kvcache.contract import REPLICA_HEADER, REUSE_EXACT
from server.api.auth import KeyRing, is_preflight
from server.api.body_budget import BodyBudget, CallBudget
from server.api.body_check import BodyChecker, check_body
from server.api.protocol import APIError, error_response
from server.api.routes import GENERATION_PATHS, SESSION_PREFIX, is_session_path
from server.kv.registry.api import RegistryUnavailable
from server.kv.registry.quotas import QuotaExceeded

if TYPE_CHECKING:
    from server.api.fair_share import GenerationGate
    from server.kv.registry.control import SessionControl

log = logging.getLogger(__name__)

INLINE_BODY_BYTES = 64 << 10
"""Bodies up to this size are checked and rewritten on the event loop (well under a
millisecond); larger ones in the body check process (:mod:`server.api.body_check`)."""
LARGE_BODY_BYTES = 1 << 20
"""A key may have one body over this size in flight at a time (more get 429 before their body
is read): parsing them (here and again in vLLM) takes CPU and the GIL from every tenant."""
REFUSAL_HOLD_S = 1.0
"""A large body refused (another of its key's in flight, or past ``--tenant-body-rate``) is
answered after this long, or after the wait it was refused for when that is shorter, its
body still unread: a client that retries at once then costs one connection and header parse
per second per connection, not hundreds (benchmarks/tenants.py, phase (a): 4,080 refusals in
one phase). Holding costs the event loop nothing."""
MAX_HELD_REFUSALS = 64
"""At most this many refusals are held at once; further ones are answered at once."""
UNAUTHORIZED = (
    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with a key the "
    "server was started with (--api-key / LGKV_API_KEY)"
)


class _TooLarge(Exception):
    pass


class SessionRequestMiddleware:
    """Key check, body cap, JSON depth bound and :func:`rewrite_body`; the replica header on
    every response (see the module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        keys: KeyRing,
        replica: str = "",
        body_budget: BodyBudget | None = None,
        call_budget: CallBudget | None = None,
        reuse: str = REUSE_EXACT,
    ) -> None:
        self.app = app
        self.reuse = reuse
        """How a request that does not say reuses its session's KV (``--kv-reuse``)."""
        self.max_body_bytes = max_body_bytes
        self.keys = keys
        self.body_budget = body_budget
        """Large-body bytes per key per second (several keys only), or None."""
        self.call_budget = call_budget
        """Session API calls per key per second (several keys only), or None."""
        self.replica = (REPLICA_HEADER.lower().encode(), replica.encode("ascii"))
        self._large_by_key: set[str] = set()
        """Tenants with a body over :data:`LARGE_BODY_BYTES` in flight."""
        self._held = 0
        """Refusals being held (:data:`REFUSAL_HOLD_S`)."""
        self._checker = BodyChecker(reuse=reuse)
        """Checks large bodies where the app has no child process (before its lifespan
        started one, or after it ended): closed at once, so in a worker thread."""
        self._checker.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and self.replica[1]:
            send = _with_header(send, self.replica)
        headers = Headers(scope=scope)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope.get("method", "GET")
        if self.keys.needs_key(path, method, headers) and not self.keys.valid(headers):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
                return
            await error_response(401, UNAUTHORIZED)(scope, receive, send)
            return
        if method == "OPTIONS" and not is_preflight(headers):
            await _options(scope, receive, send)  # CORS preflights go on to vLLM's CORS layer
            return
        if self.call_budget is not None and method != "OPTIONS" and is_session_path(path):
            wait_s = self.call_budget.take(self.keys.tenant(headers), 1)
            if wait_s > 0:  # past --tenant-session-rate: 429, held (see REFUSAL_HOLD_S)
                msg, retry = self.call_budget.refusal(wait_s)
                await self._refuse(scope, receive, send, msg, retry, min(wait_s, REFUSAL_HOLD_S))
                return
        if scope["type"] != "http" or method in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length")
        size = int(declared) if declared is not None and declared.isdigit() else 0
        if size > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        if size > LARGE_BODY_BYTES and self.keys.enabled:  # one at a time per key
            tenant = self.keys.tenant(headers)
            if tenant in self._large_by_key:
                msg = (
                    f"this key has a request body over {LARGE_BODY_BYTES} bytes in flight; "
                    "send large bodies one at a time"
                )
                await self._refuse(scope, receive, send, msg, None, REFUSAL_HOLD_S)
                return
            if await self._over_rate(scope, receive, send, headers, size):
                return
            self._large_by_key.add(tenant)
            try:
                await self._checked(scope, receive, send, headers, path)
            finally:
                self._large_by_key.discard(tenant)
            return
        if size > INLINE_BODY_BYTES and await self._over_rate(scope, receive, send, headers, size):
            return
        await self._checked(scope, receive, send, headers, path)

    async def _over_rate(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, size: int
    ) -> bool:
        """Charge a large body to the key's ``--tenant-body-rate``; past it answer 429 with
        ``Retry-After`` (the body unread) and return True. Called once a body would otherwise
        go on, so a refusal for another reason charges nothing."""
        if self.body_budget is None:
            return False
        wait_s = self.body_budget.take(self.keys.tenant(headers), size)
        if not wait_s:
            return False
        msg, retry = self.body_budget.refusal(wait_s)
        await self._refuse(scope, receive, send, msg, retry, min(wait_s, REFUSAL_HOLD_S))
        return True

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        message: str,
        retry_after: int | None,
        hold_s: float,
    ) -> None:
        """429 for a large body, held ``hold_s`` first while fewer than
        :data:`MAX_HELD_REFUSALS` are (see :data:`REFUSAL_HOLD_S`)."""
        if hold_s > 0 and self._held < MAX_HELD_REFUSALS:
            self._held += 1
            try:
                await asyncio.sleep(hold_s)
            finally:
                self._held -= 1
        await _unread(429, message, "rate_limit_error", retry_after)(scope, receive, send)

    async def _checked(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, path: str
    ) -> None:
        """Read, check and rewrite the body (see the module doc), then serve the request."""
        try:
            body = await self._read(receive)
            tenant = self.keys.tenant(headers)
            is_json = "json" in headers.get("content-type", "") or path.startswith(SESSION_PREFIX)
            checker = _body_checker(scope)
            if len(body) <= INLINE_BODY_BYTES:
                limit = checker.max_prompt_tokens if checker is not None else None
                body, sid = check_body(body, path, is_json, tenant, salted=self.keys.enabled,
                                       reuse=self.reuse, max_prompt_tokens=limit)  # fmt: skip
            else:  # off the server's GIL (server.api.body_check)
                checker = checker or self._checker
                body, sid = await checker.check(body, path, is_json, tenant,
                                                salted=self.keys.enabled)  # fmt: skip
            session = (tenant, sid) if sid is not None else None
        except _TooLarge:
            await self._too_large(scope, receive, send)
            return
        except APIError as err:
            await error_response(err.status, err.message, err.type)(scope, receive, send)
            return
        scope = dict(scope)
        scope["headers"] = [
            (k, v) for k, v in scope["headers"] if k.lower() != b"content-length"
        ] + [(b"content-length", str(len(body)).encode())]
        gate = _generation_gate(scope) if path in GENERATION_PATHS else None
        if gate is not None:
            try:
                async with gate.slot(self.keys.tenant(headers)):
                    await self._serve(scope, receive, send, body, session)
            except APIError as err:  # 429: too many of the key's generations waiting
                await error_response(err.status, err.message, err.type)(scope, receive, send)
            return
        await self._serve(scope, receive, send, body, session)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        session: tuple[str, str] | None,
    ) -> None:
        """Pass the checked request on to vLLM; a generation that names a session is admitted
        by the tenant's session quota and reported to the session API's turn watch."""
        control = _session_control(scope) if session is not None else None
        if control is None or session is None:
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            await control.admission.admit(*session)  # a new session past the tenant's quota
        except QuotaExceeded as exc:
            await error_response(exc.status, str(exc))(scope, receive, send)
            return
        except RegistryUnavailable as exc:  # generation goes on; the engine records later
            log.warning("session quota not checked: %s", exc)
        turns = control.turns
        started, status = turns.started(*session), [0]
        try:
            await self.app(scope, _replay(body, receive), _status_of(send, status))
        finally:  # the session API waits for this turn's record (server.kv.registry.turn_watch)
            turns.finished(*session, started, ok=status[0] == 200)

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
        await _unread(413, msg)(scope, receive, send)


def _unread(
    status: int, message: str, type_: str | None = None, retry_after: int | None = None
) -> JSONResponse:
    """An error answered before (or instead of) reading the whole body: the connection closes
    after it, so the server never reads, nor keeps draining, the bytes the client still sends
    (a client that retries at once paid the server a full body read per refusal: 2,247 refused
    2 MiB bodies in one phase of benchmarks/tenants.py)."""
    response = error_response(status, message, type_)
    response.headers["Connection"] = "close"
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


async def _options(scope: Scope, receive: Receive, send: Send) -> None:
    """``OPTIONS path``: 204 with an ``Allow`` header naming every method the path serves
    (all routes of the path together, which Starlette's 405 does not), 404 if none."""
    from starlette.responses import Response
    from starlette.routing import Match

    methods: set[str] = set()
    router = getattr(scope.get("app"), "router", None)
    for route in getattr(router, "routes", ()):
        match, _ = route.matches({**scope, "method": "GET"})
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    if not methods:
        await error_response(404, f"{scope['path']} is not served here")(scope, receive, send)
        return
    allow = ", ".join(sorted(methods | {"OPTIONS"}))
    await Response(status_code=204, headers={"Allow": allow})(scope, receive, send)


def _generation_gate(scope: Scope) -> GenerationGate | None:
    """The per-tenant share of vLLM's batch (None: no bound; see :mod:`.fair_share`)."""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "generation_gate", None)


def _body_checker(scope: Scope) -> BodyChecker | None:
    """The app's large-body checker (started with the engine; None before)."""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "body_checker", None)


def _session_control(scope: Scope) -> SessionControl | None:
    """The session control of the app serving ``scope`` (None without the KV connector)."""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "session_control", None)


def _status_of(send: Send, status: list[int]) -> Send:
    """``send`` that notes the response's status code in ``status[0]``."""

    async def noting(message: Message) -> None:
        if message["type"] == "http.response.start":
            status[0] = int(message["status"])
        await send(message)

    return noting


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    """``send`` that adds ``header`` to the response's start message."""

    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        await send(message)

    return tagged


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later: http.disconnect, as from the real connection

    return replay
