"""What the recording server saw ChatKVCache send (shared by the chat model tests)."""

from __future__ import annotations

from typing import Any

from langgraph_kvcache.contract import SESSION_HEADER


def sent_sessions(recorder: Any) -> list[str | None]:
    """The session each chat request named; checks that its ``X-Session-ID`` header (what a
    router hashes) names the same one as the body's ``prompt_cache_key``, or is absent."""
    sessions = []
    for request in recorder.chat_requests():
        session = request.body.get("prompt_cache_key")
        assert request.header(SESSION_HEADER) == session, (request.headers, session)
        sessions.append(session)
    return sessions
