"""Which of vLLM's routes this server serves: an allow-list, so a route is refused unless named.

vLLM's app serves many routes; every one that reaches the engine must get its tenant, cache salt
and session from :mod:`server.api.auth` and the documented session fields
(:func:`server.api.generation_body.rewrite_body`), never from the body. Only
:data:`GENERATION_PATHS` are rewritten that way, so every other route that could reach the
engine is removed from the app (:func:`restrict_routes`): ``/v1/responses/{id}`` (a stored
response, not tenant-scoped), ``/v1/messages``, ``/v1/chat/completions/batch``,
SageMaker's ``/invocations``, ``/generative_scoring``, the disaggregation and elastic-EP
routes... and whatever a future vLLM adds. A removed route answers 404 with a message naming the
routes that are served.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import FastAPI
from starlette.routing import BaseRoute

log = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
"""Routes that reach the engine; their bodies are rewritten with the caller's tenant. The
Responses API is served without stored responses (``previous_response_id``, ``background``
get 400: vLLM's store is one process's memory, shared by every tenant)."""

ENGINE_FREE_PATHS = frozenset(
    {
        "/health",
        "/metrics",
        "/load",
        "/version",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)
"""vLLM routes kept that never reach the engine's KV (no generation, no cache)."""

SESSION_PREFIX = "/v1/sessions"
"""The session API (:mod:`server.api.sessions`), ours, tenant-scoped."""


def is_session_path(path: str) -> bool:
    """Whether ``path`` is the session API's (``/v1/sessions`` or below it)."""
    return path == SESSION_PREFIX or path.startswith(SESSION_PREFIX + "/")


def is_served(path: str) -> bool:
    """Whether a route path (as declared, e.g. ``/v1/sessions/{session_id}``) is served."""
    return path in GENERATION_PATHS or path in ENGINE_FREE_PATHS or is_session_path(path)


def restrict_routes(app: FastAPI) -> list[str]:
    """Remove every route :func:`is_served` does not name; return the removed paths."""
    kept: list[BaseRoute] = []
    removed: list[str] = []
    for route in app.router.routes:
        path = getattr(route, "path", None)
        if isinstance(path, str) and is_served(path):
            kept.append(route)
        else:
            removed.append(str(path))
    app.router.routes[:] = kept
    if removed:
        log.debug("routes not served (refused with 404): %s", ", ".join(sorted(set(removed))))
    return removed


def served_summary(paths: Iterable[str] = GENERATION_PATHS) -> str:
    """The generation routes, for error messages."""
    return ", ".join(sorted(paths))
