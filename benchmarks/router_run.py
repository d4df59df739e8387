"""One run of ``benchmarks/router.py``: threads that each hold a conversation through
``ChatKVCache``, all threads of a turn at once, recording every turn (:class:`Call`: its
replica, cached tokens, answer, times) and every HTTP attempt the client made (:class:`Run`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from langgraph_kvcache.contract import REPLICA_HEADER, SESSION_HEADER

TOPICS = ("rivers", "volcanoes", "libraries", "trains", "bees", "glaciers", "chess", "bread")
QUESTIONS = (
    "Tell me one surprising fact about {topic}.",
    "Why is that so?",
    "Give an example from a particular place.",
    "What would you tell a child about it?",
    "How has it changed over the last century?",
    "Sum it up in one sentence.",
)


def preamble(session: str, run_id: str, topic: str) -> str:
    """A thread's first message: unique to the thread and the run (so no KV block is shared
    between threads, nor found left over from an earlier run) and some 300 tokens long."""
    facts = " ".join(
        f"Note {i} of conversation {session} in run {run_id}: we discuss {topic}, part {i}."
        for i in range(12)
    )
    return f"You are a concise assistant. {facts}"


@dataclass
class Call:
    """One turn of one thread as the client saw it."""

    thread: str
    turn: int
    replica: str = "?"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    answer: str = ""
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None


@dataclass
class Run:
    """A run's calls, the HTTP attempts the client made, and the kill."""

    calls: dict[tuple[str, int], Call] = field(default_factory=dict)
    attempts: list[tuple[str, int, str]] = field(default_factory=list)
    """``(session header, HTTP status, replica header)`` of every response the client got."""
    killed_at: float | None = None
    killed: str | None = None
    marked_down_s: float | None = None
    """Seconds from the kill until the router listed the killed replica as unhealthy."""
    ends: threading.Lock = field(default_factory=threading.Lock)
    """Held while a call is marked ended and while the kill hook checks and kills, so a call
    the hook saw still out is in flight at ``killed_at``."""

    def replicas(self, thread: str) -> list[str]:
        """The replica of each of ``thread``'s turns, in order."""
        return [c.replica for (t, _), c in sorted(self.calls.items()) if t == thread]

    def failed_attempts(self) -> list[tuple[str, int, str]]:
        """Responses the client got that were not 200 (it retried or gave up)."""
        return [a for a in self.attempts if a[1] != 200]

    def in_flight_at_kill(self, on: str) -> list[Call]:
        """Calls of threads on replica ``on`` that were running when it was killed."""
        if self.killed_at is None:
            return []
        return [
            c
            for c in self.calls.values()
            if c.started < self.killed_at < c.ended and self.replicas(c.thread)[0] == on
        ]


def _client(run: Run, lock: threading.Lock) -> httpx.Client:
    def record(response: httpx.Response) -> None:
        session = response.request.headers.get(SESSION_HEADER, "")
        with lock:
            run.attempts.append(
                (session, response.status_code, response.headers.get(REPLICA_HEADER, ""))
            )

    return httpx.Client(timeout=600, event_hooks={"response": [record]})


def run_threads(
    base_url: str,
    model: str,
    sessions: Sequence[str],
    turns: int,
    *,
    run_id: str,
    max_tokens: int = 16,
    turn_tokens: dict[int, int] | None = None,
    before_turn: Callable[[int, Run], None] | None = None,
    max_retries: int = 2,
) -> Run:
    """Each of ``sessions`` runs ``turns`` turns, all sessions of a turn at once, through
    ``ChatKVCache`` (greedy, ``max_tokens`` tokens per answer, or ``turn_tokens[turn]`` for the
    turns it names; the OpenAI client's ``max_retries``). ``before_turn(turn, run)`` runs just
    after a turn's requests are sent."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from langgraph_kvcache import ChatKVCache

    run, lock = Run(), threading.Lock()
    http = _client(run, lock)
    llm = ChatKVCache(
        base_url=base_url.rstrip("/") + "/v1", model=model, max_tokens=max_tokens,
        include_response_headers=True, extra_body={"ignore_eos": True}, max_retries=max_retries,
        timeout=600, http_client=http,
    )  # fmt: skip
    history: dict[str, list[Any]] = {
        s: [SystemMessage(preamble(s, run_id, TOPICS[i % len(TOPICS)]))]
        for i, s in enumerate(sessions)
    }

    def one(session: str, turn: int) -> None:
        topic = TOPICS[sessions.index(session) % len(TOPICS)]
        messages = [
            *history[session],
            HumanMessage(QUESTIONS[turn % len(QUESTIONS)].format(topic=topic)),
        ]
        call = Call(session, turn, started=time.monotonic())
        run.calls[(session, turn)] = call
        try:
            tokens = (turn_tokens or {}).get(turn, max_tokens)
            reply = llm.invoke(messages, session_id=session, max_tokens=tokens)
        except Exception as exc:  # the client gave up: counted, the thread stops here
            call.error = f"{type(exc).__name__}: {exc}"
            with run.ends:
                call.ended = time.monotonic()
            return
        with run.ends:
            call.ended = time.monotonic()
        usage = reply.usage_metadata or {}
        call.prompt_tokens = int(usage.get("input_tokens", 0))
        call.cached_tokens = int((usage.get("input_token_details") or {}).get("cache_read", 0))
        call.answer = str(reply.content)
        headers = {k.lower(): v for k, v in (reply.response_metadata.get("headers") or {}).items()}
        call.replica = str(headers.get(REPLICA_HEADER.lower(), "?"))
        history[session] = [*messages, AIMessage(call.answer)]

    with ThreadPoolExecutor(max_workers=len(sessions)) as pool:
        for turn in range(turns):
            live = [
                s for s in sessions if all(run.calls[(s, t)].error is None for t in range(turn))
            ]
            futures = [pool.submit(one, s, turn) for s in live]
            if before_turn is not None:
                before_turn(turn, run)
            for f in futures:
                f.result()
    http.close()
    return run
