"""langchain-tests' standard unit tests for ChatKVCache (no server needed)."""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from langgraph_kvcache import ChatKVCache


class TestChatKVCacheUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVCache]:
        return ChatKVCache

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "SmolLM2-135M-Instruct", "base_url": "http://127.0.0.1:8000/v1"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"LGKV_SERVER_URL": "http://kv-host:9000", "LGKV_API_KEY": "sk-from-env"},
            {},
            {"openai_api_base": "http://kv-host:9000/v1", "openai_api_key": "sk-from-env"},
        )

    @property
    def model_override_value(self) -> str:
        return "tiny-llama"
