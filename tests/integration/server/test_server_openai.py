"""The OpenAI routes of a real server subprocess (tiny model, session connector on)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.vllm

# > 2 KV blocks (128 tokens each on CPU), so a second turn can reuse whole blocks.
LONG_SYSTEM = "You are a careful assistant. " + " ".join(
    f"Fact {i}: the number {i} is written as {i * 7} in the secret code." for i in range(40)
)


def _chat(server: ServerProcess, messages: list[dict[str, str]], **extra: object) -> httpx.Response:
    body = {"model": server.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    body.update(extra)
    with server.client() as c:
        return c.post("/v1/chat/completions", json=body)


def test_models_lists_the_served_name(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [lgkv_server.model]


def test_engine_core_runs_in_its_own_process(lgkv_server: ServerProcess) -> None:
    import psutil

    assert lgkv_server.proc is not None
    children = psutil.Process(lgkv_server.proc.pid).children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) + p.name() for p in children)
    assert children, "the engine core should be a child process of the API server"
    assert "EngineCore" in names or "multiprocessing" in names, names


def test_health_and_metrics(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        assert c.get("/health").status_code == 200
        text = c.get("/metrics").text
    assert "vllm:" in text  # vLLM's own metrics
    assert "lgkv_sessions" in text  # ours from SessionControl.metrics()
    assert 'lgkv_hit_blocks_total{tier="ram"}' in text
    assert "# TYPE lgkv_hit_blocks_total counter" in text
    assert "# TYPE lgkv_tier_bytes gauge" in text
    helps = [line.split(" ", 3) for line in text.splitlines() if line.startswith("# HELP lgkv_")]
    assert helps and all(len(h) == 4 and h[3] != h[2].removesuffix("_total") for h in helps)


def test_chat_completion(lgkv_server: ServerProcess) -> None:
    r = _chat(lgkv_server, [{"role": "user", "content": "Hello"}])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] >= 1
    assert "prompt_tokens_details" in body["usage"]


def test_completion(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        r = c.post(
            "/v1/completions",
            json={"model": lgkv_server.model, "prompt": "Once upon", "max_tokens": 3},
        )
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_streaming_chat(lgkv_server: ServerProcess) -> None:
    body = {
        "model": lgkv_server.model,
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": "stream-session",
    }
    chunks = []
    with lgkv_server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_reach_the_prompt_with_auto_choice(lgkv_server: ServerProcess) -> None:
    question = [{"role": "user", "content": "Weather?"}]
    plain = _chat(lgkv_server, question)
    r = _chat(lgkv_server, question, tools=[WEATHER_TOOL], tool_choice="auto")
    assert r.status_code == 200, r.text
    # The bundled ChatML tool template lists the tool in the system turn.
    assert r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + 30


def test_a_tool_call_round_trip_renders(lgkv_server: ServerProcess) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"},
    ]
    r = _chat(lgkv_server, messages, tools=[WEATHER_TOOL], prompt_cache_key="tool-loop")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_second_turn_reports_cached_tokens(lgkv_server: ServerProcess) -> None:
    messages = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "What is fact 3?"},
    ]
    first = _chat(lgkv_server, messages, prompt_cache_key="cached-turns")
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"] or "ok"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And 4?"}]
    second = _chat(lgkv_server, messages, prompt_cache_key="cached-turns")
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] > 256
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 256


@pytest.mark.parametrize(
    ("how", "extra"),
    [
        ("prompt_cache_key", lambda sid: {"prompt_cache_key": sid}),
        ("session_id", lambda sid: {"session_id": sid}),
        ("vllm_xargs", lambda sid: {"vllm_xargs": {"session_id": sid}}),
    ],
)
def test_each_way_of_naming_a_session_reaches_the_connector(
    lgkv_server: ServerProcess, how: str, extra: object
) -> None:
    sid = f"named-by-{how}"
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi"}]
    r = _chat(lgkv_server, messages, **extra(sid))  # type: ignore[operator]
    assert r.status_code == 200, r.text
    with lgkv_server.client() as c:
        info = c.get(f"/v1/sessions/{sid}")
    assert info.status_code == 200, info.text
    session = info.json()
    assert session["tenant"] == "default"
    assert session["turns"] >= 1
    assert session["num_blocks"] >= 2


def test_bad_session_id_is_400(lgkv_server: ServerProcess) -> None:
    r = _chat(lgkv_server, [{"role": "user", "content": "x"}], session_id="../etc/passwd")
    assert r.status_code == 400
    assert "invalid session_id" in r.json()["error"]["message"]


def test_two_different_session_names_are_400(lgkv_server: ServerProcess) -> None:
    r = _chat(
        lgkv_server,
        [{"role": "user", "content": "x"}],
        prompt_cache_key="a1",
        vllm_xargs={"session_id": "b2"},
    )
    assert r.status_code == 400
    assert "two different sessions" in r.json()["error"]["message"]


def test_prompt_longer_than_context_is_400(lgkv_server: ServerProcess) -> None:
    r = _chat(lgkv_server, [{"role": "user", "content": "word " * 3000}])
    assert r.status_code == 400
    assert "maximum context length" in r.json()["error"]["message"]
    # 140 kB of token ids: checked in the body process (server.api.body_check), refused there
    ids = {"model": lgkv_server.model, "prompt": [12345] * 20_000, "max_tokens": 1}
    with lgkv_server.client() as c:
        r = c.post("/v1/completions", json=ids)
        assert r.status_code == 400, r.text
        assert "your prompt contains 20000 input tokens" in r.json()["error"]["message"]
        ids["prompt"] = [12345] * 20
        assert c.post("/v1/completions", json=ids).status_code == 200
    assert "body check process failed" not in lgkv_server.log_path.read_text(errors="replace")


def test_oversize_body_is_413(lgkv_server: ServerProcess) -> None:
    r = _chat(lgkv_server, [{"role": "user", "content": "x" * (9 << 20)}])
    assert r.status_code == 413
    assert "max-body-bytes" in r.json()["error"]["message"]


def test_body_that_is_not_json_is_400(lgkv_server: ServerProcess) -> None:
    with lgkv_server.client() as c:
        r = c.post(
            "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]
