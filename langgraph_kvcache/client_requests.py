"""What the session API clients send: URLs, headers and request bodies (no I/O).

:mod:`langgraph_kvcache.client` builds its requests with these; both clients share them.
"""

from __future__ import annotations

import os
from typing import Any, Final
from urllib.parse import quote

from langgraph_kvcache.contract import SESSION_HEADER, check_ttl
from langgraph_kvcache.contract import Unset as _Unset
from langgraph_kvcache.sessions import validate_session_id

DEFAULT_SERVER_URL: Final = "http://127.0.0.1:8000"


def root_url(base_url: str | None) -> str:
    """Server root from a URL that may end in ``/`` or ``/v1`` (default: ``$LGKV_SERVER_URL``)."""
    url = (base_url or os.environ.get("LGKV_SERVER_URL") or DEFAULT_SERVER_URL).rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header for ``api_key`` (default: ``$LGKV_API_KEY``; none without a key)."""
    key = api_key if api_key is not None else os.environ.get("LGKV_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def session_path(session_id: str, action: str = "") -> str:
    """``/v1/sessions/<id>[/<action>]``, the id validated and quoted."""
    sid = quote(validate_session_id(session_id), safe="")
    return f"/v1/sessions/{sid}/{action}" if action else f"/v1/sessions/{sid}"


def session_headers(session_id: str | None) -> dict[str, str] | None:
    """The routing header of a request that names ``session_id`` (none for a list)."""
    return {SESSION_HEADER: validate_session_id(session_id)} if session_id else None


def create_body(session_id: str, ttl_seconds: float | None, pinned: bool) -> dict[str, Any]:
    """``POST /v1/sessions``."""
    return {
        "id": validate_session_id(session_id),
        "ttl_seconds": check_ttl(ttl_seconds),
        "pinned": pinned,
    }


def update_body(ttl_seconds: float | _Unset | None, pinned: bool | None) -> dict[str, Any]:
    """``PATCH /v1/sessions/{id}``: only the fields given."""
    body: dict[str, Any] = {}
    if not isinstance(ttl_seconds, _Unset):
        body["ttl_seconds"] = check_ttl(ttl_seconds)
    if pinned is not None:
        body["pinned"] = pinned
    return body


def pin_body(ttl_seconds: float | None) -> dict[str, Any] | None:
    """``POST /v1/sessions/{id}/pin``: a lease of ``ttl_seconds``, or no body (until unpinned)."""
    if ttl_seconds is None:
        return None
    return {"pin_ttl_seconds": check_ttl(ttl_seconds, field="ttl_seconds")}


def copy_body(target_id: str, overwrite: bool) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/copy``."""
    return {"target_id": validate_session_id(target_id), "overwrite": overwrite}


def list_path(limit: int, offset: int, after: str | None) -> str:
    """The listing's path and query."""
    path = f"/v1/sessions?limit={int(limit)}&offset={int(offset)}"
    return path + f"&after={quote(after, safe='')}" if after else path
