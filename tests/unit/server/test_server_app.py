"""``create_app`` in-process (httpx ASGITransport): session API and request validation.

A real engine (tiny model, engine core in its own process as AsyncLLM always does) and a real
``SessionControl``; the requests here never run a forward pass.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
async def client(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> AsyncIterator[httpx.AsyncClient]:
    config = ServerConfig(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        max_model_len=512,
        kv_cache_memory_bytes=32 << 20,
        kv_ram_bytes=32 << 20,
        kv_disk_bytes=64 << 20,
        cache_dir=tmp_path_factory.mktemp("app") / "kv",
        max_body_bytes=64 << 10,
        vllm_args=("--max-num-seqs", "2"),
    )
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            yield c


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


async def test_session_lifecycle(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/sessions", json={"id": "in-proc", "ttl_seconds": 30})
    assert r.status_code == 201, r.text
    assert r.json()["expires_at"] > r.json()["created_at"]
    assert (await client.post("/v1/sessions", json={"id": "in-proc"})).status_code == 409
    patched = await client.patch("/v1/sessions/in-proc", json={"pinned": True})
    assert patched.json()["pinned"] is True and patched.json()["ttl_seconds"] == 30
    listed = (await client.get("/v1/sessions")).json()["data"]
    assert [s["id"] for s in listed] == ["in-proc"]
    copied = await client.post("/v1/sessions/in-proc/copy", json={"target_id": "in-proc.2"})
    assert copied.status_code == 201 and copied.json()["id"] == "in-proc.2"
    pre = (await client.post("/v1/sessions/in-proc/prefetch")).json()
    assert pre == {"id": "in-proc", "object": "session.prefetch", "blocks": 0, "ram_blocks": 0}
    for sid in ("in-proc", "in-proc.2"):
        assert (await client.delete(f"/v1/sessions/{sid}")).json()["deleted"] is True
    assert (await client.get("/v1/sessions/in-proc")).status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/v1/sessions", {"id": "a b"}, 400, "invalid id"),
        ("POST", "/v1/sessions", {"id": "ok", "ttl_seconds": 0}, 422, "ttl_seconds"),
        ("POST", "/v1/sessions", {}, 422, "id"),
        ("PATCH", "/v1/sessions/ghost", {"pinned": "no"}, 422, "pinned"),
        ("PATCH", "/v1/sessions/ghost", {"pinned": False}, 404, "not found"),
        ("POST", "/v1/sessions/ghost/copy", {"target_id": "t"}, 404, "not found"),
        ("POST", "/v1/sessions/ghost/copy", {}, 422, "target_id"),
        ("GET", "/v1/sessions?offset=-1", None, 400, "offset"),
        ("POST", "/v1/chat/completions", {"session_id": "/etc"}, 400, "invalid session_id"),
    ],
)
async def test_errors(
    client: httpx.AsyncClient, method: str, path: str, body: object, status: int, words: str
) -> None:
    r = await client.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


async def test_body_cap_and_prompt_length(client: httpx.AsyncClient) -> None:
    big = await client.post("/v1/completions", content=b"{" + b" " * (65 << 10) + b"}")
    assert big.status_code == 413
    long = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi " * 600, "max_tokens": 1}
    )
    assert long.status_code == 400
    assert "maximum context length" in long.json()["error"]["message"]


async def test_metrics_include_ours(client: httpx.AsyncClient) -> None:
    text = (await client.get("/metrics")).text
    assert "lgkv_sessions" in text and "vllm:" in text
