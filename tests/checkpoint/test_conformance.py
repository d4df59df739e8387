"""``langgraph-checkpoint-conformance`` against both savers on SQLite and PostgreSQL.

Two suites: the PyPI release (0.0.2, ``langgraph.checkpoint.conformance``) and the suite as it
stands on LangGraph's main branch (vendored in ``conformance_main``, which adds
``delta_channel_history``). Each run registers the saver with the suite's
``checkpointer_test`` (its ``lifespan`` creates the database: a new SQLite file, or a new
PostgreSQL database dropped afterwards), runs ``validate`` and asserts that every base and
extended capability was detected and passed. The suite's own report is printed, with the
per-capability test counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import conformance_main
import conformance_main.capabilities
import conformance_main.report
import langgraph.checkpoint.conformance as conformance_pypi
import pytest

from langgraph_kvcache.checkpoint.aio import AsyncSQLAlchemySaver
from langgraph_kvcache.checkpoint.sync import SQLAlchemySaver

SUITES: dict[str, ModuleType] = {"pypi": conformance_pypi, "main": conformance_main}
"""The two suites by name; each has ``checkpointer_test``, ``validate``, ``capabilities`` and
``report`` with the same API."""


def _register(suite: ModuleType, name: str, kind: str, urls: list[str], lifespan: object) -> object:
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

    return suite.checkpointer_test(name=name, lifespan=lifespan)(factory)  # type: ignore[arg-type]


def _summary(report: Any) -> str:
    counts = {
        name: f"{r.tests_passed}/{r.tests_passed + r.tests_failed}"
        for name, r in sorted(report.results.items())
    }
    level = report.conformance_level()
    return f"{report.checkpointer_name}: {level} " + " ".join(f"{k}={v}" for k, v in counts.items())


def _assert_full(suite: ModuleType, report: Any) -> None:
    caps = suite.capabilities
    assert report.passed_all_base(), report.to_dict()
    for cap in caps.ALL_CAPABILITIES:
        result = report.results[cap.value]
        assert result.detected, f"{cap.value} not detected"
        assert result.passed is True, f"{cap.value} failed: {result.failures}"
        assert result.tests_failed == 0 and result.tests_passed > 0, result
    assert report.conformance_level() == "FULL"
    assert {c.value for c in caps.BASE_CAPABILITIES | caps.EXTENDED_CAPABILITIES} == set(
        report.results
    )


@pytest.mark.parametrize("suite_name", list(SUITES))
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_conformance_sqlite(
    suite_name: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    urls: list[str] = []

    async def lifespan() -> AsyncIterator[None]:
        urls.append(f"sqlite:///{tmp_path / 'conformance.db'}")
        yield

    suite = SUITES[suite_name]
    registered = _register(
        suite, f"{kind} SQLAlchemySaver on SQLite ({suite_name} suite)", kind, urls, lifespan
    )
    progress = suite.report.ProgressCallbacks.default()
    report = await suite.validate(registered, progress=progress)
    with capsys.disabled():
        report.print_report()
        print(_summary(report))
    _assert_full(suite, report)


@pytest.mark.postgres
@pytest.mark.parametrize("suite_name", list(SUITES))
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_conformance_postgres(
    suite_name: str, kind: str, pg_database_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    urls: list[str] = []

    async def lifespan() -> AsyncIterator[None]:
        async with pg_database_factory() as url:
            urls.append(url)
            yield

    suite = SUITES[suite_name]
    registered = _register(
        suite, f"{kind} SQLAlchemySaver on PostgreSQL ({suite_name} suite)", kind, urls, lifespan
    )
    progress = suite.report.ProgressCallbacks.default()
    report = await suite.validate(registered, progress=progress)
    with capsys.disabled():
        report.print_report()
        print(_summary(report))
    _assert_full(suite, report)
