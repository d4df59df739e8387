"""Shared fixtures: offline model folders and the environment every vLLM engine needs.

Fixtures that start an engine or a server live in the conftest of the folder that uses them and
are session-scoped: one engine per test session, never one per test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

# Set before anything imports vLLM: in-process engine, no thread pinning, no network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE_THREADS = str(
    max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
)
"""OpenMP threads of the forward pass in every engine the suite runs: this process's cores
shared by the pytest-xdist workers (2 in a serial run on the 2-core machine). The test servers'
engine process runs the scheduler and the model in turn (``tests/integration/conftest.py``
``ONE_ENGINE_PROCESS``), and the in-process engines and engine scripts compute while pytest
waits, so the cores are otherwise idle: the ReAct loop test took 137 s with one thread and 99 s
with two, the SmolLM2 second-turn engine test 68 s and 38 s. The servers in the users'
three-process layout get the same threads (their engine core polls beside the model's
process); the tests that run two engines at once (two router replicas, two tensor-parallel
ranks) give each one thread."""
os.environ.setdefault("OMP_NUM_THREADS", ENGINE_THREADS)


# ---------------------------------------------------------------------------- xdist groups
# ``make test`` runs two pytest-xdist workers (``TEST_WORKERS``; see the scheduler below): each
# group below runs whole on one worker, longest first, so the two workers finish together.
SHARED_GROUPS: dict[str, tuple[str, ...]] = {
    # The in-process engine (tests/integration/kv/conftest.py ``llm``): vLLM keeps the KV
    # connector in a process global, so one engine per process and its modules together.
    "kv-engine": (
        "tests/integration/kv/test_connector.py",
        "tests/integration/kv/test_connector_tails.py",
        "tests/integration/kv/test_layer_loads_engine.py",
    ),
    # Every user of ``smollm2_server``: one worker starts it, not both (the chat modules
    # outside this group started a second one on the other worker, 15 s and 1.5 GB more).
    "smollm2": (
        "tests/integration/agents/",
        "tests/integration/chat/",
        "tests/integration/server/test_server_smollm2.py",
    ),
}
PER_TEST_GROUPS = ("tests/examples/test_notebooks.py",)
"""Modules whose tests are independent groups (each notebook starts its own server)."""
LONGEST_FIRST = (
    "smollm2",
    "tests/examples/test_notebooks.py::test_notebook_runs[02_agentic_rag]",
    "tests/examples/test_notebooks.py::test_notebook_runs[05_tool_agent]",
    "tests/integration/server/test_server_faults.py",
    "tests/integration/kv/test_engines.py",
    "tests/integration/cluster/test_router.py",
    "tests/integration/kv/test_tensor_parallel.py",
    "tests/examples/test_notebooks.py::test_notebook_runs[03_human_in_the_loop]",
    "tests/integration/thread_session/test_agent_thread.py",
    "tests/integration/kv/test_compression.py",
    "tests/integration/server/test_server_lifecycle.py",
    "kv-engine",
)
"""Groups that take a minute or more (``--durations``), longest first; the rest follow in
collection order. Only the order depends on this list, never what runs."""


def xdist_group_of(nodeid: str) -> str:
    """The group a test runs in: a shared group, the test itself, or its module."""
    path = nodeid.split("::", 1)[0]
    for group, prefixes in SHARED_GROUPS.items():
        if any(path.startswith(prefix) for prefix in prefixes):
            return group
    return nodeid if path in PER_TEST_GROUPS else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, put the longest groups first: every worker collects in this order,
    and the controller hands out groups in it (``--no-loadscope-reorder``). A serial run keeps
    collection order."""
    if not hasattr(config, "workerinput"):  # the serial run (the controller collects nothing)
        return
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    groups = {item.nodeid: xdist_group_of(item.nodeid) for item in items}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(groups[item.nodeid], len(first_seen))
    items.sort(  # stable: a group's tests keep their order
        key=lambda it: (rank.get(groups[it.nodeid], len(rank)), first_seen[groups[it.nodeid]])
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Two workers run whole groups (:func:`xdist_group_of`), each on one worker.

    xdist's own ``--dist loadgroup`` reads ``xdist_group`` marks through a suffix it appends
    to each test's node id; with pytest 9.2 and xdist 3.8 no suffix appears (measured: three
    modules marked with ``pytestmark = pytest.mark.xdist_group(...)`` had their tests spread
    over both workers), so every test was its own group: a module's server started on each
    worker, and a test that builds on the one before it failed. This scheduler groups by node
    id itself."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct, float32), built once into the user cache."""
    from server.model import build_default_model

    return build_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path) -> Path:
    """A random-weight 2-layer Llama with SmolLM2's tokenizer and chat template (fast tests)."""
    from server.model import build_tiny_model, default_cache_dir

    out = default_cache_dir() / "models" / "tiny-llama-h32"
    return build_tiny_model(out, tokenizer_from=smollm2_dir)


# ---------------------------------------------------------------------------- databases
# PostgreSQL tests use the server on 127.0.0.1:5432 (trust auth). Each test database is created
# as ``lgkv_<random>`` in autocommit mode from an admin database and dropped at teardown; when the
# server is unreachable those tests skip with the reason and everything else runs.
PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_USERS = ("postgres", "root")
PG_ADMIN_DBS = ("postgres", "test")


def _admin_conninfo() -> str | None:
    import psycopg

    for user in PG_USERS:
        for dbname in PG_ADMIN_DBS:
            conninfo = f"host={PG_HOST} port={PG_PORT} user={user} dbname={dbname}"
            try:
                with psycopg.connect(conninfo, connect_timeout=3):
                    return conninfo
            except psycopg.Error:
                continue
    return None


@pytest.fixture(scope="session")
def pg_admin() -> str:
    """Admin conninfo for the local PostgreSQL server; skips the test when it is unreachable."""
    conninfo = _admin_conninfo()
    if conninfo is None:
        pytest.skip(f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT} (users {PG_USERS})")
    return conninfo


@contextmanager
def fresh_pg_database(admin: str) -> Iterator[str]:
    """Create ``lgkv_<random>``, yield its ``postgresql://`` URL, drop it afterwards."""
    import psycopg

    name = f"lgkv_{uuid.uuid4().hex[:12]}"
    user = dict(part.split("=", 1) for part in admin.split())["user"]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://{user}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def new_pg_database(pg_admin: str) -> Callable[[], AbstractContextManager[str]]:
    """Makes fresh PostgreSQL databases on demand: ``with new_pg_database() as url``."""
    return lambda: fresh_pg_database(pg_admin)


@pytest.fixture
def pg_url(pg_admin: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    with fresh_pg_database(pg_admin) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file for one test."""
    return f"sqlite:///{tmp_path / 'checkpoints.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database of each kind: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'checkpoints.db'}"
        return
    with fresh_pg_database(request.getfixturevalue("pg_admin")) as url:
        yield url
