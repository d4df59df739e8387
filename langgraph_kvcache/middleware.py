"""Context edits that keep the server's KV reusable, as LangChain 1.x agent middleware.

:class:`SteppedTrimMiddleware` trims what each model call of an agent sees with
:func:`langgraph_kvcache.trim_messages_stepped` (see :mod:`langgraph_kvcache.trim`): the cut
moves in steps, so most calls extend the previous call's prompt token for token and the server
reads it from the cache. The agent's state keeps every message (the thread's checkpoints are
unchanged); only the model's input is trimmed, the same way on every call, every process and
every rerun. ::

    from langchain.agents import create_agent
    from langgraph_kvcache import ChatKVCache
    from langgraph_kvcache.middleware import SteppedTrimMiddleware

    agent = create_agent(
        ChatKVCache(), tools, middleware=[SteppedTrimMiddleware(max_tokens=2000)]
    )

:class:`CachedSummarizationMiddleware` is LangChain's ``SummarizationMiddleware`` with its
summary call placed where the cache can serve it: the call continues the agent's own
conversation (its system prompt, its tools, the messages to summarise, then an instruction) in
the thread's session, so the server reads those messages' KV instead of recomputing a copy of
them pasted into a fresh prompt. ::

    agent = create_agent(
        ChatKVCache(), tools,
        middleware=[CachedSummarizationMiddleware(ChatKVCache(), trigger=("tokens", 3000))],
    )

Needs the ``langchain`` package (1.x); ``import langgraph_kvcache`` does not import it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, RemoveMessage
from langgraph.constants import TAG_NOSTREAM
from langgraph.types import Command

from langgraph_kvcache.trim import TokenCounter, count_with, trim_messages_stepped

try:
    from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
    from langchain.agents.middleware import summarization as _summarization
    from langchain.agents.middleware.summarization import SummarizationMiddleware
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "langgraph_kvcache.middleware needs LangChain 1.x's agents: pip install 'langchain>=1,<2'"
    ) from exc

log = logging.getLogger(__name__)

try:  # a later 1.x addition: how wrap_model_call writes the agent's state
    from langchain.agents.middleware.types import ExtendedModelResponse
except ImportError:  # pragma: no cover - depends on the installed LangChain
    ExtendedModelResponse = None  # type: ignore[assignment,misc]

__all__ = ["CachedSummarizationMiddleware", "SteppedTrimMiddleware"]

SUMMARY_INSTRUCTION = (
    "Summarize the conversation above for your own later use: the user's requests, the facts "
    "found and the answers given. Reply with the summary only."
)
"""The instruction that ends :class:`CachedSummarizationMiddleware`'s summary call."""


class SteppedTrimMiddleware(AgentMiddleware):  # type: ignore[type-arg]
    """Trim each model call's messages in steps (see the module doc).

    Args:
        max_tokens: the most tokens a call's messages and system prompt may hold together
            (by ``token_counter``), as with ``trim_messages``.
        step_tokens: how far the cut moves at once (default: half the budget left after the
            system prompt).
        token_counter: a function of a list of messages, a chat model, or ``"approximate"``.
        start_on: message type(s) the kept history starts with: by default a human or an AI
            message, never a tool result without the call it answers.
    """

    def __init__(
        self,
        max_tokens: int,
        *,
        step_tokens: int | None = None,
        token_counter: TokenCounter = "approximate",
        start_on: type[BaseMessage] | Sequence[type[BaseMessage]] = (HumanMessage, AIMessage),
    ) -> None:
        super().__init__()
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.step_tokens = step_tokens
        self.token_counter = token_counter
        self.start_on = start_on

    def trimmed(self, request: ModelRequest) -> ModelRequest:
        """The request with its messages trimmed (the same request when nothing is cut)."""
        system = [request.system_message] if request.system_message is not None else []
        budget = self.max_tokens - (count_with(self.token_counter)(system) if system else 0)
        if budget <= 0:
            raise ValueError(
                f"the system prompt alone holds {self.max_tokens - budget} tokens, more than "
                f"max_tokens={self.max_tokens}; raise max_tokens or shorten it"
            )
        kept = trim_messages_stepped(
            request.messages,
            max_tokens=budget,
            step_tokens=self.step_tokens,
            token_counter=self.token_counter,
            include_system=False,
            start_on=self.start_on,
        )
        return request if len(kept) == len(request.messages) else request.override(messages=kept)

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> Any:
        """Call the model with the trimmed messages."""
        return handler(self.trimmed(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        """Async :meth:`wrap_model_call`."""
        return await handler(self.trimmed(request))


class CachedSummarizationMiddleware(SummarizationMiddleware):  # type: ignore[type-arg]
    """``SummarizationMiddleware`` whose summary call reads the conversation from the cache.

    LangChain's middleware writes the summary with a fresh prompt: the messages to summarise
    pasted as text into ``summary_prompt``. Nothing of that prompt was ever computed, so the
    server recomputes the whole history at the moment it is longest. This subclass decides when
    and what to summarise exactly as its parent does (``trigger``, ``keep``, ``token_counter``,
    tool calls kept with their results), but it summarises inside the agent's model call, where
    it knows the agent's system prompt and tools: the summary call is the agent's own prompt up
    to the cut (system prompt, tools, the messages to summarise) followed by ``instruction``,
    sent with ``tool_choice="none"`` and the call's model settings (a ``cache_salt`` among them)
    through the agent's model in the thread's session. Its prompt extends the earlier calls'
    prompts token for token, so the server serves it from the thread's KV. The summary then
    takes the place of the summarised messages in the agent's state (the first one's id; the
    others are removed by id, so other middleware's changes to the call's messages stay theirs),
    and the same model call goes on with the summary and the kept messages.

    It reads the model call as its own layer sees it (messages, tools, system prompt, model
    settings): list it last, after middleware that rewrites any of them. With a
    ``response_format`` the agent binds tools it cannot rebuild, so it falls back to
    LangChain's own summary call (computed in full), with a warning. On a turn that
    summarises, ``stream_mode="updates"`` gives the model node's update as a list (the answer,
    then the summary's change), as for any middleware that returns a ``Command``.

    What the cache serves after a summary (exact reuse): the summary call reads the history up
    to the cut; the first call after it recomputes the summary and the kept messages (their
    positions moved); the calls after that extend it again.

    Args:
        model: the agent's chat model (token counting and fractional limits, as the parent).
        instruction: the user message that asks for the summary.
        max_summary_tokens: the summary's token limit (512). An empty summary (all of it
            reasoning, say) leaves the history whole for that call, with a warning; a cut one
            is kept, with a warning.
        trigger, keep, token_counter: as ``SummarizationMiddleware``. Nothing is trimmed before
            the summary call (``trim_tokens_to_summarize``): its prompt is what the agent's
            last call already held, plus the instruction.
    """

    def __init__(
        self,
        model: str | BaseChatModel,
        *,
        instruction: str = SUMMARY_INSTRUCTION,
        max_summary_tokens: int = 512,
        **kwargs: Any,
    ) -> None:
        if ExtendedModelResponse is None:  # pragma: no cover - depends on the installed LangChain
            raise ImportError(
                "CachedSummarizationMiddleware needs a LangChain 1.x with "
                "langchain.agents.middleware.types.ExtendedModelResponse: pip install -U langchain"
            )
        for name in ("summary_prompt", "summarizer", "trim_tokens_to_summarize"):
            if name in kwargs:
                raise TypeError(
                    f"CachedSummarizationMiddleware takes no {name!r}: its summary call is the "
                    "agent's own prompt plus `instruction`"
                )
        if max_summary_tokens <= 0:
            raise ValueError(f"max_summary_tokens must be > 0, got {max_summary_tokens}")
        super().__init__(model, trim_tokens_to_summarize=None, **kwargs)
        self.instruction = instruction
        self.max_summary_tokens = max_summary_tokens
        self._warned_fallback = False

    # the parent summarises in before_model; this one inside the model call only, and adds no
    # graph node of its own (the agent factory adds one for any overridden before_model)
    before_model = AgentMiddleware.before_model
    abefore_model = AgentMiddleware.abefore_model

    def plan(
        self, request: ModelRequest
    ) -> tuple[list[AnyMessage], list[AnyMessage], list[str]] | None:
        """The messages to summarise, those kept and the state ids of the first, or None when
        no summary is due (or the messages to summarise are not the agent's state's, so there
        is nothing to replace)."""
        messages = list(request.messages)
        self._ensure_message_ids(messages)
        if not self._should_summarize(messages, self.token_counter(messages)):
            return None
        cutoff = self._determine_cutoff_index(messages)
        if cutoff <= 0:
            return None
        to_summarize, kept = self._partition_messages(messages, cutoff)
        in_state = {m.id for m in (request.state or {}).get("messages", [])}
        ids = [m.id for m in to_summarize if m.id in in_state]
        return (to_summarize, kept, ids) if ids else None

    def summary_call(self, request: ModelRequest, to_summarize: list[AnyMessage]) -> tuple[
        Any, list[BaseMessage]
    ]:  # fmt: skip
        """The model (the agent's, with its tools, ``tool_choice="none"`` and the call's model
        settings) and the messages of the summary call: the agent's prompt up to the cut, then
        the instruction."""
        model: Any = request.model
        settings = {k: v for k, v in request.model_settings.items() if k != "tool_choice"}
        if request.tools:
            model = model.bind_tools(request.tools, tool_choice="none", **settings)
        elif settings:
            model = model.bind(**settings)
        model = model.bind(max_tokens=self.max_summary_tokens)
        system = [request.system_message] if request.system_message is not None else []
        return model, [*system, *to_summarize, HumanMessage(content=self.instruction)]

    def _summary_text(self, answer: BaseMessage) -> str:
        text = answer.text.strip()
        if not text:
            log.warning(
                "the summary call answered no text (all of it reasoning, or cut at "
                "max_summary_tokens=%d): the history is kept whole for this call",
                self.max_summary_tokens,
            )
        elif (answer.response_metadata or {}).get("finish_reason") == "length":
            log.warning("the summary was cut at max_summary_tokens=%d", self.max_summary_tokens)
        return text

    def _needs_fallback(self, request: ModelRequest) -> bool:
        """With a ``response_format`` the agent binds tools this middleware cannot rebuild
        (structured output tools, strict schemas), so its summary call would not extend the
        agent's prompt: LangChain's own summary call is made instead (not read from cache)."""
        if request.response_format is None:
            return False
        if not self._warned_fallback:
            self._warned_fallback = True
            log.warning(
                "an agent with a response_format: summaries use LangChain's own summary prompt, "
                "which the server computes in full (its tools cannot be rebuilt here)"
            )
        return True

    def _written(
        self, request: ModelRequest, text: str, kept: list[AnyMessage], ids: list[str]
    ) -> tuple[ModelRequest, Any]:
        """The request with the summary in place of the summarised messages, and the state
        update: the summary takes the first summarised message's place (its id), the others
        are removed by id; every other message of the state stays as it is."""
        head = self._build_new_messages(text)[0].model_copy(update={"id": ids[0]})
        update = [head, *(RemoveMessage(id=i) for i in ids[1:])]
        return request.override(messages=[head, *kept]), Command(update={"messages": update})

    @staticmethod
    def _with_command(response: Any, command: Command) -> Any:
        if not isinstance(response, ModelResponse):
            response = ModelResponse(result=[response])
        return ExtendedModelResponse(model_response=response, command=command)

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> Any:
        """Summarise first when due (see the class doc), then call the model."""
        plan = self.plan(request)
        if plan is None:
            return handler(request)
        to_summarize, kept, ids = plan
        if self._needs_fallback(request):
            text = self._create_summary(to_summarize)
        else:
            model, prompt = self.summary_call(request, to_summarize)
            text = self._summary_text(model.invoke(prompt, config=_summary_config()))
        if not text:
            return handler(request)
        summarized, command = self._written(request, text, kept, ids)
        return self._with_command(handler(summarized), command)

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        """Async :meth:`wrap_model_call`."""
        plan = self.plan(request)
        if plan is None:
            return await handler(request)
        to_summarize, kept, ids = plan
        if self._needs_fallback(request):
            text = await self._acreate_summary(to_summarize)
        else:
            model, prompt = self.summary_call(request, to_summarize)
            answer = await model.ainvoke(prompt, config=_summary_config())
            text = self._summary_text(answer)
        if not text:
            return await handler(request)
        summarized, command = self._written(request, text, kept, ids)
        return self._with_command(await handler(summarized), command)


def _summary_config() -> Any:
    """The config of LangChain's own summary calls (marked internal, never streamed to the
    caller), or the same marks where this LangChain has no such function."""
    own = getattr(_summarization, "_summary_config", None)
    if callable(own):
        return own()
    return {"metadata": {"lc_source": "summarization"}, "tags": [TAG_NOSTREAM]}
