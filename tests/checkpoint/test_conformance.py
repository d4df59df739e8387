"""``langgraph-checkpoint-conformance`` against both savers on SQLite and PostgreSQL.

Each run registers the saver with the suite's ``checkpointer_test`` (its ``lifespan`` creates
the database: a new SQLite file, or a new PostgreSQL database dropped afterwards), runs
``validate`` and asserts that every base and extended capability was detected and passed.
The suite's own report is printed, with the per-capability test counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    BASE_CAPABILITIES,
    EXTENDED_CAPABILITIES,
)
from langgraph.checkpoint.conformance.report import CapabilityReport, ProgressCallbacks

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver


def _register(name: str, kind: str, urls: list[str], lifespan: object) -> object:
    """Register a factory that yields a set-up saver of ``kind`` on ``urls[0]``."""

    async def factory() -> AsyncIterator[object]:
        if kind == "sync":
            with SQLAlchemySaver.from_conn_string(urls[0]) as saver:
                saver.setup()
                yield saver
        else:
            async with AsyncSQLAlchemySaver.from_conn_string(urls[0]) as saver:
                await saver.setup()
                yield saver

    return checkpointer_test(name=name, lifespan=lifespan)(factory)  # type: ignore[arg-type]


def _summary(report: CapabilityReport) -> str:
    counts = {
        name: f"{r.tests_passed}/{r.tests_passed + r.tests_failed}"
        for name, r in sorted(report.results.items())
    }
    level = report.conformance_level()
    return f"{report.checkpointer_name}: {level} " + " ".join(f"{k}={v}" for k, v in counts.items())


def _assert_full(report: CapabilityReport) -> None:
    assert report.passed_all_base(), report.to_dict()
    for cap in ALL_CAPABILITIES:
        result = report.results[cap.value]
        assert result.detected, f"{cap.value} not detected"
        assert result.passed is True, f"{cap.value} failed: {result.failures}"
        assert result.tests_failed == 0 and result.tests_passed > 0, result
    assert report.conformance_level() == "FULL"
    assert {c.value for c in BASE_CAPABILITIES | EXTENDED_CAPABILITIES} == set(report.results)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_conformance_sqlite(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    urls: list[str] = []

    async def lifespan() -> AsyncIterator[None]:
        urls.append(f"sqlite:///{tmp_path / 'conformance.db'}")
        yield

    registered = _register(f"{kind} SQLAlchemySaver on SQLite", kind, urls, lifespan)
    report = await validate(registered, progress=ProgressCallbacks.default())  # type: ignore[arg-type]
    with capsys.disabled():
        report.print_report()
        print(_summary(report))
    _assert_full(report)


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_conformance_postgres(
    kind: str, pg_database_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    urls: list[str] = []

    async def lifespan() -> AsyncIterator[None]:
        async with pg_database_factory() as url:
            urls.append(url)
            yield

    registered = _register(f"{kind} SQLAlchemySaver on PostgreSQL", kind, urls, lifespan)
    report = await validate(registered, progress=ProgressCallbacks.default())  # type: ignore[arg-type]
    with capsys.disabled():
        report.print_report()
        print(_summary(report))
    _assert_full(report)
