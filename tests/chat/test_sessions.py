"""session_id_for and the config helpers: thread ids and namespaces -> server session ids."""

from __future__ import annotations

import subprocess
import sys

import pytest

from langgraph_kvcache import session_id_for
from langgraph_kvcache.sessions import (
    SESSION_ID_PATTERN,
    graph_namespace,
    session_id_from_config,
    strip_task_ids,
    thread_session_prefix,
    validate_session_id,
)

TASK = "1f0e6c2a-8d7b-6f5e-bf3a-0c1d2e3f4a5b"
TASK2 = "a235c260-0836-b8f0-3680-639c11f08b97"


def test_root_graph_session_is_the_thread_id() -> None:
    assert session_id_for("thread-1") == "thread-1"
    assert session_id_for("user@example.com:chat.7") == "user@example.com:chat.7"
    assert session_id_for(42) == "42"


def test_namespace_keeps_node_names_and_drops_task_ids() -> None:
    assert session_id_for("t1", f"research:{TASK}") == "t1|research"
    assert session_id_for("t1", f"outer:{TASK}|inner:{TASK2}") == "t1|outer|inner"
    # a later step of the same subgraph has new task ids but the same session
    assert session_id_for("t1", f"research:{TASK2}") == session_id_for("t1", f"research:{TASK}")
    assert strip_task_ids("") == ""
    assert strip_task_ids("a") == "a"


@pytest.mark.parametrize(
    "thread_id",
    ["has space", "slash/inside", "ünïcode", "-leading-dash", "pipe|inside", "x" * 300, "é"],
)
def test_odd_thread_ids_are_hashed_deterministically(thread_id: str) -> None:
    sid = session_id_for(thread_id)
    assert SESSION_ID_PATTERN.fullmatch(sid), sid
    assert sid != thread_id
    assert len(sid) <= 64
    # same input, same id, also in a fresh interpreter (no per-process hash seed)
    code = f"from langgraph_kvcache import session_id_for as f; print(f({thread_id!r}))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == sid


def test_distinct_odd_ids_do_not_collide() -> None:
    ids = {session_id_for(t) for t in ["a b", "a/b", "a\tb", "a  b", "a|b"]}
    assert len(ids) == 5


def test_a_thread_id_shaped_like_a_digest_form_gets_its_own_session() -> None:
    """``'user 1 thread'`` is hashed to ``user-1-thread=<digest>``; a thread literally named so
    shared its session (deleting one thread deleted the other's KV). Only digest forms hold
    ``=``: an id with ``=`` is hashed too, so the mapping is one-to-one."""
    hashed = session_id_for("user 1 thread")
    assert hashed.startswith("user-1-thread=")
    assert session_id_for(hashed) != hashed
    assert thread_session_prefix(hashed) != thread_session_prefix("user 1 thread")
    assert session_id_for("a=b") != "a=b" and "=" in session_id_for("a=b")
    # namespaces likewise: a node name with "=" is hashed, never taken as a digest form
    named = session_id_for("t1", f"n=x:{TASK}")
    assert named != "t1|n=x" and SESSION_ID_PATTERN.fullmatch(named)
    odd = session_id_for("t1", f"n x:{TASK}")
    assert session_id_for("t1", odd.split("|", 1)[1]) != odd
    # plain ids never hold "=", digest forms always do
    for thread_id in ["t1", "a.b-c", "user@x:1", "x" * 300, "a b", "a|b", "=", "a=", "ü"]:
        sid = session_id_for(thread_id)
        assert ("=" in sid) == (sid != str(thread_id)), thread_id


def test_thread_with_pipe_cannot_impersonate_a_subgraph_session() -> None:
    assert session_id_for("a|b") != session_id_for("a", f"b:{TASK}")


def test_every_session_of_a_thread_starts_with_its_prefix() -> None:
    for thread_id in ["t1", "odd thread", "y" * 250]:
        head = thread_session_prefix(thread_id)
        assert session_id_for(thread_id) == head
        assert session_id_for(thread_id, f"sub:{TASK}").startswith(head + "|")


def test_long_namespace_stays_within_the_length_limit() -> None:
    ns = "|".join(f"node{i}:{TASK}" for i in range(40))
    sid = session_id_for("t" * 200, ns)
    assert SESSION_ID_PATTERN.fullmatch(sid), sid
    assert sid.startswith("t" * 200 + "|")
    assert sid != session_id_for("t" * 200, ns.replace("node39", "node38"))


def test_odd_node_names_are_hashed() -> None:
    sid = session_id_for("t1", f"my node/ä:{TASK}")
    assert SESSION_ID_PATTERN.fullmatch(sid), sid
    assert sid.startswith("t1|")


def test_validate_session_id_explains_the_syntax() -> None:
    assert validate_session_id("ok-1") == "ok-1"
    with pytest.raises(ValueError, match="session_id_for"):
        validate_session_id("not ok")
    with pytest.raises(ValueError, match="1-255 characters"):
        validate_session_id("")


def test_graph_namespace_drops_the_running_node_segment() -> None:
    root_node = {"checkpoint_ns": f"agent:{TASK}", "__pregel_task_id": TASK}
    sub_node = {"checkpoint_ns": f"outer:{TASK}|inner:{TASK2}", "__pregel_task_id": TASK2}
    assert graph_namespace(root_node) == ""
    assert graph_namespace(sub_node) == f"outer:{TASK}"
    assert graph_namespace({"checkpoint_ns": f"outer:{TASK}"}) == f"outer:{TASK}"  # given by hand
    assert graph_namespace({}) == ""


def test_session_id_from_config() -> None:
    assert session_id_from_config(None) is None
    assert session_id_from_config({"configurable": {}}) is None
    assert session_id_from_config({"configurable": {"thread_id": "t9"}}) == "t9"
    cfg = {"thread_id": "t9", "checkpoint_ns": f"outer:{TASK}|inner:{TASK2}"}
    assert session_id_from_config({"configurable": {**cfg, "__pregel_task_id": TASK2}}) == (
        "t9|outer"
    )
    explicit = {"configurable": {"thread_id": "t9", "session_id": "mine"}}
    assert session_id_from_config(explicit) == "mine"
    with pytest.raises(ValueError):
        session_id_from_config({"configurable": {"session_id": "bad id"}})
