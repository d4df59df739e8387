"""``ChatKVCache(reuse=...)`` asks the server for exact or shifted reuse of the thread's KV."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from langgraph_kvcache import ChatKVCache


def test_reuse_is_sent_in_vllm_xargs_and_a_call_can_override_it(recorder: Any) -> None:
    shifted = ChatKVCache(base_url=f"{recorder.url}/v1", reuse="shifted", max_retries=0)
    shifted.invoke("a", session_id="s")
    shifted.invoke("b", session_id="s", extra_body={"vllm_xargs": {"lgkv_reuse": "exact"}})
    ChatKVCache(base_url=f"{recorder.url}/v1", max_retries=0).invoke("c", session_id="s")
    bodies = recorder.chat_bodies()
    assert bodies[0]["vllm_xargs"] == {"lgkv_reuse": "shifted"}
    assert bodies[0]["prompt_cache_key"] == "s"
    assert bodies[1]["vllm_xargs"] == {"lgkv_reuse": "exact"}
    assert "vllm_xargs" not in bodies[2]  # the server's --kv-reuse decides


def test_an_unknown_reuse_mode_is_refused_at_construction() -> None:
    with pytest.raises(ValidationError, match="reuse"):
        ChatKVCache(reuse="fuzzy")  # type: ignore[arg-type]
