"""Tenants and keys on a real keyed server: every route of vLLM's app is keyed or refused, and
no route lets one tenant read or replace another tenant's KV or sessions."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import pytest

from server.api.routes import GENERATION_PATHS, is_served
from tests.integration.conftest import wait_until
from tests.integration.server.tenant_requests import (
    ALICE,
    BOB,
    KEYED_FLAGS,
    PROMPT,
    VLLM_GENERATION_ROUTES,
    cached,
    chat_body,
    concrete,
    own_only,
    route_table,
)

if TYPE_CHECKING:
    from pathlib import Path

    import httpx

    from tests.integration.conftest import ServerFactory, ServerProcess

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def keyed(start_server: ServerFactory) -> ServerProcess:
    return start_server(*KEYED_FLAGS)


@pytest.fixture(scope="module")
def vllm_route_table(server_model_dir: Path) -> list[tuple[str, str]]:
    return route_table(server_model_dir)


def test_every_vllm_route_needs_a_key_or_is_refused(
    keyed: ServerProcess, vllm_route_table: list[tuple[str, str]]
) -> None:
    assert len(vllm_route_table) > 20
    for path in VLLM_GENERATION_ROUTES:
        assert path in {p for _, p in vllm_route_table}, f"vLLM no longer serves {path}?"
    with keyed.client() as c:
        for method, path in vllm_route_table:
            url = concrete(path)
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


def test_no_route_reads_or_replaces_another_tenants_kv(keyed: ServerProcess) -> None:
    with keyed.client() as c:
        model = keyed.model
        first = c.post("/v1/chat/completions", json=chat_body(model, session_id="vault"),
                       headers=ALICE)  # fmt: skip
        assert own_only(cached(first))
        assert cached(c.post("/v1/chat/completions", json=chat_body(model, session_id="vault"),
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
            response = {"model": model, "input": f"Response {i}. {PROMPT}",
                        "max_output_tokens": 2}  # fmt: skip
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion),
                               ("/v1/responses", response)):  # fmt: skip
                assert own_only(cached(c.post(path, json=body, headers=ALICE)))
                assert cached(c.post(path, json=body, headers=ALICE)) >= 256  # hers, cached
                bob = cached(c.post(path, json={**body, **extra}, headers=BOB))
                assert own_only(bob), (bob, extra)
        for path in VLLM_GENERATION_ROUTES:
            body = {**chat_body(model), "input": PROMPT, "cache_salt": f"lgkv-{tenant}",
                    "vllm_xargs": {"tenant": tenant, "session_id": "vault"}}  # fmt: skip
            r = c.post(path, json=body, headers=BOB)
            assert r.status_code == 404, (path, r.text)
        assert set(GENERATION_PATHS) == {"/v1/chat/completions", "/v1/completions",
                                         "/v1/responses"}  # each tried above  # fmt: skip
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
        assert own_only(theirs["usage"]["prompt_tokens_details"]["cached_tokens"])
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
            body = {**chat_body(keyed.model, session_id="xargs"), "vllm_xargs": {owned: value}}
            r = c.post("/v1/chat/completions", json=body, headers=ALICE)
            assert r.status_code == 400, r.text
            assert f"vllm_xargs.{owned}" in r.json()["error"]["message"]
        assert c.get("/v1/sessions/xargs", headers=ALICE).status_code == 404


def test_quotas_keep_room_for_other_tenants(keyed: ServerProcess) -> None:
    """One key pinned every block (B's sessions were never saved) and held any number of
    sessions. Now: pins past two without a lease, past a quarter of a tier, or with a lease
    past --max-pin-lease are refused; sessions past --tenant-max-sessions too; B keeps saving
    and hitting while A sits at its quotas."""
    with keyed.client() as c:
        model = keyed.model
        for i in range(4):
            hog = chat_body(model, session_id=f"hog-{i}")
            hog["messages"] = [{"role": "user", "content": f"Hog {i}. {PROMPT}"}]
            assert c.post("/v1/chat/completions", json=hog, headers=ALICE).status_code == 200
        blocks = c.get("/v1/sessions/hog-0", headers=ALICE).json()["num_blocks"]
        assert 4 <= blocks <= 6  # a tenth of 64 RAM slots (6.4) holds one such session, not two
        too_long = c.post("/v1/sessions/hog-0/pin", json={"pin_ttl_seconds": 7200}, headers=ALICE)
        assert too_long.status_code == 409 and "--max-pin-lease" in too_long.text
        lease = {"pin_ttl_seconds": 600}
        assert c.post("/v1/sessions/hog-0/pin", json=lease, headers=ALICE).status_code == 200
        second = c.post("/v1/sessions/hog-1/pin", json=lease, headers=ALICE)
        assert second.status_code == 409, second.text
        assert "--tenant-pin-share" in second.text and "ram tier" in second.text
        assert not c.get("/v1/sessions/hog-1", headers=ALICE).json()["pinned"]
        for sid in ("empty-0", "empty-1", "empty-2"):
            assert c.post("/v1/sessions", json={"id": sid}, headers=ALICE).status_code == 201
        assert c.post("/v1/sessions/empty-0/pin", headers=ALICE).status_code == 200
        assert c.post("/v1/sessions/empty-1/pin", headers=ALICE).status_code == 200
        third = c.post("/v1/sessions/empty-2/pin", headers=ALICE)
        assert third.status_code == 409 and "--tenant-max-unleased-pins" in third.text
        again = c.post("/v1/sessions/empty-0/pin", headers=ALICE)  # renewing is no new pin
        assert again.status_code == 200, again.text
        assert c.post("/v1/sessions/hog-0/pin", json=lease, headers=ALICE).status_code == 200

        bob = chat_body(model, session_id="bob-works")
        bob["messages"] = [{"role": "user", "content": f"Bob's own work. {PROMPT}"}]
        assert own_only(cached(c.post("/v1/chat/completions", json=bob, headers=BOB)))
        assert cached(c.post("/v1/chat/completions", json=bob, headers=BOB)) >= 256
        tiers: dict = {}
        for _ in range(50):  # the engine publishes block locations moments after the turn
            tiers = c.get("/v1/sessions/bob-works", headers=BOB).json()["tiers"]
            if tiers["disk"]["blocks"] >= 3 and tiers["ram"]["blocks"] >= 1:
                break
            time.sleep(0.1)
        assert tiers["disk"]["blocks"] >= 3 and tiers["ram"]["blocks"] >= 1, tiers

        created, refused = 0, None
        for i in range(60):
            r = c.post("/v1/sessions", json={"id": f"many-{i}"}, headers=ALICE)
            if r.status_code != 201:
                refused = r
                break
            created += 1
        assert refused is not None and refused.status_code == 429, created
        assert "--tenant-max-sessions" in refused.json()["error"]["message"]
        new = c.post("/v1/chat/completions", json=chat_body(model, session_id="one-more"),
                     headers=ALICE)  # fmt: skip
        assert new.status_code == 429, new.text
        old = c.post("/v1/chat/completions", json=chat_body(model, session_id="hog-3"),
                     headers=ALICE)  # fmt: skip
        assert old.status_code == 200, old.text  # an existing session goes on
        copy = c.post("/v1/sessions/hog-3/copy", json={"target_id": "hog-copy"}, headers=ALICE)
        assert copy.status_code == 429
        assert c.post("/v1/sessions", json={"id": "bob-new"}, headers=BOB).status_code == 201
        for i in range(created):
            assert c.delete(f"/v1/sessions/many-{i}", headers=ALICE).status_code == 200


def test_a_saver_without_the_key_fails_loudly_and_loses_no_delete(
    keyed: ServerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A saver without ``kv_api_key`` on a keyed server worked, had every call refused with
    401 and dropped them: the thread's server session outlived ``delete_thread``. Now
    ``setup()`` raises with the key problem, and a delete stays in the outbox until a saver
    with the key makes it."""
    from langgraph_kvcache import KVCacheClient
    from langgraph_kvcache.checkpoint import SQLAlchemySaver
    from langgraph_kvcache.checkpoint.sessions.store import op_pending
    from langgraph_kvcache.client import AuthenticationError, SessionNotFoundError
    from langgraph_kvcache.sessions import session_id_for

    db = f"sqlite:///{tmp_path / 'keyless.db'}"
    thread = "keyless-thread"
    alice = KVCacheClient(keyed.base_url, "key-alice")
    alice.create_session(session_id_for(thread, ""))
    with SQLAlchemySaver.from_conn_string(db, kv_server=keyed.base_url) as saver:
        with pytest.raises(AuthenticationError, match="kv_api_key="):
            saver.setup()
        with caplog.at_level("ERROR", "langgraph_kvcache"):
            saver.delete_thread(thread)
        assert "refused the saver's key" in caplog.text
        pending = [(p.call.op, p.call.session_id) for p in saver._run(op_pending(10))]
        assert pending == [("delete", session_id_for(thread, ""))]
    assert alice.get_session(session_id_for(thread, "")).id  # still there: not deleted yet
    with SQLAlchemySaver.from_conn_string(
        db, kv_server=keyed.base_url, kv_api_key="key-alice"
    ) as saver:
        saver.setup()  # the right key: no error, and the pending delete is made
        saver.kv_sessions.drain()  # type: ignore[union-attr]
        assert saver._run(op_pending(10)) == []
    with pytest.raises(SessionNotFoundError):
        alice.get_session(session_id_for(thread, ""))
    alice.close()


def test_one_key_cannot_fill_the_batch(keyed: ServerProcess) -> None:
    """vLLM serves first come, first served: one key that kept its batch (--max-num-seqs 8)
    full made every other key wait for a slot (tenant B's first token 39 ms -> 4.6 s in
    benchmarks/tenants.py). Now a key runs at most --tenant-generation-share (0.5) of the
    batch at once, its further generations wait in the API process in order, and another
    key's request goes straight in."""
    import threading

    events: list[tuple[str, str]] = []  # (request, "first" | "end"), in the order they happened
    lock = threading.Lock()

    stop = threading.Event()  # set once bob is served: alice's streams then close early

    def stream(name: str, headers: dict[str, str], tokens: int) -> None:
        body = {"model": keyed.model, "messages": [{"role": "user", "content": f"Go {name}."}],
                "max_tokens": tokens, "ignore_eos": True, "stream": True}  # fmt: skip
        with keyed.client() as c, c.stream("POST", "/v1/chat/completions", json=body,
                                           headers=headers) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            first, ended = True, False
            for line in r.iter_lines():
                if line.startswith("data: {") and first:
                    with lock:
                        events.append((name, "first"))
                    first = False
                # The end is the chunk with the finish reason (the server sends it before it
                # frees the key's slot), or this client closing early: noted before it closes,
                # so no later "first" of the same key can be seen before it.
                if not ended and ('"finish_reason":"length"' in line.replace(" ", "")
                                  or (not first and stop.is_set())):  # fmt: skip
                    with lock:
                        events.append((name, "end"))
                    ended = True
                    break
        if not ended:
            with lock:
                events.append((name, "end"))

    # Alice's generations are as long as the context allows (a wave takes many times bob's
    # few tokens, even with the API process busy streaming hers on a loaded machine), and
    # close once bob is served, so the test does not wait for them to run out. (With 1900
    # tokens a CI run saw her first wave end on its own before bob was served, and her
    # queued streams' first lines read before her finished ones' last: 7 "at once".)
    alice = [threading.Thread(target=stream, args=(f"a{i}", ALICE, 4000)) for i in range(8)]
    for t in alice:
        t.start()
    wait_until(lambda: sum(e == "first" for _, e in events) >= 4, "alice's first four")
    bob = threading.Thread(target=stream, args=("b", BOB, 4))
    bob.start()
    bob.join(timeout=120)
    stop.set()
    for t in alice:
        t.join(timeout=120)
    streaming, most = set(), 0
    for name, what in events:
        if name.startswith("a"):
            (streaming.add if what == "first" else streaming.discard)(name)
            most = max(most, len(streaming))
    assert most == 4, [f"{n}:{e}" for n, e in events]  # alice never held more than half
    order = [f"{n}:{e}" for n, e in events]
    alice_starts = [i for i, (n, e) in enumerate(events) if e == "first" and n != "b"]
    assert len(alice_starts) == 8, order
    # Without the gate all eight of alice's would be in vLLM's batch before bob's one; with
    # it bob goes in beside her first four, before her queued ones have all started.
    assert order.index("b:first") < alice_starts[7], order


def test_the_responses_api_is_served_with_the_same_tenancy(keyed: ServerProcess) -> None:
    """``/v1/responses`` (what ChatOpenAI(use_responses_api=True) and OpenAI's SDK steer to)
    answered 404: it is served with chat's key check, tenant salt and session mapping, without
    stored responses."""

    def respond(headers: dict[str, str], **extra: object) -> httpx.Response:
        # Text no other test sends: vLLM's prefix cache (per tenant) holds nothing of it.
        body = {"model": keyed.model, "input": f"Responses only. {PROMPT}", "max_output_tokens": 2,
                "prompt_cache_key": "resp-s", **extra}  # fmt: skip
        with keyed.client() as c:
            return c.post("/v1/responses", json=body, headers=headers)

    def cached(r: httpx.Response) -> int:
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["input_tokens_details"]["cached_tokens"])

    assert own_only(cached(respond(ALICE)))
    assert cached(respond(ALICE)) >= 256  # the session's KV, as for chat
    with keyed.client() as c:
        wait_until(lambda: c.get("/v1/sessions/resp-s", headers=ALICE).status_code == 200,
                   "alice's responses session")  # fmt: skip
        assert c.get("/v1/sessions/resp-s", headers=BOB).status_code == 404
    assert own_only(cached(respond(BOB)))  # same text and session name, another tenant
    for field, value in (("previous_response_id", "resp_123"), ("background", True)):
        refused = respond(ALICE, **{field: value})
        assert refused.status_code == 400 and field in refused.json()["error"]["message"]


def test_large_bodies_pass_at_the_keys_body_rate(keyed: ServerProcess) -> None:
    """A key's bodies over 64 KiB pass at --tenant-body-rate (256 KiB/s here, from a bucket
    that holds one largest body): the next one at once gets 429 with Retry-After before it is
    read; another key's goes through."""
    big = json.dumps({"model": keyed.model, "prompt": [1] * (600 << 10), "max_tokens": 1})
    assert 1 << 20 < len(big) < 2 << 20
    alice, bob = ({**key, "Content-Type": "application/json"} for key in (ALICE, BOB))
    with keyed.client() as c:
        first = c.post("/v1/completions", content=big, headers=alice)
        assert first.status_code != 429, first.text  # vLLM's own answer (too long a prompt)
        refused = c.post("/v1/completions", content=big, headers=alice)
        assert refused.status_code == 429, refused.text
        assert "--tenant-body-rate" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 2
        assert c.post("/v1/completions", content=big, headers=bob).status_code != 429
        small = {"model": keyed.model, "prompt": "Hello", "max_tokens": 1}
        assert c.post("/v1/completions", json=small, headers=ALICE).status_code == 200


def test_a_key_past_its_session_rate_gets_429_and_the_other_key_goes_on(
    keyed: ServerProcess,
) -> None:
    """One key renewing pins as fast as it could took most of a core from the engine beside it
    (benchmarks/tenants.py (b)): past --tenant-session-rate (50 a second, bursts of 100) a
    key's calls get 429 with Retry-After, held up to a second; the other key goes on."""
    with keyed.client() as c:
        assert c.post("/v1/sessions", json={"id": "rate-a"}, headers=ALICE).status_code == 201
        answers = [c.get("/v1/sessions/rate-a", headers=ALICE) for _ in range(160)]
        refused = [r for r in answers if r.status_code == 429]
        assert refused and all(r.status_code in (200, 429) for r in answers)
        assert "--tenant-session-rate" in refused[0].json()["error"]["message"]
        assert int(refused[0].headers["Retry-After"]) >= 1
        assert c.get("/v1/sessions", headers=BOB).status_code == 200
