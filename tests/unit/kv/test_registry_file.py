"""The SQLite registry file itself: who may read it (every tenant's sessions are in it) and
how an older file is brought up to the current schema (append-only steps)."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.kv.registry import Registry
from server.kv.registry.migrations import STEPS
from server.kv.registry.sql import SCHEMA


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # the common default, under which files come out 0644
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("umask_022")
def test_the_registry_file_and_its_folder_are_private(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "kv"
    found = _mode(tmp_path)
    reg = Registry(folder / "sessions.sqlite3")
    reg.record_turn("t", "s", ["k"], 4, default_ttl_s=None)  # the WAL and its index exist now
    names = ["sessions.sqlite3", "sessions.sqlite3-wal", "sessions.sqlite3-shm"]
    assert {p.name: _mode(p) for p in folder.iterdir()} == dict.fromkeys(names, 0o600)
    assert _mode(folder) == _mode(folder.parent) == 0o700  # the folders it made
    assert _mode(tmp_path) == found  # a folder it found is left as it was
    reg.close()


@pytest.mark.usefixtures("umask_022")
def test_an_older_world_readable_file_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    old = sqlite3.connect(path)
    old.execute("PRAGMA journal_mode=WAL")
    old.executescript(SCHEMA)
    old.close()
    os.chmod(path, 0o644)
    before = _mode(tmp_path)
    Registry(path).close()
    assert _mode(path) == 0o600 and _mode(tmp_path) == before


def test_an_older_file_gets_the_indexes_and_kept_counts(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    old = sqlite3.connect(path)  # a registry file from before the versioned steps
    old.executescript(SCHEMA)
    now = time.time()
    old.executemany(
        "INSERT INTO sessions (tenant, id, created_at, last_used_at) VALUES (?, ?, ?, ?)",
        [("t", "a", now, now), ("t", "b", now, now + 1), ("u", "c", now, now)],
    )
    old.commit()
    assert old.execute("PRAGMA user_version").fetchone()[0] == 0
    old.close()
    reg = Registry(path)
    assert (reg.count_sessions(), reg.count_sessions("t"), reg.count_sessions("u")) == (3, 2, 1)
    assert reg._read("PRAGMA user_version")[0][0] == len(STEPS)
    indexes = {r[0] for r in reg._read("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"sessions_expiry", "sessions_pin_lease", "sessions_recent"} <= indexes
    reg.record_turn("t", "d", ["k"], 4, default_ttl_s=None)
    assert reg.delete_session("u", "c") == []
    assert (reg.count_sessions(), reg.count_sessions("t"), reg.count_sessions("u")) == (3, 3, 0)
    reg.close()
    again = Registry(path)  # reopening runs no step twice
    assert again.count_sessions() == 3
    again.close()
