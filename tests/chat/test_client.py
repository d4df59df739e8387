"""KVCacheClient / AsyncKVCacheClient: requests sent, answers parsed, errors mapped.

The server side is the recording HTTP server of conftest.py with scripted answers in the shapes
of the session API (``langgraph_kvcache.contract``).
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from langgraph_kvcache import AsyncKVCacheClient, KVCacheClient
from langgraph_kvcache.client import (
    UNSET,
    AuthenticationError,
    KVCacheClientError,
    PrefetchResult,
    ServerUnavailableError,
    Session,
    SessionAPIError,
    SessionExistsError,
    SessionNotFoundError,
    TierUsage,
)
from langgraph_kvcache.contract import SESSION_HEADER
from langgraph_kvcache.errors import KVCacheError


def session_json(sid: str = "t1", **over: Any) -> dict[str, Any]:
    body = {
        "id": sid,
        "object": "session",
        "tenant": "default",
        "num_tokens": 300,
        "num_blocks": 3,
        "turns": 2,
        "created_at": 1700000000.5,
        "last_used_at": 1700000100.25,
        "pinned": False,
        "ttl_seconds": 3600.0,
        "expires_at": 1700003700.25,
        "tiers": {
            "ram": {"blocks": 2, "bytes": 4096},
            "disk": {"blocks": 3, "bytes": 6144},
            "redis": {"blocks": 0, "bytes": 0},
        },
    }
    body.update(over)
    return body


def error_json(message: str, code: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- requests + parsing
def test_every_endpoint_sends_the_contract_request(recorder: Any) -> None:
    r = recorder
    r.queue_answer(200, {"object": "list", "data": [session_json("a"), session_json("b")]})
    r.queue_answer(200, session_json("t1|sub"))
    r.queue_answer(201, session_json("new", pinned=True, ttl_seconds=None, expires_at=None))
    r.queue_answer(200, session_json("t1", ttl_seconds=60.0))
    r.queue_answer(200, session_json("t1", pinned=True))
    r.queue_answer(200, session_json("t1", pinned=False))
    r.queue_answer(200, {"id": "t1", "object": "session.prefetch", "blocks": 3, "ram_blocks": 3})
    r.queue_answer(201, session_json("fork"))
    r.queue_answer(
        200, {"id": "t1", "object": "session.deleted", "deleted": True, "freed_blocks": 2}
    )

    with KVCacheClient(f"{r.url}/v1/", api_key="sk-test") as kv:
        listed = kv.list_sessions(limit=5, offset=10)
        got = kv.get_session("t1|sub")
        created = kv.create_session("new", ttl_seconds=None, pinned=True)
        updated = kv.update_session("t1", ttl_seconds=60.0)
        pinned = kv.pin("t1")
        unpinned = kv.unpin("t1")
        prefetched = kv.prefetch("t1")
        forked = kv.copy_session("t1", "fork")
        freed = kv.delete_session("t1")

    sent = [(q.method, q.path, q.body) for q in r.requests]
    assert sent == [
        ("GET", "/v1/sessions?limit=5&offset=10", None),
        ("GET", "/v1/sessions/t1%7Csub", None),
        ("POST", "/v1/sessions", {"id": "new", "ttl_seconds": None, "pinned": True}),
        ("PATCH", "/v1/sessions/t1", {"ttl_seconds": 60.0}),
        ("POST", "/v1/sessions/t1/pin", None),
        ("POST", "/v1/sessions/t1/unpin", None),
        ("POST", "/v1/sessions/t1/prefetch", None),
        ("POST", "/v1/sessions/t1/copy", {"target_id": "fork", "overwrite": False}),
        ("DELETE", "/v1/sessions/t1", None),
    ]
    assert all(q.headers.get("Authorization") == "Bearer sk-test" for q in r.requests)
    # every request that names a session says so in X-Session-ID (what a router hashes)
    assert [q.header(SESSION_HEADER) for q in r.requests] == [
        None, "t1|sub", "new", "t1", "t1", "t1", "t1", "t1", "t1",
    ]  # fmt: skip

    assert [s.id for s in listed] == ["a", "b"]
    assert got == Session(
        id="t1|sub",
        tenant="default",
        num_tokens=300,
        num_blocks=3,
        turns=2,
        created_at=1700000000.5,
        last_used_at=1700000100.25,
        pinned=False,
        ttl_seconds=3600.0,
        expires_at=1700003700.25,
        tiers={
            "ram": TierUsage(2, 4096),
            "disk": TierUsage(3, 6144),
            "redis": TierUsage(0, 0),
        },
    )
    assert created.pinned and created.ttl_seconds is None and created.expires_at is None
    assert updated.ttl_seconds == 60.0
    assert pinned.pinned and not unpinned.pinned
    assert prefetched == PrefetchResult(id="t1", blocks=3, ram_blocks=3)
    assert forked.id == "fork"
    assert freed == 2


def test_update_sends_only_the_fields_given(recorder: Any) -> None:
    for _ in range(3):
        recorder.queue_answer(200, session_json("t1"))
    with KVCacheClient(recorder.url) as kv:
        kv.update_session("t1", pinned=True)
        kv.update_session("t1", ttl_seconds=None)  # None: never expire
        kv.update_session("t1", ttl_seconds=UNSET, pinned=False)
    assert [q.body for q in recorder.requests] == [
        {"pinned": True},
        {"ttl_seconds": None},
        {"pinned": False},
    ]


def test_api_key_and_url_from_the_environment(
    recorder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LGKV_SERVER_URL", recorder.url)
    monkeypatch.setenv("LGKV_API_KEY", "sk-env")
    recorder.queue_answer(200, {"object": "list", "data": []})
    with KVCacheClient() as kv:
        assert kv.list_sessions() == []
    assert recorder.requests[0].headers["Authorization"] == "Bearer sk-env"
    monkeypatch.delenv("LGKV_API_KEY")
    recorder.queue_answer(200, {"object": "list", "data": []})
    with KVCacheClient() as kv:
        kv.list_sessions()
    assert "Authorization" not in recorder.requests[1].headers


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (404, "Session 'x' not found", SessionNotFoundError),
        (409, "Session 'x' already exists", SessionExistsError),
        (400, "Invalid session id", SessionAPIError),
        (401, "Missing or wrong API key", AuthenticationError),
        (500, "engine exploded", SessionAPIError),
    ],
)
def test_error_answers_map_to_typed_errors(
    recorder: Any, status: int, error: str, expected: type[Exception]
) -> None:
    recorder.queue_answer(status, error_json(error, status))
    with KVCacheClient(recorder.url) as kv, pytest.raises(expected) as info:
        kv.get_session("x")
    exc = info.value
    assert type(exc) is expected
    assert isinstance(exc, SessionAPIError)
    assert isinstance(exc, KVCacheError)
    assert exc.status_code == status
    assert exc.message == error or (  # a refused key also says what to do
        expected is AuthenticationError
        and exc.message.startswith(error)
        and "kv_api_key=" in exc.message
        and recorder.url in exc.message
    )
    assert exc.error_type == "invalid_request_error"
    assert error in str(exc)


def test_fastapi_validation_errors_keep_their_detail(recorder: Any) -> None:
    detail = [{"loc": ["body", "ttl_seconds"], "msg": "Input should be a valid number"}]
    recorder.queue_answer(422, {"detail": detail})
    with KVCacheClient(recorder.url) as kv, pytest.raises(SessionAPIError) as info:
        kv.update_session("t1", ttl_seconds=1.0)
    assert info.value.status_code == 422
    assert "valid number" in info.value.message


def test_plain_text_error_bodies(recorder: Any) -> None:
    recorder.queue_answer(403, "Forbidden by proxy")
    with KVCacheClient(recorder.url) as kv, pytest.raises(SessionAPIError) as info:
        kv.pin("t1")
    assert info.value.status_code == 403
    assert info.value.message == "Forbidden by proxy"


def test_gateway_errors_mean_unavailable(recorder: Any) -> None:
    recorder.queue_answer(503, error_json("engine is starting", 503, "service_unavailable"))
    recorder.queue_answer(502, "Bad Gateway")
    with KVCacheClient(recorder.url) as kv:
        with pytest.raises(ServerUnavailableError, match=r"HTTP 503: engine is starting$"):
            kv.prefetch("t1")
        with pytest.raises(ServerUnavailableError, match=r"Bad Gateway.*retry"):
            kv.prefetch("t1")


def test_connection_refused_says_how_to_fix() -> None:
    with (
        KVCacheClient(f"http://127.0.0.1:{free_port()}") as kv,
        pytest.raises(ServerUnavailableError, match="LGKV_SERVER_URL") as info,
    ):
        kv.list_sessions()
    assert "Cannot reach" in str(info.value) and "ConnectError" in str(info.value)
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value, KVCacheClientError)


def test_timeout_is_unavailable(recorder: Any) -> None:
    recorder.queue_answer(200, session_json("t1"), delay_s=1.0)
    with (
        KVCacheClient(recorder.url, timeout=0.2) as kv,
        pytest.raises(ServerUnavailableError) as info,
    ):
        kv.get_session("t1")
    message = str(info.value)  # says what happened (not "cannot reach"), and where
    assert "did not answer within 0.2 s" in message and recorder.url in message
    assert "may have taken effect" in message and "Cannot reach" not in message


def test_malformed_answers_are_reported(recorder: Any) -> None:
    recorder.queue_answer(200, {"id": "t1", "object": "session"})  # fields missing
    recorder.queue_answer(200, [1, 2])
    with KVCacheClient(recorder.url) as kv:
        with pytest.raises(SessionAPIError, match="Malformed Session"):
            kv.get_session("t1")
        with pytest.raises(SessionAPIError, match="Malformed JSON object"):
            kv.get_session("t1")


def test_bad_ids_fail_before_any_request(recorder: Any) -> None:
    with KVCacheClient(recorder.url) as kv:
        with pytest.raises(ValueError, match=r"(?i)invalid session id"):
            kv.get_session("../etc/passwd")
        with pytest.raises(ValueError, match=r"(?i)invalid session id"):
            kv.copy_session("t1", "bad target")
    assert recorder.requests == []


# ----------------------------------------------------------------------------- async
@pytest.mark.asyncio(loop_scope="session")
async def test_async_client_mirrors_the_sync_one(recorder: Any) -> None:
    r = recorder
    r.queue_answer(201, session_json("a1"))
    r.queue_answer(200, {"object": "list", "data": [session_json("a1")]})
    r.queue_answer(200, session_json("a1", ttl_seconds=5.0))
    r.queue_answer(200, session_json("a1", pinned=True))
    r.queue_answer(200, session_json("a1"))
    r.queue_answer(200, {"id": "a1", "object": "session.prefetch", "blocks": 1, "ram_blocks": 0})
    r.queue_answer(409, error_json("Session 'a2' already exists", 409))
    r.queue_answer(201, session_json("a2"))
    r.queue_answer(
        200, {"id": "a1", "object": "session.deleted", "deleted": True, "freed_blocks": 0}
    )
    r.queue_answer(404, error_json("Session 'a1' not found", 404))
    async with AsyncKVCacheClient(r.url, api_key="k") as kv:
        assert (await kv.create_session("a1")).id == "a1"
        assert [s.id for s in await kv.list_sessions()] == ["a1"]
        assert (await kv.update_session("a1", ttl_seconds=5.0)).ttl_seconds == 5.0
        assert (await kv.pin("a1")).pinned
        assert not (await kv.unpin("a1")).pinned
        assert await kv.prefetch("a1") == PrefetchResult("a1", 1, 0)
        with pytest.raises(SessionExistsError):
            await kv.copy_session("a1", "a2")
        assert (await kv.copy_session("a1", "a2", overwrite=True)).id == "a2"
        assert await kv.delete_session("a1") == 0
        with pytest.raises(SessionNotFoundError, match="not found"):
            await kv.get_session("a1")
    methods = [(q.method, q.path) for q in r.requests]
    assert methods[-4:] == [
        ("POST", "/v1/sessions/a1/copy"),
        ("POST", "/v1/sessions/a1/copy"),
        ("DELETE", "/v1/sessions/a1"),
        ("GET", "/v1/sessions/a1"),
    ]
    assert r.requests[7].body == {"target_id": "a2", "overwrite": True}
    sessions = [q.header(SESSION_HEADER) for q in r.requests]
    assert sessions == ["a1", None, "a1", "a1", "a1", "a1", "a1", "a1", "a1", "a1"]


@pytest.mark.asyncio(loop_scope="session")
async def test_async_connection_refused() -> None:
    async with AsyncKVCacheClient(f"http://127.0.0.1:{free_port()}") as kv:
        with pytest.raises(ServerUnavailableError, match="Cannot reach"):
            await kv.get_session("t1")


def test_a_rate_refusal_is_unavailable_for_now_and_a_quota_is_not() -> None:
    """429 with Retry-After (the key's --tenant-session-rate, or its calls in flight) passes
    with time: a ServerUnavailableError, so the checkpointer keeps the call in its outbox
    instead of dropping it; a quota's 429 (no Retry-After) stays a SessionAPIError."""
    from langgraph_kvcache.client import RateLimitedError
    from langgraph_kvcache.client_responses import error_from

    req = httpx.Request("DELETE", "http://kv/v1/sessions/t1")
    msg = "this key made more session API calls than the server accepts"
    rate = error_from(httpx.Response(429, json=error_json(msg, 429), headers={"Retry-After": "2"},
                                     request=req))  # fmt: skip
    assert isinstance(rate, RateLimitedError) and isinstance(rate, ServerUnavailableError)
    assert rate.retry_after_s == 2.0 and msg in str(rate)
    quota = error_from(httpx.Response(429, json=error_json("past the quota", 429), request=req))
    assert type(quota) is SessionAPIError and quota.status_code == 429
