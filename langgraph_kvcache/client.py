"""A small httpx client (sync and async) for the server's session API.

```python
with KVCacheClient("http://127.0.0.1:8000") as kv:
    kv.pin("thread-1")
    print(kv.get_session("thread-1").tiers["disk"].bytes)
```

Every request that names a session sends it in the ``X-Session-ID`` header too
(:data:`langgraph_kvcache.contract.SESSION_HEADER`), so a router in front of several replicas
(``vllm-router --policy consistent_hash``) sends a session's calls where its chat requests go.

Errors form one hierarchy under :class:`KVCacheClientError`:

- :class:`SessionNotFoundError` (HTTP 404), :class:`SessionExistsError` (HTTP 409),
  :class:`AuthenticationError` (HTTP 401: a missing or wrong API key) and every other
  error answer (:class:`SessionAPIError`, carrying the server's message and status code);
- :class:`ServerUnavailableError`: the server could not be reached, timed out, or answered
  502/503/504; :class:`RateLimitedError` (one of them): HTTP 429 with ``Retry-After``, the
  key's session API rate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Final

import httpx

from langgraph_kvcache.client_requests import (
    auth_headers,
    copy_body,
    create_body,
    list_path,
    pin_body,
    root_url,
    session_headers,
    session_path,
    update_body,
)
from langgraph_kvcache.client_responses import (
    freed_blocks,
    json_object,
    prefetch_from,
    session_from,
    sessions_from,
    unavailable,
)
from langgraph_kvcache.contract import UNSET, PrefetchResult, Session, TierUsage
from langgraph_kvcache.contract import Unset as _Unset
from langgraph_kvcache.errors import (
    AuthenticationError,
    KVCacheClientError,
    RateLimitedError,
    ServerUnavailableError,
    SessionAPIError,
    SessionExistsError,
    SessionNotFoundError,
)

__all__ = [
    "UNSET",
    "AsyncKVCacheClient",
    "AuthenticationError",
    "KVCacheClient",
    "KVCacheClientError",
    "PrefetchResult",
    "RateLimitedError",
    "ServerUnavailableError",
    "Session",
    "SessionAPIError",
    "SessionExistsError",
    "SessionNotFoundError",
    "TierUsage",
]

DEFAULT_TIMEOUT_S: Final = 30.0


# ----------------------------------------------------------------------------- clients
class KVCacheClient:
    """Synchronous client for the session API.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted);
            default: env ``LGKV_SERVER_URL``, else ``http://127.0.0.1:8000``.
        api_key: bearer key when the server runs with ``--api-key``; default: env
            ``LGKV_API_KEY``. The key also selects the tenant whose sessions you see.
        timeout: seconds per request (connect, read and write).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.base_url = root_url(base_url)
        self._http = httpx.Client(
            base_url=self.base_url, headers=auth_headers(api_key), timeout=timeout
        )

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        session: str | None = None,
    ) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=body, headers=session_headers(session))
        except httpx.HTTPError as exc:  # connect errors, timeouts, protocol errors
            raise unavailable(self.base_url, exc) from exc
        return json_object(response)

    def list_sessions(
        self, *, limit: int = 100, offset: int = 0, after: str | None = None
    ) -> list[Session]:
        """This tenant's sessions, most recent first: at most ``limit`` of them after the
        cursor ``after`` (from :meth:`iter_sessions`' pages) and ``offset`` more."""
        return sessions_from(self._call("GET", list_path(limit, offset, after)))[0]

    def iter_sessions(self, *, page_size: int = 100) -> Iterator[Session]:
        """Every session of this tenant, most recent first, a page at a time (keyset paging:
        each page costs the server the same however far the listing got)."""
        after: str | None = None
        while True:
            page, after = sessions_from(self._call("GET", list_path(page_size, 0, after)))
            yield from page
            if after is None:
                return

    def get_session(self, session_id: str) -> Session:
        """One session; raises :class:`SessionNotFoundError` if unknown."""
        return session_from(self._call("GET", session_path(session_id), session=session_id))

    def create_session(
        self, session_id: str, *, ttl_seconds: float | None = None, pinned: bool = False
    ) -> Session:
        """Create an empty session; raises :class:`SessionExistsError` if it exists."""
        body = create_body(session_id, ttl_seconds, pinned)
        return session_from(self._call("POST", "/v1/sessions", body, session=session_id))

    def update_session(
        self,
        session_id: str,
        *,
        ttl_seconds: float | _Unset | None = UNSET,
        pinned: bool | None = None,
    ) -> Session:
        """Change TTL (``None``: never expire) and/or pin state; omitted fields stay as they are."""
        body = update_body(ttl_seconds, pinned)
        return session_from(self._call("PATCH", session_path(session_id), body, session=session_id))

    def delete_session(self, session_id: str) -> int:
        """Delete a session and its KV (blocks no other session uses); returns blocks freed."""
        return freed_blocks(self._call("DELETE", session_path(session_id), session=session_id))

    def pin(self, session_id: str, *, ttl_seconds: float | None = None) -> Session:
        """Pin a session: its blocks are not evicted (its TTL still applies). With
        ``ttl_seconds``, for that long only (a lease; pinning again renews it)."""
        body = pin_body(ttl_seconds)
        return session_from(
            self._call("POST", session_path(session_id, "pin"), body, session=session_id)
        )

    def unpin(self, session_id: str) -> Session:
        """Unpin a session (any lease too): it is evicted like any other again."""
        return session_from(
            self._call("POST", session_path(session_id, "unpin"), session=session_id)
        )

    def prefetch(self, session_id: str) -> PrefetchResult:
        """Load a session's KV from disk into RAM now, ahead of its next request."""
        return prefetch_from(
            self._call("POST", session_path(session_id, "prefetch"), session=session_id)
        )

    def copy_session(self, source_id: str, target_id: str, *, overwrite: bool = False) -> Session:
        """Fork ``source_id`` into ``target_id`` (blocks are shared, not copied); return the copy.

        Raises :class:`SessionNotFoundError` if the source is unknown and
        :class:`SessionExistsError` if the target exists and ``overwrite`` is false.
        """
        body = copy_body(target_id, overwrite)
        return session_from(
            self._call("POST", session_path(source_id, "copy"), body, session=source_id)
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncKVCacheClient:
    """Asynchronous twin of :class:`KVCacheClient` (same arguments, methods and errors)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.base_url = root_url(base_url)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=auth_headers(api_key), timeout=timeout
        )

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        session: str | None = None,
    ) -> dict[str, Any]:
        try:
            response = await self._http.request(
                method, path, json=body, headers=session_headers(session)
            )
        except httpx.HTTPError as exc:
            raise unavailable(self.base_url, exc) from exc
        return json_object(response)

    async def list_sessions(
        self, *, limit: int = 100, offset: int = 0, after: str | None = None
    ) -> list[Session]:
        """See :meth:`KVCacheClient.list_sessions`."""
        return sessions_from(await self._call("GET", list_path(limit, offset, after)))[0]

    async def iter_sessions(self, *, page_size: int = 100) -> AsyncIterator[Session]:
        """See :meth:`KVCacheClient.iter_sessions`."""
        after: str | None = None
        while True:
            page, after = sessions_from(await self._call("GET", list_path(page_size, 0, after)))
            for session in page:
                yield session
            if after is None:
                return

    async def get_session(self, session_id: str) -> Session:
        """See :meth:`KVCacheClient.get_session`."""
        return session_from(await self._call("GET", session_path(session_id), session=session_id))

    async def create_session(
        self, session_id: str, *, ttl_seconds: float | None = None, pinned: bool = False
    ) -> Session:
        """See :meth:`KVCacheClient.create_session`."""
        body = create_body(session_id, ttl_seconds, pinned)
        return session_from(await self._call("POST", "/v1/sessions", body, session=session_id))

    async def update_session(
        self,
        session_id: str,
        *,
        ttl_seconds: float | _Unset | None = UNSET,
        pinned: bool | None = None,
    ) -> Session:
        """See :meth:`KVCacheClient.update_session`."""
        body = update_body(ttl_seconds, pinned)
        return session_from(
            await self._call("PATCH", session_path(session_id), body, session=session_id)
        )

    async def delete_session(self, session_id: str) -> int:
        """See :meth:`KVCacheClient.delete_session`."""
        return freed_blocks(
            await self._call("DELETE", session_path(session_id), session=session_id)
        )

    async def pin(self, session_id: str, *, ttl_seconds: float | None = None) -> Session:
        """See :meth:`KVCacheClient.pin`."""
        path, body = session_path(session_id, "pin"), pin_body(ttl_seconds)
        return session_from(await self._call("POST", path, body, session=session_id))

    async def unpin(self, session_id: str) -> Session:
        """See :meth:`KVCacheClient.unpin`."""
        return session_from(
            await self._call("POST", session_path(session_id, "unpin"), session=session_id)
        )

    async def prefetch(self, session_id: str) -> PrefetchResult:
        """See :meth:`KVCacheClient.prefetch`."""
        path = session_path(session_id, "prefetch")
        return prefetch_from(await self._call("POST", path, session=session_id))

    async def copy_session(
        self, source_id: str, target_id: str, *, overwrite: bool = False
    ) -> Session:
        """See :meth:`KVCacheClient.copy_session`."""
        body = copy_body(target_id, overwrite)
        return session_from(
            await self._call("POST", session_path(source_id, "copy"), body, session=source_id)
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
