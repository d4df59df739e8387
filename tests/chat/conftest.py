"""A real local HTTP peer for the chat model and client tests.

``RecordingServer`` is a threaded ``http.server`` on a free port that records every request it
receives (method, path, headers, JSON body) and answers:

- ``POST /v1/chat/completions``: an OpenAI-shaped chat completion (JSON, or server-sent events
  when the body asks ``"stream": true``) built from the next queued :class:`ChatReply`, with a
  usage block (``prompt_tokens_details.cached_tokens`` included, and a final usage chunk when
  streaming with ``stream_options.include_usage``);
- anything else: the next queued :class:`Answer` (status, JSON, optional delay), so session API
  tests script the server's side of the exchange.

It stands in for the bundled vLLM server in unit tests; the real server is exercised by
``tests/integration/chat/test_integration_standard.py`` (with the integration suite's server).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from langgraph_kvcache import ChatKVCache


@dataclass
class ChatReply:
    """What the next chat completion answers."""

    content: str = "Hello from the recording server."
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI tool calls: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    reasoning: str | None = None
    """vLLM's ``reasoning`` field of the answer (a reasoning parser's output), if any."""
    prompt_tokens: int = 11
    cached_tokens: int = 0
    completion_tokens: int = 5
    status: int = 200
    """Another status answers an OpenAI-shaped error instead (e.g. 502: a replica that died)."""


@dataclass
class Answer:
    """What the next non-chat request answers."""

    status: int
    body: Any = None
    """JSON-serialisable body; a ``str`` is sent as plain text."""
    delay_s: float = 0.0


@dataclass
class Recorded:
    """One request as the server received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), ``None`` when it was not sent."""
        found = [v for k, v in self.headers.items() if k.lower() == name.lower()]
        return found[0] if found else None


class RecordingServer:
    """Threaded HTTP server recording requests and replaying queued answers (see module doc)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.chat_replies: deque[ChatReply] = deque()
        self.answers: deque[Answer] = deque()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Server root, e.g. ``http://127.0.0.1:54321``."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RecordingServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.chat_replies.clear()
            self.answers.clear()

    def queue_chat(self, **reply: Any) -> None:
        """Queue the next chat completion's answer (fields of :class:`ChatReply`)."""
        with self._lock:
            self.chat_replies.append(ChatReply(**reply))

    def queue_answer(self, status: int, body: Any = None, *, delay_s: float = 0.0) -> None:
        """Queue the next non-chat answer."""
        with self._lock:
            self.answers.append(Answer(status, body, delay_s))

    def chat_bodies(self) -> list[dict[str, Any]]:
        """JSON bodies of the chat completion requests received so far."""
        return [r.body for r in self.chat_requests()]

    def chat_requests(self) -> list[Recorded]:
        """The chat completion requests received so far."""
        with self._lock:
            return [r for r in self.requests if r.path.endswith("/chat/completions")]

    # -- request handling (runs on the server's threads) --------------------------------------
    def _record(self, rec: Recorded) -> None:
        with self._lock:
            self.requests.append(rec)

    def _next_chat(self) -> ChatReply:
        with self._lock:
            return self.chat_replies.popleft() if self.chat_replies else ChatReply()

    def _next_answer(self) -> Answer:
        with self._lock:
            if self.answers:
                return self.answers.popleft()
        return Answer(
            500, {"error": {"message": "no scripted answer", "type": "test", "code": 500}}
        )


def _completion(body: dict[str, Any], reply: ChatReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    if reply.reasoning is not None:
        message["reasoning"] = reply.reasoning
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "test"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.tool_calls else "stop",
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }


def _usage(reply: ChatReply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def _sse(body: dict[str, Any], reply: ChatReply) -> bytes:
    base = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model", "test"),
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""})]
    words = reply.content.split(" ") if reply.content else []
    events += [chunk({"content": w if i == 0 else f" {w}"}) for i, w in enumerate(words)]
    for i, call in enumerate(reply.tool_calls):
        fn = call["function"]
        head = {"index": i, "id": call["id"], "type": "function"}
        events.append(chunk({"tool_calls": [{**head, "function": {"name": fn["name"]}}]}))
        events.append(
            chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        )
    events.append(chunk({}, "tool_calls" if reply.tool_calls else "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**base, "choices": [], "usage": _usage(reply)})
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def _make_handler(owner: RecordingServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            owner._record(Recorded(self.command, self.path, dict(self.headers), body))
            if self.path.rstrip("/").endswith("/chat/completions"):
                reply = owner._next_chat()
                if reply.status != 200:
                    error = {"message": "scripted failure", "type": "test", "code": reply.status}
                    self._send(reply.status, json.dumps({"error": error}).encode())
                elif body.get("stream"):
                    self._send(200, _sse(body, reply), "text/event-stream")
                else:
                    self._send(200, json.dumps(_completion(body, reply)).encode())
                return
            answer = owner._next_answer()
            if answer.delay_s:
                time.sleep(answer.delay_s)
            if isinstance(answer.body, str):
                self._send(answer.status, answer.body.encode(), "text/plain")
            else:
                self._send(answer.status, json.dumps(answer.body).encode())

        def _send(self, status: int, payload: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            # the client may have given up already (timeout tests)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(payload)

        do_GET = do_POST = do_PATCH = do_DELETE = _handle

    return Handler


@pytest.fixture(scope="session")
def _recording_server() -> Iterator[RecordingServer]:
    server = RecordingServer().start()
    yield server
    server.stop()


@pytest.fixture
def recorder(_recording_server: RecordingServer) -> RecordingServer:
    """The session's recording server, emptied of requests and queued answers for this test."""
    _recording_server.reset()
    return _recording_server


@pytest.fixture
def model(recorder: Any) -> ChatKVCache:
    # Async tests share the session's event loop: langchain-openai caches one async HTTP client
    # per process, and a client cannot outlive the loop it first ran on.
    return ChatKVCache(base_url=f"{recorder.url}/v1", max_retries=0)
