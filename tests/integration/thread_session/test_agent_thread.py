"""A LangGraph agent thread and its server session, kept in step by ``SQLAlchemySaver(kv_server=)``.

One scenario per SQL backend (SQLite, PostgreSQL) on the shared tiny-model server: five user
turns hit the cache for >= 90% of the previous context; the saver registered the session with
its TTL; a fork (``copy_thread``) and, after a server restart, the original thread (a RAG turn)
both hit from disk, the latter prefetched to RAM by ``get_tuple``; a rewind to an older
checkpoint reuses the shared prefix; ``delete_thread`` removes the sessions and their files.
The measured shares are printed (``pytest -s``).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from thread_session_agent import (
    Turn,
    block_files,
    build_agent,
    lookup_notes,
    make_search_tool,
    registry_keys,
    system_prompt,
    turn_of,
)

from langgraph_kvcache import ChatKVCache, KVCacheClient
from langgraph_kvcache.checkpoint import SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions
from langgraph_kvcache.client import SessionNotFoundError
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.vllm

TTL_S = 3600.0
QUESTIONS = (
    "How heavy is item 3 according to the notes?",
    "And item 12, compared with item 3?",
    "Which of the two is lighter?",
    "What does the team note about item 40?",
    "Summarise the weights we discussed.",
)
COVER = 0.9
TREE_COVER = 0.99
"""A fork's and a rewind's first turn: the session's tree holds the block they leave inside
(server/kv/scheduler/continuations.py), so only their new tokens are computed."""


def _ask(
    graph: Any, thread: str, text: str, *, system: SystemMessage | None = None, **configurable: Any
) -> Turn:
    """One user turn; returns the usage of its answer."""
    config = {"configurable": {"thread_id": thread, **configurable}}
    messages = [system] if system else []
    turn = turn_of(graph.invoke({"messages": [*messages, HumanMessage(text)]}, config))
    print(f"  {thread}: {turn}")
    return turn


def _files_of(cache_dir: Path, keys: set[str]) -> set[str]:
    return keys & set(block_files(cache_dir))


def test_agent_thread_keeps_its_kv_in_step(
    lgkv_server: Any, db_url: str, kv_model: ChatKVCache, wiki_index: Any, run_id: str
) -> None:
    tools = [lookup_notes, make_search_tool(wiki_index)]
    options = KVSessionOptions(lgkv_server.base_url, ttl_seconds=TTL_S, prefetch_interval_s=0)
    a, b = f"ts-{run_id}-a", f"ts-{run_id}-b"
    kv = KVCacheClient(lgkv_server.base_url)
    cache_dir = Path(lgkv_server.cache_dir)
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        saver.setup()
        graph = build_agent(kv_model, tools, saver)
        # Five user turns: from turn 2 on the history's KV comes from the cache.
        turns = [_ask(graph, a, QUESTIONS[0], system=system_prompt(run_id))]
        turns += [_ask(graph, a, q) for q in QUESTIONS[1:]]
        covers = [t.cover(prev) for prev, t in itertools.pairwise(turns)]
        print(f"\n[{db_url.split(':')[0]}] turns {turns}\n  cover of previous context: "
              + ", ".join(f"{c:.1%}" for c in covers))  # fmt: skip
        assert turns[0].prompt > 9 * 128, "the history must span many KV blocks"
        assert all(c >= COVER for c in covers), covers

        # The saver registered the thread's session with its TTL.
        session = kv.get_session(a)
        assert session.ttl_seconds == TTL_S
        assert session.num_tokens >= turns[-1].prompt - 128

        # Fork: the copy shares every block of the source.
        saver.copy_thread(a, b)
        fork = kv.get_session(b)
        assert fork.num_blocks == kv.get_session(a).num_blocks

        # Restart: RAM is gone, the disk tier stays; get_tuple prefetches the thread's KV.
        lgkv_server.restart()
        saver.get_tuple({"configurable": {"thread_id": a}})
        wait_until(
            lambda: kv.get_session(a).tiers["ram"].blocks == kv.get_session(a).num_blocks > 0,
            "the saver's prefetch to load the session into RAM",
        )
        rag = _ask(graph, a, "Search Wikipedia about the Eiffel Tower.", tool="search_wikipedia")
        print(f"  after restart, RAG turn: {rag} cover {rag.cover(turns[-1]):.1%}")
        assert rag.cover(turns[-1]) >= COVER
        history = graph.get_state({"configurable": {"thread_id": a}}).values["messages"]
        assert history[-2].name == "search_wikipedia" and history[-2].content.startswith("[")

        forked = _ask(graph, b, "What did we find about item 12?")
        print(f"  fork's first turn: {forked} cover {forked.cover(turns[-1]):.1%}")
        assert forked.cover(turns[-1]) >= TREE_COVER

        # Rewind the fork to the checkpoint after turn 2 and continue from there.
        after_two = next(
            s
            for s in graph.get_state_history({"configurable": {"thread_id": b}})
            if len(s.values["messages"]) == 1 + 2 * 4 and not s.next
        )
        rewound = turn_of(
            graph.invoke(
                {"messages": [("user", "Let us go back: how heavy is item 5?")]},
                after_two.config,
            )
        )
        print(f"  rewind to turn 2: {rewound} cover {rewound.cover(turns[1]):.1%}")
        assert rewound.cover(turns[1]) >= TREE_COVER  # up to its last shared token

        # delete_thread: the session leaves the server, its own blocks' files leave the disk.
        keys = registry_keys(cache_dir)
        own_a = keys[a] - set().union(*(v for k, v in keys.items() if k != a))
        assert own_a, "the RAG turn added blocks only thread a holds"
        wait_until(lambda: _files_of(cache_dir, own_a) == own_a, "block files of thread a")
        shared_files = _files_of(cache_dir, keys[a] & keys[b])
        assert shared_files, "the fork shares thread a's history"
        saver.delete_thread(a)
        assert a not in {s.id for s in kv.list_sessions(limit=1000)}
        with pytest.raises(SessionNotFoundError):
            kv.get_session(a)
        assert _files_of(cache_dir, own_a) == set()
        assert _files_of(cache_dir, shared_files) == shared_files, "the fork still uses them"
        assert saver.get_tuple({"configurable": {"thread_id": a}}) is None

        keys_b = registry_keys(cache_dir)[b]
        saver.delete_thread(b)
        assert b not in {s.id for s in kv.list_sessions(limit=1000)}
        assert _files_of(cache_dir, keys_b) == set()
    kv.close()
