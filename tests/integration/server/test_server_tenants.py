"""Tenants and keys on a real keyed server: every route of vLLM's app is keyed or refused, and
no route lets one tenant read or replace another tenant's KV or sessions."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from server.api.routes import GENERATION_PATHS, is_served

if TYPE_CHECKING:
    from pathlib import Path

    import httpx

    from tests.integration.conftest import ServerFactory, ServerProcess

pytestmark = pytest.mark.vllm

ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
PROMPT = "Tenant test. " + " ".join(f"Line {i} of a long private prefix." for i in range(60))
# Generation routes vLLM 0.32 serves besides the two rewritten ones; each must be refused.
VLLM_GENERATION_ROUTES = (
    "/v1/responses",
    "/v1/messages",
    "/v1/chat/completions/batch",
    "/invocations",
    "/generative_scoring",
    "/inference/v1/generate",
)


@pytest.fixture(scope="module")
def keyed(start_server: ServerFactory) -> ServerProcess:
    return start_server("--api-key", "key-alice", "--api-key", "key-bob")  # both kept


@pytest.fixture(scope="module")
def vllm_route_table(server_model_dir: Path) -> list[tuple[str, str]]:
    """(method, path) of every route vLLM's own app declares for this server's settings."""
    from vllm.entrypoints.launchers.app import build_app

    from server.config import ServerConfig
    from server.engine import build_vllm_args

    args = build_vllm_args(ServerConfig(model=str(server_model_dir), api_keys=("k",)))
    app = build_app(args, supported_tasks=("generate",), model_config=None)
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_vllm_route_needs_a_key_or_is_refused(
    keyed: ServerProcess, vllm_route_table: list[tuple[str, str]]
) -> None:
    assert len(vllm_route_table) > 20
    for path in VLLM_GENERATION_ROUTES:
        assert path in {p for _, p in vllm_route_table}, f"vLLM no longer serves {path}?"
    with keyed.client() as c:
        for method, path in vllm_route_table:
            url = _concrete(path)
            bare = c.request(method, url, content=b"{not json")
            if path == "/health":
                assert bare.status_code == 200
                continue
            assert bare.status_code == 401, (method, path, bare.text)
            wrong = c.request(method, url, content=b"{}", headers={"Authorization": "Bearer no"})
            assert wrong.status_code == 401, (method, path)
            keyed_r = c.request(method, url, json={}, headers=ALICE)
            if is_served(path):
                assert keyed_r.status_code != 401, (method, path)
            else:
                assert keyed_r.status_code == 404, (method, path, keyed_r.text)
                assert "is not served here" in keyed_r.json()["error"]["message"]
    for path in VLLM_GENERATION_ROUTES:
        assert not is_served(path)


def _chat_body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            **extra}  # fmt: skip


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_no_route_reads_or_replaces_another_tenants_kv(keyed: ServerProcess) -> None:
    with keyed.client() as c:
        model = keyed.model
        first = c.post("/v1/chat/completions", json=_chat_body(model, session_id="vault"),
                       headers=ALICE)  # fmt: skip
        assert _cached(first) == 0
        assert _cached(c.post("/v1/chat/completions", json=_chat_body(model, session_id="vault"),
                              headers=ALICE)) >= 256  # fmt: skip
        alice_session = c.get("/v1/sessions/vault", headers=ALICE).json()
        tenant = alice_session["tenant"]
        smuggled = [
            {"cache_salt": f"lgkv-{tenant}"},
            {"vllm_xargs": {"tenant": tenant}},
            {"cache_salt": f"lgkv-{tenant}", "vllm_xargs": {"tenant": tenant}},
            {"cache_salt": f"lgkv-{tenant}", "vllm_xargs": {"tenant": tenant,
                                                           "session_id": "vault"}},
            {"cache_salt": f"lgkv-{tenant}", "session_id": "vault"},
            {"cache_salt": f"lgkv-{tenant}", "prompt_cache_key": "vault"},
            {"cache_salt": f"lgkv-{tenant}|x"},
        ]  # fmt: skip
        for i, extra in enumerate(smuggled):
            # A prompt only Alice has sent: any cached token Bob gets would be hers.
            private = f"Variant {i}. {PROMPT}"
            chat = {"model": model, "messages": [{"role": "user", "content": private}],
                    "max_tokens": 2}  # fmt: skip
            completion = {"model": model, "prompt": private, "max_tokens": 2}
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
                assert _cached(c.post(path, json=body, headers=ALICE)) == 0
                assert _cached(c.post(path, json=body, headers=ALICE)) >= 256  # hers, cached
                assert _cached(c.post(path, json={**body, **extra}, headers=BOB)) == 0, extra
        for path in VLLM_GENERATION_ROUTES:
            body = {**_chat_body(model), "input": PROMPT, "cache_salt": f"lgkv-{tenant}",
                    "vllm_xargs": {"tenant": tenant, "session_id": "vault"}}  # fmt: skip
            r = c.post(path, json=body, headers=BOB)
            assert r.status_code == 404, (path, r.text)
        assert set(GENERATION_PATHS) == {"/v1/chat/completions", "/v1/completions"}
        after = c.get("/v1/sessions/vault", headers=ALICE).json()
        assert (after["num_tokens"], after["num_blocks"]) == (
            alice_session["num_tokens"],
            alice_session["num_blocks"],
        )
        assert after["tenant"] == tenant
        # Bob's own "vault" is a separate session, Alice's is untouched by it.
        assert c.get("/v1/sessions/vault", headers=BOB).json()["tenant"] != tenant
        for verb, url in (("PATCH", "/v1/sessions/vault"), ("POST", "/v1/sessions/vault/pin"),
                          ("POST", "/v1/sessions/vault/copy")):  # fmt: skip
            body = {"pinned": True} if verb == "PATCH" else {"target_id": "stolen"}
            r = c.request(verb, url, json=body, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401


def test_tenants_are_isolated(keyed: ServerProcess) -> None:
    server = keyed
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 2, "session_id": "same-name"}
    with server.client() as c:
        assert c.get("/v1/sessions").status_code == 401
        assert c.post("/v1/completions", json=body).status_code == 401
        wrong = c.get("/v1/sessions", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401

        first = c.post("/v1/completions", json=body, headers=ALICE)
        assert first.status_code == 200, first.text
        again = c.post("/v1/completions", json=body, headers=ALICE).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        mine = c.get("/v1/sessions/same-name", headers=ALICE).json()
        assert mine["tenant"] not in ("default", "unauthenticated") and len(mine["tenant"]) == 16
        assert c.get("/v1/sessions/same-name", headers=BOB).status_code == 404
        bobs = [s["id"] for s in c.get("/v1/sessions", headers=BOB).json()["data"]]
        assert "same-name" not in bobs

        # Same text, other tenant: its own salt, so none of alice's blocks are reused.
        theirs = c.post("/v1/completions", json=body, headers=BOB).json()
        assert theirs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        bob_session = c.get("/v1/sessions/same-name", headers=BOB).json()
        assert bob_session["tenant"] != mine["tenant"]


def test_metrics_need_a_key(keyed: ServerProcess) -> None:
    with keyed.client() as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=ALICE).status_code == 200
        assert c.get("/health").status_code == 200


def test_options_needs_a_key_unless_it_is_a_real_preflight(keyed: ServerProcess) -> None:
    """``OPTIONS /metrics`` with ``Access-Control-Request-Method`` and no ``Origin`` went past
    the CORS layer to the metrics app, which answered every metric without a key."""
    acrm = {"Access-Control-Request-Method": "GET"}
    with keyed.client() as c:
        for headers in ({}, acrm, {"Origin": "https://app.example"}):
            r = c.options("/metrics", headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert "lgkv_" not in r.text and "vllm:" not in r.text
        assert c.options("/metrics", headers={**acrm, **ALICE}).status_code in (200, 204)
        preflight = c.options("/metrics", headers={**acrm, "Origin": "https://app.example"})
        assert preflight.status_code in (200, 400), preflight.text  # the CORS layer's answer
        assert "lgkv_" not in preflight.text and "vllm:" not in preflight.text
        assert "access-control-allow-methods" in preflight.headers


def test_server_only_xargs_are_refused(keyed: ServerProcess) -> None:
    """A client's ``vllm_xargs.lgkv_op`` ran as an internal control request (its session never
    recorded) and ``vllm_xargs.kv_transfer_params`` gave a 500."""
    with keyed.client() as c:
        for owned, value in (("lgkv_op", "sync"), ("kv_transfer_params", "x")):
            body = {**_chat_body(keyed.model, session_id="xargs"), "vllm_xargs": {owned: value}}
            r = c.post("/v1/chat/completions", json=body, headers=ALICE)
            assert r.status_code == 400, r.text
            assert f"vllm_xargs.{owned}" in r.json()["error"]["message"]
        assert c.get("/v1/sessions/xargs", headers=ALICE).status_code == 404
