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
from contextlib import contextmanager
from typing import Any, Final, Literal

import openai
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config
from langchain_openai import ChatOpenAI
from pydantic import Field, model_validator

from langgraph_kvcache.contract import SESSION_HEADER, XARG_REUSE
from langgraph_kvcache.cut_calls import StreamedCall, check_forced_call
from langgraph_kvcache.reasoning import keep_reasoning, keep_streamed_reasoning, send_reasoning
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
PROVIDER: Final = "langgraph-kvcache"
"""The provider this model names: LangSmith's ``ls_provider`` and each answer's
``response_metadata["model_provider"]``. One name for both, as LangChain's own middleware
compares them (``SummarizationMiddleware`` trusts the usage an answer reports only from the
model it summarises with), and messages outside OpenAI's translator take LangChain's general
``content_blocks`` parsing, which keeps vLLM's ``reasoning_content``."""


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
    """Chat Completions by default. The server also serves the Responses API
    (``/v1/responses``, same sessions and tenancy) but keeps no responses: a model that
    relies on ``previous_response_id`` gets 400."""

    session_id: str | None = None
    """Fixed session for every call of this model; ``None``: follow the running thread."""

    preserve_reasoning: bool = False
    """Keep every turn's reasoning in the prompt (:mod:`langgraph_kvcache.reasoning`): answers
    keep theirs in ``additional_kwargs["reasoning_content"]``, requests send it back and ask
    the chat template to keep it (``chat_template_kwargs.preserve_thinking``), so the next
    turn's prompt extends what the model generated and the server reads it from the cache."""

    reuse: Literal["exact", "shifted"] | None = None
    """How the server reuses this thread's KV (``vllm_xargs.lgkv_reuse``; None: the server's
    ``--kv-reuse``): ``"shifted"`` also reads the history a trim or summary moved to other
    positions, keys re-rotated (approximate KV, kept apart from exact requests')."""

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
        if values.get("preserve_reasoning") and values.get("use_responses_api"):
            raise ValueError(
                "preserve_reasoning works with Chat Completions only: leave use_responses_api "
                "off (the server keeps no responses, so reasoning cannot be sent back there)"
            )
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
        params["ls_provider"] = PROVIDER
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
        if self.preserve_reasoning and "messages" in payload:
            defaults = (self.extra_body, self.model_kwargs.get("extra_body"))
            payload = send_reasoning(payload, self._convert_input(input_).to_messages(), defaults)
        if self.reuse is not None:  # a call's own vllm_xargs.lgkv_reuse wins
            extra = dict(payload.get("extra_body") or {})
            extra["vllm_xargs"] = {XARG_REUSE: self.reuse, **(extra.get("vllm_xargs") or {})}
            payload["extra_body"] = extra
        sid = payload.get(SESSION_FIELD)
        if sid is not None:
            payload["extra_headers"] = {**(payload.get("extra_headers") or {}), SESSION_HEADER: sid}
        return payload

    def _create_chat_result(self, response: Any, generation_info: dict | None = None) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        for generation in result.generations:
            generation.message.response_metadata["model_provider"] = PROVIDER
        return keep_reasoning(result, response) if self.preserve_reasoning else result

    def _convert_chunk_to_generation_chunk(
        self, chunk: dict, default_chunk_class: type, base_generation_info: dict | None
    ) -> ChatGenerationChunk | None:
        out = super()._convert_chunk_to_generation_chunk(
            chunk, default_chunk_class, base_generation_info
        )
        if out is not None and "model_provider" in out.message.response_metadata:
            out.message.response_metadata["model_provider"] = PROVIDER
        return keep_streamed_reasoning(out, chunk) if self.preserve_reasoning else out

    # -- errors that say where and what ---------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        with self._explained():
            result = super()._generate(messages, *args, **kwargs)
        self._check_forced_call(kwargs, result.generations[-1].generation_info, result)
        return result

    async def _agenerate(
        self, messages: list[BaseMessage], *args: Any, **kwargs: Any
    ) -> ChatResult:
        with self._explained():
            result = await super()._agenerate(messages, *args, **kwargs)
        self._check_forced_call(kwargs, result.generations[-1].generation_info, result)
        return result

    def _stream(
        self, messages: list[BaseMessage], *args: Any, **kwargs: Any
    ) -> Iterator[ChatGenerationChunk]:
        cut = StreamedCall()
        with self._explained():
            for chunk in super()._stream(messages, *args, **kwargs):
                cut.add(chunk)
                yield chunk
        self._check_forced_call(kwargs, cut.info, cut)

    async def _astream(
        self, messages: list[BaseMessage], *args: Any, **kwargs: Any
    ) -> AsyncIterator[ChatGenerationChunk]:
        cut = StreamedCall()
        with self._explained():
            async for chunk in super()._astream(messages, *args, **kwargs):
                cut.add(chunk)
                yield chunk
        self._check_forced_call(kwargs, cut.info, cut)

    def _check_forced_call(
        self, kwargs: Mapping[str, Any], info: Mapping[str, Any] | None, result: object
    ) -> None:
        check_forced_call(kwargs, info, result, self.max_tokens)

    @contextmanager
    def _explained(self) -> Iterator[None]:
        """The OpenAI client's bare ``Connection error.`` / ``Request timed out.`` say what
        happened and where: the same exception types (code that catches them still does),
        with the server's URL and what to do."""
        try:
            yield
        except openai.APITimeoutError as exc:
            raise _with_message(
                exc,
                f"Request timed out: the langgraph-kvcache server at {self.openai_api_base} did "
                f"not answer within timeout={self.request_timeout!r} s; it may be busy (a long "
                "prompt, a full batch): retry, or raise the model's timeout",
            ) from exc
        except openai.APIConnectionError as exc:
            raise openai.APIConnectionError(
                message=f"Connection error: cannot reach the langgraph-kvcache server at "
                f"{self.openai_api_base} ({exc.__cause__ or exc}). Start it (`make demo` or "
                "`python -m server`) or set LGKV_SERVER_URL / base_url to where it runs",
                request=exc.request,
            ) from exc


def _with_message(exc: openai.APITimeoutError, message: str) -> openai.APITimeoutError:
    out = openai.APITimeoutError(request=exc.request)
    out.message = message
    out.args = (message,)
    return out
