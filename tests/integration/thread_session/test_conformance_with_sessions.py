"""``langgraph-checkpoint-conformance`` with the session keeper on: the server calls never
change what the saver stores or returns (SQLite, sync and async, the shared live server).

Every thread of the suite is registered on the server with a TTL, copied, pruned and deleted
there too; the suite still sees a FULL checkpointer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from langgraph_kvcache.checkpoint import AsyncSQLAlchemySaver, SQLAlchemySaver
from langgraph_kvcache.checkpoint.sessions.sync import KVSessionOptions

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_conformance_with_the_session_keeper(
    kind: str, tmp_path: Path, lgkv_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    options = KVSessionOptions(lgkv_server.base_url, ttl_seconds=600, prefetch_interval_s=0)
    url = f"sqlite:///{tmp_path / 'conformance.db'}"

    async def factory() -> AsyncIterator[object]:
        if kind == "sync":
            with SQLAlchemySaver.from_conn_string(url, kv_server=options) as saver:
                saver.setup()
                yield saver
        else:
            async with AsyncSQLAlchemySaver.from_conn_string(url, kv_server=options) as saver:
                await saver.setup()
                yield saver

    registered = checkpointer_test(name=f"{kind} saver with kv_server")(factory)  # type: ignore[arg-type]
    report = await validate(registered, progress=ProgressCallbacks.default())  # type: ignore[arg-type]
    with capsys.disabled():
        report.print_report()
    assert report.passed_all_base(), report.to_dict()
    assert report.conformance_level() == "FULL", report.to_dict()
