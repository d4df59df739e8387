"""Check and rewrite a request body; large bodies in a child process, off the server's GIL.

:func:`check_body` is the whole check, a plain function on the raw bytes: the nesting bound
(:func:`server.api.json_body.nesting_depth`, before any parse), the parse, the Responses API's
refusals, a token-id prompt longer than the model's context (:func:`check_prompt_length`) and
:func:`server.api.generation_body.rewrite_body`.

:class:`BodyChecker` runs it for bodies over
:data:`server.api.chat.INLINE_BODY_BYTES` in one child process. A 2 MiB array of token ids
holds the GIL about 40 ms for our parse and re-serialisation, and as long again for vLLM's own
parse and validation; in a worker thread every other request still waited behind it (tenant
B's session API p99 at 5.15x idle while tenant A sent 2 MiB bodies, benchmarks/tenants.py).
In the child the parse holds the child's GIL; the server's process only sends the bytes and
gets back the rewritten bytes or the refusal, and a prompt that can never be served is refused
there before vLLM parses it again. If the child dies, the check runs in a worker thread for
that body (with a warning) and a new child starts for the next.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from langgraph_kvcache.contract import REUSE_EXACT, XARG_SESSION
from server.api.generation_body import RESPONSES_PATH, check_responses_body, rewrite_body
from server.api.json_body import nesting_depth
from server.api.protocol import APIError
from server.api.routes import GENERATION_PATHS

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 100
"""Deepest nesting of arrays/objects accepted in a JSON body (deeper: HTTP 400)."""
COMPLETIONS_PATH = "/v1/completions"
PARENT_POLL_S = 0.5
"""How often the child checks that the API server is still its parent."""


def check_prompt_length(body: dict[str, Any], max_prompt_tokens: int | None) -> None:
    """400 for a ``/v1/completions`` prompt of token ids longer than ``max_prompt_tokens`` (the
    model's context), which vLLM refuses too, but only after parsing and validating the body
    again. A prompt with ``truncate_prompt_tokens`` is left to vLLM (it may cut it to fit)."""
    if max_prompt_tokens is None or body.get("truncate_prompt_tokens") is not None:
        return
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return
    prompts = prompt if isinstance(prompt[0], list) else [prompt]
    longest = max((len(p) for p in prompts if isinstance(p, list)), default=0)
    if longest > max_prompt_tokens:
        raise APIError(
            400,
            f"This model's maximum context length is {max_prompt_tokens} tokens. However, "
            f"your prompt contains {longest} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "BadRequestError",  # as vLLM answers it
        )


def check_body(
    body: bytes,
    path: str,
    is_json: bool,
    tenant: str,
    *,
    salted: bool,
    reuse: str = REUSE_EXACT,
    max_prompt_tokens: int | None = None,
) -> tuple[bytes, str | None]:
    """Bound the JSON nesting of ``body``; on the generation routes also parse, check and
    rewrite it (see the module doc). Returns the body to pass on and the session id a
    generation names (else None).

    Raises:
        APIError: 400 with what to change.
    """
    generation = path in GENERATION_PATHS
    if not body.strip() or not (generation or is_json):
        return body, None
    if nesting_depth(body) > MAX_JSON_DEPTH:  # from the bytes, before any parse
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels; flatten it")
    if not generation:
        return body, None  # the route parses it and answers with its own message
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if path == RESPONSES_PATH:
        check_responses_body(data)
    if path == COMPLETIONS_PATH:
        check_prompt_length(data, max_prompt_tokens)
    out = rewrite_body(data, tenant, salted=salted, reuse=reuse)
    sid = out["vllm_xargs"].get(XARG_SESSION)
    return json.dumps(out).encode(), str(sid) if sid is not None else None


def _check_in_child(
    body: bytes,
    path: str,
    is_json: bool,
    tenant: str,
    salted: bool,
    reuse: str,
    max_prompt_tokens: int | None,
) -> tuple[Any, ...]:
    """:func:`check_body` in the child: its refusal as a plain tuple (pickled back)."""
    try:
        return ("ok", *check_body(body, path, is_json, tenant, salted=salted, reuse=reuse,
                                  max_prompt_tokens=max_prompt_tokens))  # fmt: skip
    except APIError as err:
        return ("error", err.status, err.message, err.type)


def _ready() -> bool:
    return True


def _exit_with(parent: int) -> None:
    """In the child: exit once ``parent`` (the API server) is gone, even if it was killed
    (a pool's worker waits on its queue forever otherwise)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="lgkv-parent-watch", daemon=True).start()


class BodyChecker:
    """:func:`check_body` for large bodies in one child process (see the module doc)."""

    def __init__(self, max_prompt_tokens: int | None = None, reuse: str = REUSE_EXACT) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        """The model's context (``max_model_len``): longer token-id prompts get 400."""
        self.reuse = reuse
        """The server's ``--kv-reuse``: how a request that does not say reuses its KV."""
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._in_thread = asyncio.Semaphore(1)
        """The fallback: one body at a time in a worker thread."""

    def start(self) -> None:
        """Start the child now (about half a second of imports), not at the first large body."""
        pool = self._pool_now()
        if pool is not None:
            pool.submit(_ready)

    def _pool_now(self) -> ProcessPoolExecutor | None:
        with self._lock:
            if self._pool is None and not self._closed:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_exit_with,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    async def check(
        self, body: bytes, path: str, is_json: bool, tenant: str, *, salted: bool
    ) -> tuple[bytes, str | None]:
        """:func:`check_body` in the child; in a worker thread if the child cannot take it."""
        pool = self._pool_now()
        if pool is not None:
            args = (body, path, is_json, tenant, salted, self.reuse, self.max_prompt_tokens)
            try:
                result = await asyncio.wrap_future(pool.submit(_check_in_child, *args))
            except (BrokenProcessPool, RuntimeError, OSError) as exc:
                log.warning("body check process failed (%s); checking in a thread", exc)
                self._drop(pool)
            else:
                if result[0] == "error":
                    raise APIError(result[1], result[2], result[3])
                return result[1], result[2]
        async with self._in_thread:
            return await asyncio.to_thread(
                check_body, body, path, is_json, tenant, salted=salted, reuse=self.reuse,
                max_prompt_tokens=self.max_prompt_tokens,
            )  # fmt: skip

    def close(self) -> None:
        """Stop the child (pending checks are cancelled); later checks run in a thread."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
