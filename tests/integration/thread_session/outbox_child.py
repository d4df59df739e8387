"""One lifecycle change in its own process, for test_outbox_crash.py to SIGKILL mid-call.

    python outbox_child.py DB_URL KV_URL sync|async delete THREAD
    python outbox_child.py DB_URL KV_URL sync|async copy SOURCE TARGET

``KV_URL`` is a port that accepts connections and never answers, so after the change commits
the process hangs in its first session API call (timeout ten minutes) until it is killed.
Before the change it drains its (empty) outbox: the steady state of a long-lived process,
which knows it owes the server nothing.
"""

from __future__ import annotations

import asyncio
import sys

from langgraph_kvcache.checkpoint import AsyncSQLAlchemySaver, SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions


def run_sync(db_url: str, options: KVSessionOptions, action: str, threads: list[str]) -> None:
    with SQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        assert saver.kv_sessions is not None
        saver.kv_sessions.drain()
        if action == "delete":
            saver.delete_thread(threads[0])
        else:
            saver.copy_thread(threads[0], threads[1])


async def run_async(
    db_url: str, options: KVSessionOptions, action: str, threads: list[str]
) -> None:
    async with AsyncSQLAlchemySaver.from_conn_string(db_url, kv_server=options) as saver:
        assert saver.kv_sessions is not None
        await saver.kv_sessions.drain()
        if action == "delete":
            await saver.adelete_thread(threads[0])
        else:
            await saver.acopy_thread(threads[0], threads[1])


def main(argv: list[str]) -> None:
    db_url, kv_url, flavour, action, *threads = argv
    if action not in ("delete", "copy") or flavour not in ("sync", "async"):
        raise SystemExit(__doc__)
    options = KVSessionOptions(kv_url, call_timeout_s=600)
    if flavour == "sync":
        run_sync(db_url, options, action, threads)
    else:
        asyncio.run(run_async(db_url, options, action, threads))


if __name__ == "__main__":
    main(sys.argv[1:])
