"""``setup()`` migrations, URL handling, and concurrent writers (processes and tasks)."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import traceback
from typing import Any

import pytest
from langgraph.checkpoint.base import empty_checkpoint
from sqlalchemy import func, insert, select

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.engine import normalize_url
from langgraph_kvcache.checkpoint.migrations import MIGRATIONS
from langgraph_kvcache.checkpoint.schema import checkpoints, migrations_table, writes
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver
from langgraph_kvcache.errors import CheckpointerSetupError, UnsupportedDatabaseError

N_PER_WRITER = 40


def _migration_versions(saver: SQLAlchemySaver) -> list[int]:
    with saver.engine.connect() as conn:
        return list(conn.execute(select(migrations_table.c.v).order_by("v")).scalars())


def _write_thread(saver: SQLAlchemySaver, thread_id: str, n: int) -> None:
    """``n`` checkpoints on ``thread_id``, each with a growing list and one pending write."""
    config: dict[str, Any] = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    version = None
    for i in range(n):
        version = saver.get_next_version(version, None)
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"items": list(range(i + 1))}
        checkpoint["channel_versions"] = {"items": version}
        config = saver.put(config, checkpoint, {"step": i}, {"items": version})
        saver.put_writes(config, [("items", i)], f"task-{i}")


def _assert_thread_complete(saver: SQLAlchemySaver, thread_id: str, n: int) -> None:
    found = list(saver.list({"configurable": {"thread_id": thread_id}}))
    assert len(found) == n
    assert [t.metadata["step"] for t in found] == list(range(n - 1, -1, -1))
    assert all(len(t.pending_writes or []) == 1 for t in found)
    assert found[0].checkpoint["channel_values"]["items"] == list(range(n))


def test_setup_is_idempotent_and_versioned(db_url: str) -> None:
    with SQLAlchemySaver.from_conn_string(db_url) as saver:
        saver.setup()
        saver.setup()
        assert _migration_versions(saver) == list(range(len(MIGRATIONS)))
        with saver.engine.begin() as conn:
            conn.execute(insert(migrations_table).values(v=len(MIGRATIONS) + 5))
        with pytest.raises(CheckpointerSetupError, match="upgrade langgraph-kvcache"):
            saver.setup()


@pytest.mark.parametrize(
    ("url", "asynchronous", "expected"),
    [
        ("sqlite:///x.db", False, "sqlite+pysqlite"),
        ("sqlite:///x.db", True, "sqlite+aiosqlite"),
        ("sqlite://", True, "sqlite+aiosqlite"),
        ("postgresql://u@h/db", False, "postgresql+psycopg"),
        ("postgres://u@h/db", True, "postgresql+psycopg"),
        ("postgresql+asyncpg://u@h/db", True, "postgresql+asyncpg"),
    ],
)
def test_normalize_url(url: str, asynchronous: bool, expected: str) -> None:
    assert normalize_url(url, asynchronous=asynchronous).drivername == expected


def test_unsupported_url_says_what_to_use() -> None:
    with pytest.raises(UnsupportedDatabaseError, match=r"sqlite:///path\.db"):
        normalize_url("mysql://u@h/db", asynchronous=False)


def test_engine_kind_and_backend_are_checked() -> None:
    from sqlalchemy import create_engine, create_mock_engine
    from sqlalchemy.ext.asyncio import create_async_engine

    sync_engine = create_engine("sqlite://")
    async_engine = create_async_engine("sqlite+aiosqlite://")
    with pytest.raises(TypeError, match="AsyncSQLAlchemySaver"):
        SQLAlchemySaver(async_engine)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use SQLAlchemySaver"):
        AsyncSQLAlchemySaver(sync_engine)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedDatabaseError, match="not 'mysql'"):
        SQLAlchemySaver(create_mock_engine("mysql://", lambda *a, **k: None))  # type: ignore[arg-type]


def _process_writer(url: str, thread_id: str, barrier: Any, errors: Any) -> None:
    try:
        barrier.wait()  # both processes run setup() and their writes at the same time
        with SQLAlchemySaver.from_conn_string(url) as saver:
            saver.setup()
            _write_thread(saver, thread_id, N_PER_WRITER)
    except BaseException:
        errors.put(f"{thread_id}: {traceback.format_exc()}")
        raise


def test_two_processes_one_sqlite_file(sqlite_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, errors = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_process_writer, args=(sqlite_url, f"proc-{i}", barrier, errors))
        for i in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    reported = [errors.get(timeout=1) for _ in range(errors.qsize())] if not errors.empty() else []
    assert reported == [], "\n".join(reported)
    assert [proc.exitcode for proc in procs] == [0, 0]
    with SQLAlchemySaver.from_conn_string(sqlite_url) as saver:
        assert _migration_versions(saver) == list(range(len(MIGRATIONS)))
        for i in range(2):
            _assert_thread_complete(saver, f"proc-{i}", N_PER_WRITER)


@pytest.mark.postgres
def test_concurrent_setup_postgres(pg_url: str) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        try:
            with SQLAlchemySaver.from_conn_string(pg_url) as saver:
                barrier.wait()
                saver.setup()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with SQLAlchemySaver.from_conn_string(pg_url) as saver:
        assert _migration_versions(saver) == list(range(len(MIGRATIONS)))


@pytest.mark.postgres
async def test_async_tasks_share_one_postgres_pool(pg_url: str) -> None:
    async with AsyncSQLAlchemySaver.from_conn_string(pg_url, pool_size=2) as saver:
        await saver.setup()

        async def writer(thread_id: str) -> None:
            config: dict[str, Any] = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
            version = None
            for i in range(N_PER_WRITER):
                version = saver.get_next_version(version, None)
                checkpoint = empty_checkpoint()
                checkpoint["channel_values"] = {"items": list(range(i + 1))}
                checkpoint["channel_versions"] = {"items": version}
                config = await saver.aput(config, checkpoint, {"step": i}, {"items": version})
                await saver.aput_writes(config, [("items", i)], f"task-{i}")

        await asyncio.gather(*(writer(f"task-{i}") for i in range(4)))
        async with saver.engine.connect() as conn:
            n_checkpoints = (
                await conn.execute(select(func.count()).select_from(checkpoints))
            ).scalar_one()
            n_writes = (await conn.execute(select(func.count()).select_from(writes))).scalar_one()
        assert n_checkpoints == n_writes == 4 * N_PER_WRITER
        for i in range(4):
            found = [t async for t in saver.alist({"configurable": {"thread_id": f"task-{i}"}})]
            assert len(found) == N_PER_WRITER
            assert found[0].checkpoint["channel_values"]["items"] == list(range(N_PER_WRITER))
