"""The session/tenant rewrite of chat and completion bodies (contracts.md 1) and the body cap."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from server.api.chat import (
    SessionRequestMiddleware,
    rewrite_body,
    tenant_from_headers,
    tenant_of_key,
)
from server.api.protocol import APIError


@pytest.mark.parametrize(
    "body",
    [
        {"prompt_cache_key": "t-1"},
        {"session_id": "t-1"},
        {"vllm_xargs": {"session_id": "t-1"}},
        {"prompt_cache_key": "t-1", "session_id": "t-1"},  # the same name twice is fine
    ],
)
def test_each_way_names_the_session(body: dict) -> None:
    out = rewrite_body({"model": "m", **body}, "default", salted=False)
    assert out["vllm_xargs"] == {"session_id": "t-1", "tenant": "default"}
    assert "prompt_cache_key" not in out and "session_id" not in out
    assert "cache_salt" not in out
    assert out["model"] == "m"


def test_no_session_still_carries_the_tenant_and_keeps_other_xargs() -> None:
    out = rewrite_body({"vllm_xargs": {"foo": 1}}, "default", salted=False)
    assert out["vllm_xargs"] == {"foo": 1, "tenant": "default"}


def test_client_cannot_pick_its_tenant_or_salt() -> None:
    body = {"vllm_xargs": {"tenant": "someone-else"}, "cache_salt": "lgkv-someone-else"}
    out = rewrite_body(body, "abcd", salted=True)
    assert out["vllm_xargs"]["tenant"] == "abcd"
    assert out["cache_salt"] == "lgkv-abcd"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"session_id": "has space"}, "invalid session_id"),
        ({"prompt_cache_key": "../x"}, "invalid prompt_cache_key"),
        ({"vllm_xargs": {"session_id": 5}}, "invalid vllm_xargs.session_id"),
        ({"session_id": "x" * 256}, "invalid session_id"),
        ({"session_id": ""}, "invalid session_id"),
        ({"prompt_cache_key": "a", "session_id": "b"}, "two different sessions"),
        ({"vllm_xargs": [1]}, "vllm_xargs must be a JSON object"),
    ],
)
def test_bad_names_are_400(body: dict, match: str) -> None:
    with pytest.raises(APIError, match=match) as info:
        rewrite_body(body, "default", salted=False)
    assert info.value.status == 400


def test_tenant_from_headers() -> None:
    assert tenant_from_headers(Headers({"authorization": "Bearer k"}), ()) == "default"
    keyed = tenant_from_headers(Headers({"authorization": "Bearer k1"}), ("k1", "k2"))
    assert keyed == tenant_of_key("k1") and len(keyed) == 16
    assert keyed != tenant_of_key("k2")
    assert tenant_from_headers(Headers({}), ("k1",)) == "unauthenticated"


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"body": json.loads(await request.body() or b"null")})


def _client(max_body: int = 4096, keys: tuple[str, ...] = ()) -> httpx.AsyncClient:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _echo, methods=["POST"]),
            Route("/v1/sessions", _echo, methods=["POST"]),
        ]
    )
    app.add_middleware(SessionRequestMiddleware, max_body_bytes=max_body, api_keys=keys)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_middleware_rewrites_completion_routes_only() -> None:
    async with _client(keys=("secret",)) as c:
        headers = {"Authorization": "Bearer secret"}
        r = await c.post("/v1/chat/completions", json={"session_id": "s1"}, headers=headers)
        tenant = tenant_of_key("secret")
        assert r.json()["body"] == {
            "vllm_xargs": {"session_id": "s1", "tenant": tenant},
            "cache_salt": "lgkv-" + tenant,
        }
        other = await c.post("/v1/sessions", json={"session_id": "s1"})
        assert other.json()["body"] == {"session_id": "s1"}


async def test_middleware_errors() -> None:
    async with _client(max_body=2048) as c:
        big = await c.post("/v1/sessions", content=b"x" * 4096)
        assert big.status_code == 413
        assert big.json()["error"]["code"] == 413
        bad = await c.post("/v1/chat/completions", content=b"[1,")
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        named = await c.post("/v1/chat/completions", json={"session_id": "bad id"})
        assert named.status_code == 400


async def test_middleware_counts_streamed_bodies_without_content_length() -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(8):
            yield b"x" * 512

    async with _client(max_body=2048) as c:
        r = await c.post("/v1/sessions", content=chunks())
    assert r.status_code == 413
