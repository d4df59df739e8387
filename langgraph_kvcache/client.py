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
  502/503/504.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Final
from urllib.parse import quote

import httpx

from langgraph_kvcache.client_requests import (
    auth_headers,
    copy_body,
    create_body,
    pin_body,
    root_url,
    session_headers,
    session_path,
    update_body,
)
from langgraph_kvcache.contract import UNSET, PrefetchResult, Session, TierUsage
from langgraph_kvcache.contract import Unset as _Unset
from langgraph_kvcache.errors import (
    AuthenticationError,
    KVCacheClientError,
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
    "ServerUnavailableError",
    "Session",
    "SessionAPIError",
    "SessionExistsError",
    "SessionNotFoundError",
    "TierUsage",
]

DEFAULT_TIMEOUT_S: Final = 30.0


def _malformed(what: str, data: Any, exc: Exception) -> SessionAPIError:
    return SessionAPIError(
        f"Malformed {what} in the server's answer ({exc!r}): {str(data)[:200]}. "
        "Is the URL pointing at a langgraph-kvcache server of a matching version?",
        status_code=200,
        error_type="malformed_response",
    )


def _error_from(response: httpx.Response) -> KVCacheClientError:
    status = response.status_code
    message, error_type = response.text[:500] or response.reason_phrase, ""
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            error_type = str(err.get("type") or "")
        elif "detail" in payload:  # FastAPI's own validation errors
            message = str(payload["detail"])
    if status in (502, 503, 504):
        hint = "" if error_type else " (starting, overloaded or behind a failing proxy: retry)"
        return ServerUnavailableError(
            f"{response.request.url} answered HTTP {status}: {message}{hint}"
        )
    if status == 401:
        message = (
            f"{message}. The server at {response.request.url.copy_with(path='/', query=None)} "
            "runs with --api-key: pass one of its keys (kv_api_key= to the saver, api_key= "
            "to the client, or set LGKV_API_KEY)"
        )
        return AuthenticationError(message, status_code=status, error_type=error_type)
    cls = {404: SessionNotFoundError, 409: SessionExistsError}.get(status, SessionAPIError)
    return cls(message, status_code=status, error_type=error_type)


def _unavailable(url: str, exc: httpx.HTTPError) -> ServerUnavailableError:
    """What happened, and where: a timeout (the server may be busy, and the call may have
    taken effect) is not a refused connection (nothing listens there)."""
    if isinstance(exc, httpx.TimeoutException):
        timeout = exc.request.extensions.get("timeout", {}) if _has_request(exc) else {}
        limit = max((v for v in timeout.values() if v), default=None)
        within = f" within {limit:g} s" if limit else ""
        return ServerUnavailableError(
            f"The langgraph-kvcache server at {url} did not answer{within} "
            f"({type(exc).__name__}); it may be busy, and the call may have taken effect. "
            "Retry, or raise the client's timeout."
        )
    return ServerUnavailableError(
        f"Cannot reach the langgraph-kvcache server at {url} ({type(exc).__name__}: {exc}). "
        "Start it (`python -m server`) or set LGKV_SERVER_URL to where it runs."
    )


def _has_request(exc: httpx.HTTPError) -> bool:
    try:
        exc.request  # noqa: B018 (raises RuntimeError when the error carries none)
    except RuntimeError:
        return False
    return True


def _json(response: httpx.Response) -> dict[str, Any]:
    if response.is_error:
        raise _error_from(response)
    try:
        data = response.json()
    except ValueError as exc:
        raise _malformed("JSON", response.text, exc) from exc
    if not isinstance(data, dict):
        raise _malformed("JSON object", data, TypeError(type(data).__name__))
    return data


def _session(data: dict[str, Any]) -> Session:
    try:
        return Session.from_dict(data)
    except ValueError as exc:
        raise _malformed("Session", data, exc) from exc


def list_path(limit: int, offset: int, after: str | None) -> str:
    """The listing's path and query."""
    path = f"/v1/sessions?limit={int(limit)}&offset={int(offset)}"
    return path + f"&after={quote(after, safe='')}" if after else path


def _sessions(data: dict[str, Any]) -> tuple[list[Session], str | None]:
    items, cursor = data.get("data"), data.get("next_cursor")
    if not isinstance(items, list) or not (cursor is None or isinstance(cursor, str)):
        raise _malformed("session list", data, KeyError("data"))
    return [_session(item) for item in items], cursor


def _freed(data: dict[str, Any]) -> int:
    try:
        return int(data["freed_blocks"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed("delete answer", data, exc) from exc


def _prefetch(data: dict[str, Any]) -> PrefetchResult:
    try:
        return PrefetchResult.from_dict(data)
    except ValueError as exc:
        raise _malformed("prefetch answer", data, exc) from exc


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
            raise _unavailable(self.base_url, exc) from exc
        return _json(response)

    def list_sessions(
        self, *, limit: int = 100, offset: int = 0, after: str | None = None
    ) -> list[Session]:
        """This tenant's sessions, most recent first: at most ``limit`` of them after the
        cursor ``after`` (from :meth:`iter_sessions`' pages) and ``offset`` more."""
        return _sessions(self._call("GET", list_path(limit, offset, after)))[0]

    def iter_sessions(self, *, page_size: int = 100) -> Iterator[Session]:
        """Every session of this tenant, most recent first, a page at a time (keyset paging:
        each page costs the server the same however far the listing got)."""
        after: str | None = None
        while True:
            page, after = _sessions(self._call("GET", list_path(page_size, 0, after)))
            yield from page
            if after is None:
                return

    def get_session(self, session_id: str) -> Session:
        """One session; raises :class:`SessionNotFoundError` if unknown."""
        return _session(self._call("GET", session_path(session_id), session=session_id))

    def create_session(
        self, session_id: str, *, ttl_seconds: float | None = None, pinned: bool = False
    ) -> Session:
        """Create an empty session; raises :class:`SessionExistsError` if it exists."""
        body = create_body(session_id, ttl_seconds, pinned)
        return _session(self._call("POST", "/v1/sessions", body, session=session_id))

    def update_session(
        self,
        session_id: str,
        *,
        ttl_seconds: float | _Unset | None = UNSET,
        pinned: bool | None = None,
    ) -> Session:
        """Change TTL (``None``: never expire) and/or pin state; omitted fields stay as they are."""
        body = update_body(ttl_seconds, pinned)
        return _session(self._call("PATCH", session_path(session_id), body, session=session_id))

    def delete_session(self, session_id: str) -> int:
        """Delete a session and its KV (blocks no other session uses); returns blocks freed."""
        return _freed(self._call("DELETE", session_path(session_id), session=session_id))

    def pin(self, session_id: str, *, ttl_seconds: float | None = None) -> Session:
        """Pin a session: its blocks are not evicted (its TTL still applies). With
        ``ttl_seconds``, for that long only (a lease; pinning again renews it)."""
        body = pin_body(ttl_seconds)
        return _session(
            self._call("POST", session_path(session_id, "pin"), body, session=session_id)
        )

    def unpin(self, session_id: str) -> Session:
        """Unpin a session (any lease too): it is evicted like any other again."""
        return _session(self._call("POST", session_path(session_id, "unpin"), session=session_id))

    def prefetch(self, session_id: str) -> PrefetchResult:
        """Load a session's KV from disk into RAM now, ahead of its next request."""
        return _prefetch(
            self._call("POST", session_path(session_id, "prefetch"), session=session_id)
        )

    def copy_session(self, source_id: str, target_id: str, *, overwrite: bool = False) -> Session:
        """Fork ``source_id`` into ``target_id`` (blocks are shared, not copied); return the copy.

        Raises :class:`SessionNotFoundError` if the source is unknown and
        :class:`SessionExistsError` if the target exists and ``overwrite`` is false.
        """
        body = copy_body(target_id, overwrite)
        return _session(
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
            raise _unavailable(self.base_url, exc) from exc
        return _json(response)

    async def list_sessions(
        self, *, limit: int = 100, offset: int = 0, after: str | None = None
    ) -> list[Session]:
        """See :meth:`KVCacheClient.list_sessions`."""
        return _sessions(await self._call("GET", list_path(limit, offset, after)))[0]

    async def iter_sessions(self, *, page_size: int = 100) -> AsyncIterator[Session]:
        """See :meth:`KVCacheClient.iter_sessions`."""
        after: str | None = None
        while True:
            page, after = _sessions(await self._call("GET", list_path(page_size, 0, after)))
            for session in page:
                yield session
            if after is None:
                return

    async def get_session(self, session_id: str) -> Session:
        """See :meth:`KVCacheClient.get_session`."""
        return _session(await self._call("GET", session_path(session_id), session=session_id))

    async def create_session(
        self, session_id: str, *, ttl_seconds: float | None = None, pinned: bool = False
    ) -> Session:
        """See :meth:`KVCacheClient.create_session`."""
        body = create_body(session_id, ttl_seconds, pinned)
        return _session(await self._call("POST", "/v1/sessions", body, session=session_id))

    async def update_session(
        self,
        session_id: str,
        *,
        ttl_seconds: float | _Unset | None = UNSET,
        pinned: bool | None = None,
    ) -> Session:
        """See :meth:`KVCacheClient.update_session`."""
        body = update_body(ttl_seconds, pinned)
        return _session(
            await self._call("PATCH", session_path(session_id), body, session=session_id)
        )

    async def delete_session(self, session_id: str) -> int:
        """See :meth:`KVCacheClient.delete_session`."""
        return _freed(await self._call("DELETE", session_path(session_id), session=session_id))

    async def pin(self, session_id: str, *, ttl_seconds: float | None = None) -> Session:
        """See :meth:`KVCacheClient.pin`."""
        path, body = session_path(session_id, "pin"), pin_body(ttl_seconds)
        return _session(await self._call("POST", path, body, session=session_id))

    async def unpin(self, session_id: str) -> Session:
        """See :meth:`KVCacheClient.unpin`."""
        return _session(
            await self._call("POST", session_path(session_id, "unpin"), session=session_id)
        )

    async def prefetch(self, session_id: str) -> PrefetchResult:
        """See :meth:`KVCacheClient.prefetch`."""
        path = session_path(session_id, "prefetch")
        return _prefetch(await self._call("POST", path, session=session_id))

    async def copy_session(
        self, source_id: str, target_id: str, *, overwrite: bool = False
    ) -> Session:
        """See :meth:`KVCacheClient.copy_session`."""
        body = copy_body(target_id, overwrite)
        return _session(
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
