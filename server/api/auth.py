"""Who is asking: bearer keys, tenants and the paths that need no key.

With API keys configured every path needs a valid ``Authorization: Bearer <key>`` except
:data:`PUBLIC_PATHS` (``/health``; ``/metrics`` too when the operator opts in with
``--metrics-public``) and real CORS preflights (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``; :func:`is_preflight`), which the CORS layer answers itself.
The check runs in :class:`server.api.chat.SessionRequestMiddleware` before any body is read, so
a request without a key gets 401 whatever it sends. Without keys there is one tenant, ``default``.

A tenant is derived from its key (:func:`tenant_of_key`) and is not a secret: it appears in
session objects. Nothing in a request body chooses it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

from starlette.datastructures import Headers

from langgraph_kvcache.contract import DEFAULT_TENANT

PUBLIC_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"


def tenant_of_key(api_key: str) -> str:
    """The tenant of a bearer key: the first 16 hex characters of its sha256."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:16]


def is_preflight(headers: Headers | None) -> bool:
    """A CORS preflight carries both ``Origin`` and ``Access-Control-Request-Method`` (an
    ``OPTIONS`` without ``Origin`` goes past Starlette's CORS layer to the route itself)."""
    return (
        headers is not None and "origin" in headers and "access-control-request-method" in headers
    )


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else ``None``."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyRing:
    """The server's API keys; answers whether a request may pass and whose it is.

    Keys are compared by their sha256 digests in constant time (as vLLM's own middleware does).
    """

    def __init__(self, api_keys: Sequence[str], *, metrics_public: bool = False) -> None:
        self._digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in api_keys]
        self.public_paths = PUBLIC_PATHS | ({METRICS_PATH} if metrics_public else set())

    @property
    def enabled(self) -> bool:
        """Whether the server has keys at all (else everyone is tenant ``default``)."""
        return bool(self._digests)

    def needs_key(self, path: str, method: str, headers: Headers | None = None) -> bool:
        """Whether ``method path`` must carry a valid key: every request but the public paths
        and a real CORS preflight (:func:`is_preflight`: ``OPTIONS`` with ``Origin`` and
        ``Access-Control-Request-Method``, which vLLM's CORS layer answers without reaching a
        route). Any other ``OPTIONS`` needs the key like ``GET``."""
        if not self._digests or (method == "OPTIONS" and is_preflight(headers)):
            return False
        return not any(path == p or path.startswith(p + "/") for p in self.public_paths)

    def valid(self, headers: Headers) -> bool:
        """Whether the request carries one of the keys."""
        token = bearer_token(headers)
        if token is None:
            return False
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        match = False
        for known in self._digests:
            match |= secrets.compare_digest(digest, known)
        return match

    def tenant(self, headers: Headers) -> str:
        """The tenant of an authenticated request (``default`` when there are no keys).

        Call only after :meth:`valid` passed (the middleware does); without a token it answers
        ``"unauthenticated"``, which owns nothing.
        """
        if not self._digests:
            return DEFAULT_TENANT
        token = bearer_token(headers)
        return tenant_of_key(token) if token is not None else "unauthenticated"
