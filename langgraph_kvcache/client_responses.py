"""What the session API clients read: answers checked and turned into the contract's types,
and failures turned into :mod:`langgraph_kvcache.errors` (no I/O).

:mod:`langgraph_kvcache.client` reads its answers with these; both clients share them, as they
share :mod:`.client_requests` for what they send.
"""

from __future__ import annotations

from typing import Any

import httpx

from langgraph_kvcache import errors
from langgraph_kvcache.contract import PrefetchResult, Session

__all__ = [
    "error_from",
    "freed_blocks",
    "json_object",
    "malformed",
    "prefetch_from",
    "session_from",
    "sessions_from",
    "unavailable",
]


def malformed(what: str, data: Any, exc: Exception) -> errors.SessionAPIError:
    return errors.SessionAPIError(
        f"Malformed {what} in the server's answer ({exc!r}): {str(data)[:200]}. "
        "Is the URL pointing at a langgraph-kvcache server of a matching version?",
        status_code=200,
        error_type="malformed_response",
    )


def error_from(response: httpx.Response) -> errors.KVCacheClientError:
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
        return errors.ServerUnavailableError(
            f"{response.request.url} answered HTTP {status}: {message}{hint}"
        )
    retry_after = response.headers.get("Retry-After", "")
    if status == 429 and retry_after.isdigit():  # a rate, not a quota: the call may succeed later
        return errors.RateLimitedError(
            f"{response.request.url} answered HTTP 429: {message}", float(retry_after)
        )
    if status == 401:
        message = (
            f"{message}. The server at {response.request.url.copy_with(path='/', query=None)} "
            "runs with --api-key: pass one of its keys (kv_api_key= to the saver, api_key= "
            "to the client, or set LGKV_API_KEY)"
        )
        return errors.AuthenticationError(message, status_code=status, error_type=error_type)
    by_status = {404: errors.SessionNotFoundError, 409: errors.SessionExistsError}
    cls = by_status.get(status, errors.SessionAPIError)
    return cls(message, status_code=status, error_type=error_type)


def unavailable(url: str, exc: httpx.HTTPError) -> errors.ServerUnavailableError:
    """What happened, and where: a timeout (the server may be busy, and the call may have
    taken effect) is not a refused connection (nothing listens there)."""
    if isinstance(exc, httpx.TimeoutException):
        timeout = exc.request.extensions.get("timeout", {}) if _has_request(exc) else {}
        limit = max((v for v in timeout.values() if v), default=None)
        within = f" within {limit:g} s" if limit else ""
        return errors.ServerUnavailableError(
            f"The langgraph-kvcache server at {url} did not answer{within} "
            f"({type(exc).__name__}); it may be busy, and the call may have taken effect. "
            "Retry, or raise the client's timeout."
        )
    return errors.ServerUnavailableError(
        f"Cannot reach the langgraph-kvcache server at {url} ({type(exc).__name__}: {exc}). "
        "Start it (`python -m server`) or set LGKV_SERVER_URL to where it runs."
    )


def _has_request(exc: httpx.HTTPError) -> bool:
    try:
        exc.request  # noqa: B018 (raises RuntimeError when the error carries none)
    except RuntimeError:
        return False
    return True


def json_object(response: httpx.Response) -> dict[str, Any]:
    if response.is_error:
        raise error_from(response)
    try:
        data = response.json()
    except ValueError as exc:
        raise malformed("JSON", response.text, exc) from exc
    if not isinstance(data, dict):
        raise malformed("JSON object", data, TypeError(type(data).__name__))
    return data


def session_from(data: dict[str, Any]) -> Session:
    try:
        return Session.from_dict(data)
    except ValueError as exc:
        raise malformed("Session", data, exc) from exc


def sessions_from(data: dict[str, Any]) -> tuple[list[Session], str | None]:
    items, cursor = data.get("data"), data.get("next_cursor")
    if not isinstance(items, list) or not (cursor is None or isinstance(cursor, str)):
        raise malformed("session list", data, KeyError("data"))
    return [session_from(item) for item in items], cursor


def freed_blocks(data: dict[str, Any]) -> int:
    try:
        return int(data["freed_blocks"])
    except (KeyError, TypeError, ValueError) as exc:
        raise malformed("delete answer", data, exc) from exc


def prefetch_from(data: dict[str, Any]) -> PrefetchResult:
    try:
        return PrefetchResult.from_dict(data)
    except ValueError as exc:
        raise malformed("prefetch answer", data, exc) from exc
