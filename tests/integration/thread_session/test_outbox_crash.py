"""A process killed after its delete or copy committed, before the server heard of it.

The change and the server call it owes are one transaction (the outbox row is written with the
change), so the call survives the process: the next process on the same database makes it.
The child (outbox_child.py) runs the change against a port that accepts and never answers; the
test kills it with SIGKILL once its first session API request has arrived there, i.e. after the
commit and before any answer. Then a saver on the live server drains the outbox and the server
sees the delete or the copy. Sync saver for the delete, async for the copy; SQLite and
PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph.checkpoint.base import empty_checkpoint
from thread_session_agent import system_prompt

from langgraph_kvcache import KVCacheClient
from langgraph_kvcache.checkpoint import SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.store import op_pending
from langgraph_kvcache.client import SessionNotFoundError
from langgraph_kvcache.sessions import session_id_for

pytestmark = pytest.mark.vllm

CHILD = Path(__file__).with_name("outbox_child.py")
REPO_ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 120.0
"""Bound on how long the child may take to start and send its request (a failure, not a
measurement: on time the test goes on at once)."""


def _cache_turn(server: Any, session_id: str, run_id: str) -> None:
    """One request of the session on the live server, so it holds KV blocks."""
    body = {
        "model": server.model,
        "messages": [
            {"role": "system", "content": system_prompt(run_id).content},
            {"role": "user", "content": "Item 3?"},
        ],
        "max_tokens": 2,
        "temperature": 0.0,
        "prompt_cache_key": session_id,
    }
    httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()


def _put_checkpoint(db_url: str, thread_id: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
        saver.put(config, empty_checkpoint(), {"source": "input", "step": -1}, {})


def _kill_in_first_request(listener: socket.socket, child: subprocess.Popen[bytes]) -> bytes:
    """Wait for the child's first request on ``listener``, SIGKILL the child; the request head.

    A connection that does not open with an HTTP request line is not the child's and is dropped:
    the listener's ephemeral port may be one a finished test's process still dials (a vLLM
    engine's ZMQ socket retrying its dead peer sent ``\xff\x00...\x7f``, the ZMTP greeting).
    """
    listener.settimeout(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            child.kill()
            _, err = child.communicate(timeout=60)
            pytest.fail(f"the child sent no request (exit {child.returncode}):\n{err.decode()}")
        with conn:
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            head = b""
            while b"\r\n\r\n" not in head and _may_be_http(head):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            if not _may_be_http(head) or b"\r\n" not in head:
                continue  # another process's connection: wait for the child's
            os.kill(child.pid, signal.SIGKILL)
            child.communicate(timeout=60)
        return head


def _may_be_http(head: bytes) -> bool:
    """Whether ``head`` can still be the start of an HTTP request (a method in capitals)."""
    method = head.split(b" ", 1)[0]
    return method.isalpha() and method.isupper() if method else True


def _threads(saver: SQLAlchemySaver, thread_id: str) -> int:
    return len(list(saver.list({"configurable": {"thread_id": thread_id}})))


@pytest.mark.parametrize(("flavour", "action"), [("sync", "delete"), ("async", "copy")])
def test_a_change_killed_before_its_call_is_sent_by_the_next_process(
    lgkv_server: Any, db_url: str, run_id: str, flavour: str, action: str
) -> None:
    source, target = f"ts-{run_id}-src", f"ts-{run_id}-dst"
    src_id, dst_id = session_id_for(source), session_id_for(target)
    kv = KVCacheClient(lgkv_server.base_url)
    _cache_turn(lgkv_server, src_id, run_id)
    blocks = kv.get_session(src_id).num_blocks
    assert blocks > 0
    _put_checkpoint(db_url, source)
    threads = [source] if action == "delete" else [source, target]

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        hung = f"http://127.0.0.1:{listener.getsockname()[1]}"
        child = subprocess.Popen(
            [sys.executable, str(CHILD), db_url, hung, flavour, action, *threads],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        head = _kill_in_first_request(listener, child)
    assert child.returncode == -signal.SIGKILL
    verb = b"DELETE" if action == "delete" else b"POST"
    assert head.startswith(verb + b" /v1/sessions/" + src_id.encode()), head[:200]
    assert kv.get_session(src_id).num_blocks == blocks  # the server has heard nothing

    owed = ("delete", src_id, None) if action == "delete" else ("copy", src_id, dst_id)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=lgkv_server.base_url) as saver:
        assert saver.kv_sessions is not None
        # The change committed, and the call it owes with it.
        assert _threads(saver, source) == (0 if action == "delete" else 1)
        assert _threads(saver, target) == (0 if action == "delete" else 1)
        pending = saver._run(op_pending(10))
        assert [(p.call.op, p.call.session_id, p.call.target_id) for p in pending] == [owed]
        assert saver.kv_sessions.drain() == 1
        assert saver._run(op_pending(10)) == []

    if action == "delete":
        with pytest.raises(SessionNotFoundError):
            kv.get_session(src_id)
    else:
        assert kv.get_session(dst_id).num_blocks == blocks
        kv.delete_session(dst_id)
        kv.delete_session(src_id)
    kv.close()
