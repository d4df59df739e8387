"""The session API of a real server: happy paths, errors, tenants, restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import wait_until

if TYPE_CHECKING:
    from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.vllm

SESSION_KEYS = {
    "id", "object", "tenant", "num_tokens", "num_blocks", "turns", "created_at",
    "last_used_at", "pinned", "ttl_seconds", "expires_at", "pin_expires_at", "tiers",
}  # fmt: skip
PROMPT = "Session API test. " + " ".join(f"Line {i} of a long shared prefix." for i in range(60))


def _talk(server: ServerProcess, sid: str, text: str = PROMPT) -> dict:
    with server.client() as c:
        r = c.post(
            "/v1/completions",
            json={"model": server.model, "prompt": text, "max_tokens": 2, "session_id": sid},
        )
    assert r.status_code == 200, r.text
    return r.json()


def test_create_get_list_patch_pin_delete(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        r = c.post("/v1/sessions", json={"id": "api-life", "ttl_seconds": 600, "pinned": False})
        assert r.status_code == 201, r.text
        created = r.json()
        assert set(created) == SESSION_KEYS
        assert created["object"] == "session"
        assert created["ttl_seconds"] == 600
        assert set(created["tiers"]) == {"ram", "disk", "redis"}

        assert c.get("/v1/sessions/api-life").json()["id"] == "api-life"
        listed = c.get("/v1/sessions", params={"limit": 1000}).json()
        assert listed["object"] == "list"
        assert "api-life" in [s["id"] for s in listed["data"]]

        patched = c.patch("/v1/sessions/api-life", json={"ttl_seconds": None})
        assert patched.status_code == 200, patched.text
        assert patched.json()["ttl_seconds"] is None
        pinned = c.post("/v1/sessions/api-life/pin").json()
        assert (pinned["pinned"], pinned["pin_expires_at"]) == (True, None)
        assert c.post("/v1/sessions/api-life/unpin").json()["pinned"] is False

        # A pin lease: pinned until pin_expires_at, renewed by the next pin; unpin drops it.
        before = time.time()
        leased = c.post("/v1/sessions/api-life/pin", json={"pin_ttl_seconds": 30}).json()
        assert leased["pinned"] is True
        assert before + 30 <= leased["pin_expires_at"] <= time.time() + 30
        renewed = c.patch("/v1/sessions/api-life", json={"pin_ttl_seconds": 300}).json()
        assert renewed["pinned"] and renewed["pin_expires_at"] > leased["pin_expires_at"] + 200
        short = c.post("/v1/sessions/api-life/pin", json={"pin_ttl_seconds": 1}).json()
        assert short["pinned"] is True
        time.sleep(1.2)
        lapsed = c.get("/v1/sessions/api-life").json()
        assert (lapsed["pinned"], lapsed["pin_expires_at"]) == (False, None)
        c.post("/v1/sessions/api-life/pin", json={"pin_ttl_seconds": 60})
        unpinned = c.post("/v1/sessions/api-life/unpin").json()
        assert (unpinned["pinned"], unpinned["pin_expires_at"]) == (False, None)
        conflict = c.patch("/v1/sessions/api-life", json={"pinned": False, "pin_ttl_seconds": 9})
        assert conflict.status_code == 400, conflict.text

        deleted = c.delete("/v1/sessions/api-life")
        assert deleted.status_code == 200
        assert deleted.json() == {
            "id": "api-life", "object": "session.deleted", "deleted": True, "freed_blocks": 0,
            "files_removed": True,
        }  # fmt: skip
        assert c.get("/v1/sessions/api-life").status_code == 404


def test_session_filled_by_requests_then_copied_prefetched_deleted(
    lgkv_server: ServerProcess,
) -> None:
    before = _block_files(lgkv_server)
    _talk(lgkv_server, "api-filled")
    with lgkv_server.client() as c:
        info = c.get("/v1/sessions/api-filled").json()
        assert info["num_blocks"] >= 2 and info["turns"] == 1
        # Disk writes are asynchronous (the answer comes first): wait until the turn's block
        # files are there, so the deletes below have files to remove.
        wait_until(
            lambda: len(_block_files(lgkv_server) - before) >= info["num_blocks"],
            "the turn's block files",
            timeout_s=60,
        )
        # Full blocks, plus the partly filled tail block of the turn (server/kv/scheduler/tails.py).
        full, tail = divmod(info["num_tokens"], 128)
        assert info["num_blocks"] == full + (tail > 0)

        copy = c.post("/v1/sessions/api-filled/copy", json={"target_id": "api-fork"})
        assert copy.status_code == 201, copy.text
        assert copy.json()["id"] == "api-fork"
        assert copy.json()["num_blocks"] == info["num_blocks"]
        again = c.post("/v1/sessions/api-filled/copy", json={"target_id": "api-fork"})
        assert again.status_code == 409
        over = c.post(
            "/v1/sessions/api-filled/copy", json={"target_id": "api-fork", "overwrite": True}
        )
        assert over.status_code == 201

        pre = c.post("/v1/sessions/api-filled/prefetch")
        assert pre.status_code == 200, pre.text
        assert pre.json()["object"] == "session.prefetch"
        assert pre.json()["blocks"] == info["num_blocks"]

        # The fork still holds every block, so deleting the source frees none.
        files = _block_files(lgkv_server)
        assert c.delete("/v1/sessions/api-filled").json()["freed_blocks"] == 0
        assert files <= _block_files(lgkv_server)  # nothing removed
        assert c.delete("/v1/sessions/api-fork").json()["freed_blocks"] == info["num_blocks"]
        # The engine removed the freed blocks' files before the DELETE answered.
        gone = files - _block_files(lgkv_server)
        assert len(gone) == info["num_blocks"], (len(gone), info["num_blocks"])


def _block_files(server: ServerProcess) -> set[str]:
    return {p.name for p in (server.cache_dir / "blocks").rglob("*.kvb")}


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/sessions/nope-404", None, 404),
        ("DELETE", "/v1/sessions/nope-404", None, 404),
        ("PATCH", "/v1/sessions/nope-404", {"pinned": True}, 404),
        ("POST", "/v1/sessions/nope-404/pin", None, 404),
        ("POST", "/v1/sessions/nope-404/pin", {"pin_ttl_seconds": 0}, 422),
        ("PATCH", "/v1/sessions/nope-404", {"pin_ttl_seconds": "long"}, 422),
        ("POST", "/v1/sessions/nope-404/prefetch", None, 404),
        ("POST", "/v1/sessions/nope-404/copy", {"target_id": "x1"}, 404),
        ("GET", "/v1/sessions/bad%20id", None, 400),
        ("POST", "/v1/sessions", {"id": "-starts-with-dash"}, 400),
        ("POST", "/v1/sessions", {"id": "x" * 300}, 400),
        ("POST", "/v1/sessions", {"ttl_seconds": 5}, 422),
        ("POST", "/v1/sessions", {"id": "ok1", "pinned": "yes"}, 422),
        ("POST", "/v1/sessions", {"id": "ok1", "ttl_seconds": -1}, 422),
        ("POST", "/v1/sessions", {"id": "ok1", "color": "red"}, 422),
        ("POST", "/v1/sessions", [1, 2], 422),
        ("GET", "/v1/sessions?limit=abc", None, 400),
    ],
)
def test_errors(
    lgkv_server: ServerProcess, method: str, path: str, body: object, status: int
) -> None:
    with lgkv_server.client() as c:
        r = c.request(method, path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]


def test_create_twice_is_409(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        assert c.post("/v1/sessions", json={"id": "api-twice"}).status_code == 201
        r = c.post("/v1/sessions", json={"id": "api-twice"})
        assert r.status_code == 409
        assert "already exists" in r.json()["error"]["message"]
        c.delete("/v1/sessions/api-twice")


def test_oversize_session_body_is_413(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        r = c.post("/v1/sessions", content=b"{" + b" " * (9 << 20) + b"}")
    assert r.status_code == 413


def test_sessions_survive_a_restart(lgkv_server: ServerProcess) -> None:
    _talk(lgkv_server, "api-restart")
    with lgkv_server.client() as c:
        before = c.get("/v1/sessions/api-restart").json()
    lgkv_server.restart()
    with lgkv_server.client() as c:
        after = c.get("/v1/sessions/api-restart").json()
    assert after["num_blocks"] == before["num_blocks"] >= 2
    usage = _talk(lgkv_server, "api-restart")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 256  # loaded from disk
    # The worker's measurements of that load, and of the saves of a turn that adds blocks, reach
    # /metrics on vLLM's connector stats path (server/kv/stats.py), from zero since the restart.
    _talk(lgkv_server, "api-restart", PROMPT + " " + " ".join(f"More {i}." for i in range(90)))
    samples = _worker_samples(
        lgkv_server, until=lambda s: min(s.get(f"lgkv_{k}_seconds_count", 0) for k in LS) > 0
    )
    assert samples["lgkv_load_seconds_count"] >= 1
    assert samples["lgkv_load_seconds_sum"] > 0
    assert samples["lgkv_save_seconds_count"] >= 1
    assert samples["lgkv_saved_blocks_total"] >= 1


LS = ("load", "save")


def _worker_samples(server: ServerProcess, until: Callable[[dict[str, float]], bool]) -> dict:
    """The ``lgkv_load/save_seconds`` and ``lgkv_saved_blocks`` samples of ``/metrics``, summed
    over their labels; scraped again (up to 30 s) until ``until`` holds, since vLLM records a
    step's stats after it hands the step's outputs to the requests."""
    families = ("lgkv_load_seconds", "lgkv_save_seconds", "lgkv_saved_blocks")
    deadline = time.monotonic() + 30
    while True:
        with server.client() as c:
            text = c.get("/metrics").text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(families) and "_bucket" not in line:
                name = line.split("{", 1)[0].split(" ", 1)[0]
                samples[name] = samples.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if until(samples) or time.monotonic() > deadline:
            assert "# TYPE lgkv_load_seconds histogram" in text
            assert "# TYPE lgkv_saved_blocks_total counter" in text
            return samples
        time.sleep(0.2)


def test_no_kv_offload_session_api_is_503(plain_server: ServerProcess) -> None:
    server = plain_server
    with server.client() as c:
        r = c.get("/v1/sessions")
        assert r.status_code == 503
        assert "--no-kv-offload" in r.json()["error"]["message"]
        chat = c.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "prompt_cache_key": "plain",
            },
        )
        assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("ttl", [b"1e999", b"Infinity", b"NaN", b"-5", b"0", b"1e-05", b"1e12"])
def test_bad_ttl_is_refused_and_nothing_is_stored(lgkv_server: ServerProcess, ttl: bytes) -> None:
    body = b'{"id": "ttl-poison", "ttl_seconds": ' + ttl + b"}"
    headers = {"content-type": "application/json"}
    with lgkv_server.client() as c:
        r = c.post("/v1/sessions", content=body, headers=headers)
        assert r.status_code == 422, r.text
        assert "ttl_seconds" in r.json()["error"]["message"]
        assert c.get("/v1/sessions/ttl-poison").status_code == 404
        assert c.get("/v1/sessions").status_code == 200
        assert c.post("/v1/sessions", json={"id": "ttl-ok", "ttl_seconds": 60}).status_code in (
            201,
            409,
        )
        patched = c.patch("/v1/sessions/ttl-ok", content=b'{"ttl_seconds": ' + ttl + b"}",
                          headers=headers)  # fmt: skip
        assert patched.status_code == 422, patched.text
        assert c.get("/v1/sessions/ttl-ok").json()["ttl_seconds"] == 60


def test_listing_pages_by_cursor(lgkv_server: ServerProcess) -> None:
    """``next_cursor`` pages through every session exactly once, also while sessions are
    added between pages; the clients iterate with it; a malformed cursor is 400."""
    from langgraph_kvcache import KVCacheClient

    server = lgkv_server
    with server.client() as c:
        ids = {f"page-{i}" for i in range(7)}
        for sid in sorted(ids):
            assert c.post("/v1/sessions", json={"id": sid}).status_code == 201
        seen: list[str] = []
        first = c.get("/v1/sessions", params={"limit": 3}).json()
        seen += [s["id"] for s in first["data"]]
        assert first["next_cursor"] and len(first["data"]) == 3
        assert c.post("/v1/sessions", json={"id": "page-late"}).status_code == 201
        after = first["next_cursor"]
        while after is not None:
            page = c.get("/v1/sessions", params={"limit": 3, "after": after}).json()
            seen += [s["id"] for s in page["data"]]
            after = page["next_cursor"]
        assert len(seen) == len(set(seen)) and ids <= set(seen)
        bad = c.get("/v1/sessions", params={"after": "not-a-cursor"})
        assert bad.status_code == 400 and "cursor" in bad.json()["error"]["message"]
        with KVCacheClient(server.base_url) as client:
            listed = [s.id for s in client.iter_sessions(page_size=2)]
        assert len(listed) == len(set(listed)) and ids | {"page-late"} <= set(listed)
        for sid in ids | {"page-late"}:
            assert c.delete(f"/v1/sessions/{sid}").status_code == 200
