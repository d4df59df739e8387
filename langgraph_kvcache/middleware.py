"""Stepped trimming as a LangChain 1.x agent middleware, for ``create_agent``.

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

Needs the ``langchain`` package (1.x); ``import langgraph_kvcache`` does not import it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from langgraph_kvcache.trim import TokenCounter, count_with, trim_messages_stepped

try:
    from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "langgraph_kvcache.middleware needs LangChain 1.x's agents: pip install 'langchain>=1,<2'"
    ) from exc

__all__ = ["SteppedTrimMiddleware"]


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
