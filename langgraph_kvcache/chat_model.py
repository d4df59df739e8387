"""``ChatKVCache``: the LangChain chat model for the bundled langgraph-kvcache server.

It is ``langchain_openai.ChatOpenAI`` (the server speaks the OpenAI Chat Completions protocol)
with three differences:

1. Defaults point at the bundled server: ``base_url`` is ``$LGKV_SERVER_URL/v1`` (else
   ``http://127.0.0.1:8000/v1``), ``api_key`` is ``$LGKV_API_KEY`` (else ``"EMPTY"``, which a server
   without ``--api-key`` accepts), ``model`` is ``"SmolLM2-135M-Instruct"``, ``temperature`` is 0
   (greedy decoding: the same history gives the same answer, which keeps examples and tests
   reproducible; pass ``temperature=0.7`` or so for varied answers), ``stream_usage`` is on
   (the server reports usage in the last streamed chunk) and the Responses API is off.
2. Every request names its KV-cache session (sent as the OpenAI body field ``prompt_cache_key``,
   in the id syntax of ``langgraph_kvcache.contract``), so the server keeps the conversation's
   KV between turns. The session
   is, first match wins:

   - a per-call ``session_id=`` (or ``prompt_cache_key=``) keyword, also via ``.bind(...)``;
   - the ``session_id`` field given to the constructor (or ``model_kwargs["prompt_cache_key"]``);
   - ``config["configurable"]["session_id"]`` of the config passed to ``invoke``/``stream``/...,
     or of the LangGraph node that is running;
   - ``session_id_for(thread_id, checkpoint_ns)`` from that config: the thread's session in
     the root graph, ``"<thread>|<subgraph>"`` inside a subgraph;
   - none: the request still reuses cached prefixes by content, it is just not recorded under a
     session.
   The same session goes in the ``X-Session-ID`` request header
   (:data:`langgraph_kvcache.contract.SESSION_HEADER`), so a router in front of several
   replicas (``vllm-router --policy consistent_hash``) keeps the thread on one replica.
3. ``usage_metadata["input_token_details"]["cache_read"]`` is the number of prompt tokens whose
   KV came from the cache (the server's ``usage.prompt_tokens_details.cached_tokens``); this
   mapping is ChatOpenAI's own and works for ``invoke`` and ``stream`` alike.

A failed request (connection error, HTTP 408/409/429/5xx: e.g. a replica killed while it
answered) is retried by the OpenAI client, ``max_retries`` times (its default: 2) with
backoff; ``include_response_headers=True`` puts the answer's headers, the replica's
``x-lgkv-replica`` among them, in ``response_metadata["headers"]``.

Streaming, tool calling (``bind_tools``), ``with_structured_output`` and the async methods are
ChatOpenAI's; the session is applied on all of them. One difference in structured output: JSON
mode given a schema (``with_structured_output(Schema, method="json_mode")``) is served as
``json_schema``, since the server (vLLM's structured outputs) can hold the answer to the schema
and not just to "some JSON object"; a small model in plain JSON mode may nest objects until
its token limit. Without a schema, JSON mode is plain ``{"type": "json_object"}``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Final, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config
from langchain_openai import ChatOpenAI
from pydantic import Field, model_validator

from langgraph_kvcache.contract import SESSION_HEADER
from langgraph_kvcache.sessions import (
    current_config,
    session_id_from_config,
    validate_session_id,
)

__all__ = ["DEFAULT_MODEL", "ChatKVCache", "default_base_url"]

DEFAULT_MODEL: Final = "SmolLM2-135M-Instruct"
DEFAULT_SERVER_URL: Final = "http://127.0.0.1:8000"
SESSION_FIELD: Final = "prompt_cache_key"
"""Request body field that carries the session id to the server."""


def default_base_url() -> str:
    """``$LGKV_SERVER_URL`` (server root) + ``/v1``; ``http://127.0.0.1:8000/v1`` if unset."""
    root = (os.environ.get("LGKV_SERVER_URL") or DEFAULT_SERVER_URL).rstrip("/")
    return root if root.endswith("/v1") else f"{root}/v1"


def _given(values: Mapping[str, Any], *names: str) -> bool:
    return any(values.get(name) is not None for name in names)


class ChatKVCache(ChatOpenAI):
    """Chat model for the langgraph-kvcache server; the session follows the LangGraph thread.

    ```python
    from langgraph_kvcache import ChatKVCache

    model = ChatKVCache()  # server at $LGKV_SERVER_URL or http://127.0.0.1:8000

    def agent(state: MessagesState) -> dict:
        # inside a node: the session is this run's thread_id, nothing to pass
        return {"messages": [model.invoke(state["messages"])]}

    model.invoke("Hi", config={"configurable": {"thread_id": "t1"}})  # session "t1"
    model.invoke("Hi", session_id="my-session")  # explicit session
    ```
    """

    model_name: str = Field(default=DEFAULT_MODEL, alias="model")
    """Served model name (the server's ``--served-model-name``)."""

    temperature: float | None = 0.0
    """Sampling temperature; 0 (greedy) by default for reproducible answers."""

    stream_usage: bool | None = True
    """Report token usage, cached tokens included, in the last chunk when streaming."""

    use_responses_api: bool | None = False
    """The server serves Chat Completions; keep this off."""

    session_id: str | None = None
    """Fixed session for every call of this model; ``None``: follow the running thread."""

    @model_validator(mode="before")
    @classmethod
    def _server_defaults(cls, values: Any) -> Any:
        """Fill ``base_url``/``api_key`` from the LGKV_* variables, not the OPENAI_* ones."""
        if not isinstance(values, dict):
            return values
        values = dict(values)
        if not _given(values, "base_url", "openai_api_base"):
            values["base_url"] = default_base_url()
        if not _given(values, "api_key", "openai_api_key"):
            values["api_key"] = os.environ.get("LGKV_API_KEY") or "EMPTY"
        if values.get("session_id") is not None:
            validate_session_id(values["session_id"])
        return values

    # -- LangChain metadata -------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "kvcache-chat"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """No: ``langchain_core.load`` only revives classes on its own allowlist.

        ChatOpenAI says yes and would be revived as a plain ChatOpenAI that sends no session;
        build a new ``ChatKVCache`` from your settings instead.
        """
        return False

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """``["langgraph_kvcache", "chat_model"]`` (where this class lives)."""
        return ["langgraph_kvcache", "chat_model"]

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "langgraph-kvcache"
        return params

    # -- structured output --------------------------------------------------------------------
    def with_structured_output(
        self,
        schema: Any = None,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """ChatOpenAI's, except that ``method="json_mode"`` with a ``schema`` is served as
        ``"json_schema"``: the answer is held to the schema by the server, parsed the same way
        (a Pydantic instance for a Pydantic class, else a dict). Without a schema, JSON mode is
        unchanged (any JSON object)."""
        if method == "json_mode" and schema is not None:
            method = "json_schema"
        return super().with_structured_output(
            schema, method=method, include_raw=include_raw, strict=strict, **kwargs
        )

    # -- session resolution -------------------------------------------------------------------
    def resolve_session_id(
        self, config: RunnableConfig | Mapping[str, Any] | None = None, **kwargs: Any
    ) -> str | None:
        """The session a call with these ``kwargs`` under ``config`` would use (see module doc).

        ``config=None`` means the config of the running graph node, if any.
        """
        explicit = kwargs.get("session_id")
        if explicit is None:
            explicit = kwargs.get(SESSION_FIELD)
        if explicit is None:
            explicit = self.session_id
        if explicit is None:
            explicit = self.model_kwargs.get(SESSION_FIELD)
        if explicit is not None:
            return validate_session_id(str(explicit))
        return session_id_from_config(config if config is not None else current_config())

    def _with_session(
        self, config: RunnableConfig | Mapping[str, Any] | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """``kwargs`` with ``session_id`` replaced by the resolved ``prompt_cache_key``."""
        sid = self.resolve_session_id(config, **kwargs)
        out = {k: v for k, v in kwargs.items() if k != "session_id"}
        if sid is not None:
            out[SESSION_FIELD] = sid
        return out

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """ChatOpenAI's ``invoke`` with the session taken from ``config`` (or the running node)."""
        config = ensure_config(config)
        return super().invoke(input, config, stop=stop, **self._with_session(config, kwargs))

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """Async :meth:`invoke`."""
        config = ensure_config(config)
        kwargs = self._with_session(config, kwargs)
        return await super().ainvoke(input, config, stop=stop, **kwargs)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        """ChatOpenAI's ``stream`` with the session taken from ``config`` (or the running node)."""
        config = ensure_config(config)
        yield from super().stream(input, config, stop=stop, **self._with_session(config, kwargs))

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        """Async :meth:`stream`."""
        config = ensure_config(config)
        kwargs = self._with_session(config, kwargs)
        async for chunk in super().astream(input, config, stop=stop, **kwargs):
            yield chunk

    def _get_request_payload(
        self,
        input_: LanguageModelInput,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> dict:
        """Every request path (_generate, _agenerate, _stream, _astream) builds its body here.

        Calls that bypass :meth:`invoke`/:meth:`stream` (``generate``, ``agenerate``, callbacks
        that call ``_generate`` directly) still get their session: from their own keywords, the
        ``session_id`` field, or the running node's config. A request with a session also
        names it in the ``X-Session-ID`` header (the OpenAI client's ``extra_headers``).
        """
        kwargs = self._with_session(None, kwargs)
        payload = super()._get_request_payload(input_, stop=stop, **kwargs)
        sid = payload.get(SESSION_FIELD)
        if sid is not None:
            payload["extra_headers"] = {**(payload.get("extra_headers") or {}), SESSION_HEADER: sid}
        return payload
