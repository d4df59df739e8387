"""The session/tenant rewrite of generation bodies, the key check, the body cap and depth bound."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from server.api.auth import KeyRing, tenant_of_key
from server.api.body_check import MAX_JSON_DEPTH
from server.api.chat import SessionRequestMiddleware
from server.api.generation_body import rewrite_body
from server.api.json_body import nesting_depth
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
    # The client's salt only narrows its own tenant's KV further.
    assert out["cache_salt"] == "lgkv-abcd|lgkv-someone-else"
    assert rewrite_body({}, "abcd", salted=True)["cache_salt"] == "lgkv-abcd"


@pytest.mark.parametrize("victim_salt", ["lgkv-abcd", "lgkv-abcd|x", "abcd", "", "|", "lgkv-abcd|"])
def test_no_client_salt_yields_another_tenants_salt(victim_salt: str) -> None:
    victims = {rewrite_body({}, "abcd", salted=True)["cache_salt"]}
    victims.add(rewrite_body({"cache_salt": "x"}, "abcd", salted=True)["cache_salt"])
    out = rewrite_body({"cache_salt": victim_salt}, "ef01", salted=True)
    assert out["cache_salt"].startswith("lgkv-ef01")
    assert out["cache_salt"] not in victims


def test_shifted_reuse_gets_a_salt_no_exact_request_can_have() -> None:
    keyed = rewrite_body({"vllm_xargs": {"lgkv_reuse": "shifted"}}, "abcd", salted=True)
    assert keyed["cache_salt"] == "lgkvs-abcd"
    assert keyed["vllm_xargs"]["lgkv_reuse"] == "shifted"
    by_default = rewrite_body({"cache_salt": "x"}, "default", salted=False, reuse="shifted")
    assert by_default["cache_salt"] == "lgkvs-default|x"
    exact = rewrite_body(
        {"vllm_xargs": {"lgkv_reuse": "exact"}}, "t", salted=False, reuse="shifted"
    )
    assert "cache_salt" not in exact and "lgkv_reuse" not in exact["vllm_xargs"]
    # an exact request's salt always starts with its tenant's salt, never the shifted one
    forged = rewrite_body({"cache_salt": "s-abcd"}, "abcd", salted=True)["cache_salt"]
    assert not forged.startswith("lgkvs-")
    with pytest.raises(APIError, match="lgkv_reuse must be one of exact, shifted"):
        rewrite_body({"vllm_xargs": {"lgkv_reuse": "fuzzy"}}, "t", salted=False)


def test_server_owned_fields_are_400() -> None:
    with pytest.raises(APIError, match="kv_transfer_params is set by the server") as info:
        rewrite_body({"kv_transfer_params": {"do_remote_prefill": True}}, "t", salted=False)
    assert info.value.status == 400
    with pytest.raises(APIError, match="cache_salt must be a string"):
        rewrite_body({"cache_salt": 5}, "t", salted=True)
    for owned, value in (("lgkv_op", "sync"), ("lgkv_op", None), ("kv_transfer_params", "x")):
        with pytest.raises(APIError, match=f"vllm_xargs.{owned} is set by the server") as info:
            rewrite_body({"vllm_xargs": {owned: value}}, "t", salted=False)
        assert info.value.status == 400


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


def test_key_ring_tenants() -> None:
    assert KeyRing(()).tenant(Headers({"authorization": "Bearer k"})) == "default"
    ring = KeyRing(("k1", "k2"))
    keyed = ring.tenant(Headers({"authorization": "Bearer k1"}))
    assert keyed == tenant_of_key("k1") and len(keyed) == 16
    assert keyed != tenant_of_key("k2")
    assert ring.tenant(Headers({})) == "unauthenticated"
    assert ring.valid(Headers({"authorization": "bearer k2"}))
    assert not ring.valid(Headers({"authorization": "Bearer k3"}))
    assert not ring.valid(Headers({"authorization": "Basic k1"}))


def test_key_ring_public_paths() -> None:
    ring = KeyRing(("k",))
    assert not ring.needs_key("/health", "GET")
    preflight = Headers({"origin": "https://app.example", "access-control-request-method": "GET"})
    assert not ring.needs_key("/v1/models", "OPTIONS", preflight)  # a real CORS preflight
    assert ring.needs_key("/metrics", "OPTIONS")  # not a preflight: the key, like GET
    assert ring.needs_key("/metrics", "OPTIONS", Headers({"access-control-request-method": "GET"}))
    for path in ("/metrics", "/invocations", "/tokenize", "/v1/models", "/openapi.json", "/"):
        assert ring.needs_key(path, "POST") and ring.needs_key(path, "GET")
    assert not KeyRing(("k",), metrics_public=True).needs_key("/metrics", "GET")
    assert not KeyRing(()).needs_key("/invocations", "POST")


def test_nesting_depth_reads_the_bytes() -> None:
    assert nesting_depth(b"1") == 0
    assert nesting_depth(b'"[[[{{"') == 0  # brackets inside strings do not count
    assert nesting_depth(json.dumps({"a": [1, {"b": []}]}).encode()) == 4
    assert nesting_depth(json.dumps({"s": 'x"[[[\\', "t": ["]]", {}]}).encode()) == 3
    assert nesting_depth(b"[" * 10_001 + b"]" * 10_001) == 10_001
    assert nesting_depth(json.dumps([[i] for i in range(100_000)]).encode()) == 2
    for value in ([], [[], [[]]], {"a": {"b": {"c": "}}}"}}}, "plain"):
        raw = json.dumps(value).encode()
        assert nesting_depth(raw) == _parsed_depth(value), raw


def _parsed_depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_parsed_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_parsed_depth(v) for v in value), default=0)
    return 0


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"body": json.loads(await request.body() or b"null")})


def _client(max_body: int = 4096, keys: tuple[str, ...] = ()) -> httpx.AsyncClient:
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _echo, methods=["POST"]),
            Route("/v1/sessions", _echo, methods=["POST"]),
        ]
    )
    app.add_middleware(SessionRequestMiddleware, max_body_bytes=max_body, keys=KeyRing(keys))
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
        other = await c.post("/v1/sessions", json={"session_id": "s1"}, headers=headers)
        assert other.json()["body"] == {"session_id": "s1"}


async def test_middleware_answers_401_before_reading_the_body() -> None:
    async with _client(keys=("secret",)) as c:
        for body in (b"{not json", b"[" * 10_000, b'{"session_id": "s1"}'):
            for path in ("/v1/chat/completions", "/v1/sessions", "/anything"):
                r = await c.post(path, content=body)
                assert r.status_code == 401, (path, r.text)
                assert "Authorization: Bearer" in r.json()["error"]["message"]
        wrong = await c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/sessions"])
@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
async def test_deeply_nested_bodies_are_400(path: str, opener: bytes) -> None:
    n = MAX_JSON_DEPTH + 1
    closer = b"]" if opener == b"[" else b"}"
    body = opener * n + b"1" + closer * n
    async with _client(max_body=1 << 20) as c:
        r = await c.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nests deeper" in r.json()["error"]["message"]
        bomb = await c.post(path, content=b"[" * 200_000 + b"]" * 200_000,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert bomb.status_code == 400
        ok_depth = opener * (MAX_JSON_DEPTH - 2) + b"1" + closer * (MAX_JSON_DEPTH - 2)
        fine = await c.post(path, content=b'{"x":' + ok_depth + b"}",
                            headers={"content-type": "application/json"})  # fmt: skip
        assert fine.status_code == 200, fine.text


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


async def test_options_lists_every_method_of_the_path_with_a_key() -> None:
    """Only a real CORS preflight goes without the key (issue 27: ``OPTIONS /metrics`` with
    ``Access-Control-Request-Method`` and no ``Origin`` answered every metric)."""
    key = {"Authorization": "Bearer secret"}
    async with _client(keys=("secret",)) as c:
        assert (await c.options("/v1/sessions")).status_code == 401
        r = await c.options("/v1/sessions", headers=key)
        assert r.status_code == 204
        assert r.headers["allow"] == "OPTIONS, POST"
        assert (await c.options("/nowhere", headers=key)).status_code == 404


def _slow_keyed_app() -> tuple[Starlette, asyncio.Event, asyncio.Event, bytes]:
    """Two keys in front of a completion route that reads the body, sets ``entered`` and
    answers once ``release`` is set; and a body over LARGE_BODY_BYTES."""
    from server.api.chat import LARGE_BODY_BYTES

    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> JSONResponse:
        await request.body()
        entered.set()
        await release.wait()
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/completions", slow, methods=["POST"])])
    app.add_middleware(SessionRequestMiddleware, max_body_bytes=4 << 20, keys=KeyRing(("ka", "kb")))
    big = json.dumps({"prompt": [1] * (LARGE_BODY_BYTES // 2)}).encode()
    return app, entered, release, big


async def test_a_key_sends_one_large_body_at_a_time() -> None:
    """Four senders of 4 MiB bodies from one key slowed another key's first token 16x
    (benchmarks/tenants.py): a key now has one body over LARGE_BODY_BYTES in flight; the next
    gets 429 before it is read, while other keys and small bodies go on."""
    from server.api.chat import LARGE_BODY_BYTES

    app, entered, release, big = _slow_keyed_app()
    assert len(big) > LARGE_BODY_BYTES
    a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        first = asyncio.create_task(c.post("/v1/completions", content=big, headers=a))
        await entered.wait()
        second = await c.post("/v1/completions", content=big, headers=a)
        assert second.status_code == 429, second.text
        assert "one at a time" in second.json()["error"]["message"]
        entered.clear()
        other = asyncio.create_task(c.post("/v1/completions", content=big, headers=b))
        await entered.wait()  # another key's large body went in
        release.set()
        assert (await first).status_code == 200 and (await other).status_code == 200
        again = await c.post("/v1/completions", content=big, headers=a)
        assert again.status_code == 200  # the first one finished: room again


def test_body_budget_refills_at_its_rate_and_holds_one_largest_body() -> None:
    from server.api.body_budget import BodyBudget

    budget = BodyBudget(rate=1000.0, burst=4000)
    assert budget.take("a", 3000, now=0.0) == 0.0  # a full bucket: 1000 left
    assert budget.take("a", 3000, now=0.0) == 2.0  # refused: 2000 short at 1000/s
    assert budget.take("b", 4000, now=0.0) == 0.0  # another key's own bucket
    assert budget.take("a", 3000, now=2.0) == 0.0  # refilled (refusals charge nothing)
    assert budget.take("a", 4000, now=100.0) == 0.0  # never more than burst
    assert budget.take("a", 1, now=100.0) > 0
    msg, retry = budget.refusal(2.3)
    assert retry == 3 and "--tenant-body-rate" in msg


def test_call_budget_allows_bursts_of_two_seconds_then_its_rate() -> None:
    from server.api.body_budget import CallBudget

    calls = CallBudget(10.0)
    assert all(calls.take("a", 1, now=0.0) == 0.0 for _ in range(20))  # two seconds' worth
    assert calls.take("a", 1, now=0.0) == pytest.approx(0.1)
    assert calls.take("b", 1, now=0.0) == 0.0  # another key's own bucket
    assert calls.take("a", 1, now=0.1) == 0.0  # refilled at 10 a second
    msg, retry = calls.refusal(0.1)
    assert retry == 1 and "--tenant-session-rate: 10 per second" in msg


async def test_a_key_past_its_body_rate_gets_429_with_retry_after() -> None:
    """One key sending large bodies back to back kept the API process parsing (tenant B's first
    token 3.4x slower, benchmarks/tenants.py (a)): with several keys each key's bodies over
    64 KiB pass at --tenant-body-rate; past it 429 with Retry-After, before the body is read;
    another key and small bodies go on."""
    from server.api.body_budget import BodyBudget

    app = Starlette(routes=[Route("/v1/completions", _echo, methods=["POST"])])
    budget = BodyBudget(1 << 10, 4 << 20)  # 1 KiB/s, a 4 MiB bucket
    app.add_middleware(SessionRequestMiddleware, max_body_bytes=4 << 20,
                       keys=KeyRing(("ka", "kb")), body_budget=budget)  # fmt: skip
    big = json.dumps({"prompt": [1] * (600 << 10)}).encode()  # 1.8 MiB: two fit the bucket
    a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for _ in range(2):
            assert (await c.post("/v1/completions", content=big, headers=a)).status_code == 200
        refused = await c.post("/v1/completions", content=big, headers=a)
        assert refused.status_code == 429, refused.text
        assert "--tenant-body-rate" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) > 1000  # 1 KiB/s: the rest takes long
        assert (await c.post("/v1/completions", content=big, headers=b)).status_code == 200
        small = json.dumps({"prompt": "hi"}).encode()
        assert (await c.post("/v1/completions", content=small, headers=a)).status_code == 200


async def test_refused_large_bodies_are_held_and_past_the_bound_answered_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Senders that retried refused 2 MiB bodies at once made 4,080 refusals in one phase of
    benchmarks/tenants.py, each a connection and a header parse: a refusal is now answered
    after REFUSAL_HOLD_S (its body unread), and past MAX_HELD_REFUSALS held ones at once."""
    from server.api import chat

    monkeypatch.setattr(chat, "REFUSAL_HOLD_S", 30.0)
    monkeypatch.setattr(chat, "MAX_HELD_REFUSALS", 1)
    app, entered, release, big = _slow_keyed_app()
    a = {"Authorization": "Bearer ka"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
    ) as c:
        first = asyncio.create_task(c.post("/v1/completions", content=big, headers=a))
        await entered.wait()
        held = asyncio.create_task(c.post("/v1/completions", content=big, headers=a))
        await asyncio.sleep(0.2)
        assert not held.done()  # held (30 s here), the body unread
        at_once = await c.post("/v1/completions", content=big, headers=a)
        assert at_once.status_code == 429  # the one hold in use: answered at once
        assert not held.done()
        held.cancel()
        release.set()
        assert (await first).status_code == 200
