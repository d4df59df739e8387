"""End to end: the default model (SmolLM2-135M-Instruct) answers over HTTP, sensibly (on the
server the agent and chat tests share)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.vllm


def test_smollm2_answers_the_capital_of_france(smollm2_server: ServerProcess) -> None:
    server = smollm2_server
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 30,
                "temperature": 0,
                "prompt_cache_key": "smollm2-e2e",
            },
        )
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "paris" in answer.lower(), answer
