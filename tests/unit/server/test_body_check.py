"""Large bodies are checked in a child process: the same answers as the inline check, a
token-id prompt past the model's context refused there, and a dead child costs nothing but a
warning (that body is checked in a thread, the next in a new child)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.api.body_check import BodyChecker, check_body
from server.api.protocol import APIError

ROOT = Path(__file__).resolve().parents[3]
COMPLETIONS = "/v1/completions"


def _completion(prompt: object, **extra: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


def test_a_token_prompt_past_the_context_is_refused_unless_truncated() -> None:
    fits = _completion([7] * 512, prompt_cache_key="s1")
    body, sid = check_body(fits, COMPLETIONS, True, "t", salted=True, max_prompt_tokens=512)
    assert sid == "s1" and json.loads(body)["vllm_xargs"] == {"session_id": "s1", "tenant": "t"}
    for prompt in ([7] * 513, [[1], [7] * 513]):
        with pytest.raises(APIError) as err:
            check_body(_completion(prompt), COMPLETIONS, True, "t", salted=True,
                       max_prompt_tokens=512)  # fmt: skip
        assert err.value.status == 400 and "513 input tokens" in err.value.message
        assert "maximum context length is 512 tokens" in err.value.message
    cut = _completion([7] * 600, truncate_prompt_tokens=100)  # vLLM cuts it: passed on
    assert check_body(cut, COMPLETIONS, True, "t", salted=True, max_prompt_tokens=512)[1] is None
    text = _completion("x" * 5000)  # text: vLLM bounds it by characters per token itself
    assert check_body(text, COMPLETIONS, True, "t", salted=True, max_prompt_tokens=512)
    chat = json.dumps({"messages": [], "prompt": [7] * 600}).encode()  # not a completion
    assert check_body(chat, "/v1/chat/completions", True, "t", salted=False, max_prompt_tokens=8)


async def test_the_child_answers_as_the_inline_check_does() -> None:
    checker = BodyChecker(max_prompt_tokens=1024)
    checker.start()
    try:
        big = _completion([5] * 1000, session_id="a1", cache_salt="mine")
        inline = check_body(big, COMPLETIONS, True, "t", salted=True, max_prompt_tokens=1024)
        assert await checker.check(big, COMPLETIONS, True, "t", salted=True) == inline
        refusals = [
            (_completion([5] * 1025), "1025 input tokens"),
            (b"[" * 101 + b"]" * 101, "nests deeper than 100"),
            (b"{not json", "not valid JSON"),
            (_completion([1], session_id="a", prompt_cache_key="b"), "two different sessions"),
            (_completion([1], vllm_xargs={"lgkv_op": "sync"}), "set by the server"),
        ]
        for body, message in refusals:
            with pytest.raises(APIError) as err:
                await checker.check(body, COMPLETIONS, True, "t", salted=True)
            assert err.value.status == 400 and message in err.value.message
    finally:
        checker.close()
    # closed: the check goes on in a worker thread, same answer
    assert await checker.check(big, COMPLETIONS, True, "t", salted=True) == inline


async def test_a_dead_child_costs_a_warning_and_a_new_child(
    caplog: pytest.LogCaptureFixture,
) -> None:
    checker = BodyChecker(max_prompt_tokens=64)
    body = _completion([3] * 10, session_id="d1")
    try:
        assert (await checker.check(body, COMPLETIONS, True, "t", salted=False))[1] == "d1"
        pool = checker._pool
        assert pool is not None
        (pid,) = [p.pid for p in pool._processes.values()]  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING, logger="server.api.body_check"):
            assert (await checker.check(body, COMPLETIONS, True, "t", salted=False))[1] == "d1"
        assert "checking in a thread" in caplog.text
        assert (await checker.check(body, COMPLETIONS, True, "t", salted=False))[1] == "d1"
        new = checker._pool
        assert new is not None and new is not pool
        assert all(p.pid != pid for p in new._processes.values())  # type: ignore[union-attr]
    finally:
        checker.close()


PARENT = """
import asyncio, os, sys, time
from server.api.body_check import BodyChecker

async def main():
    checker = BodyChecker(10)
    await checker.check(b'{"prompt": [1]}', "/v1/completions", True, "t", salted=False)
    print(*[p.pid for p in checker._pool._processes.values()], flush=True)
    time.sleep(120)

if __name__ == "__main__":
    asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_the_child_exits_when_the_server_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), f"body check process {child} outlived its killed server"
