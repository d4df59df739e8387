"""The two session registry backends, for tests that must hold for both (parametrized).

:class:`Backend` opens registries the way the product does
(:func:`server.kv.registry.shared.open_registry`): the SQLite file alone, or sessions in the
real Redis on 127.0.0.1:6379 (db 11, a fresh namespace per test, deleted afterwards) with the
local part in the file. A second :meth:`Backend.open` plays another process or replica.
:func:`proxy` is a :class:`RedisProxy` in front of that Redis, which a test takes down and
brings back (a real outage as the client sees it, without stopping the shared Redis).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis_proxy import RedisProxy

from server.kv.registry.api import EngineRegistry
from server.kv.registry.control import SessionControl
from server.kv.registry.shared import open_registry

REDIS_URL = "redis://127.0.0.1:6379/11"
PROXY_PORT = 18150
"""The port of :func:`proxy` (this suite's range)."""

__all__ = ["REDIS_URL", "Backend", "RedisProxy", "make_backend", "proxy", "require_redis"]


def require_redis() -> None:
    """Skip the test when no Redis answers on 127.0.0.1:6379."""
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")


@dataclass
class Backend:
    """One registry backend in a test's folder."""

    kind: str
    path: Path
    redis_url: str | None = None
    namespace: str = "default"

    def open(self, *, busy_timeout_s: float = 30.0, url: str | None = None) -> EngineRegistry:
        """A new connection (another process's or replica's)."""
        return open_registry(
            self.path,
            redis_url=url or self.redis_url,
            namespace=self.namespace,
            busy_timeout_s=busy_timeout_s,
        )

    def control(self, *, url: str | None = None) -> SessionControl:
        """A SessionControl (the API process) on this backend."""
        return SessionControl(
            self.path.parent, redis_url=url or self.redis_url, namespace=self.namespace
        )

    def clear(self) -> None:
        """Delete the namespace's Redis keys (no-op for SQLite)."""
        if self.redis_url:
            from server.kv.registry.redis import RedisSessions

            sessions = RedisSessions(self.redis_url, self.namespace)
            sessions.clear()
            sessions.close()


def make_backend(kind: str, tmp_path: Path) -> Backend:
    """A backend of ``kind`` ("sqlite" or "redis") with its file in ``tmp_path``."""
    path = tmp_path / "sessions.sqlite3"
    if kind == "sqlite":
        return Backend(kind, path)
    require_redis()
    return Backend(kind, path, REDIS_URL, f"test-{uuid.uuid4().hex}")


def proxy() -> RedisProxy:
    """A proxy to db 11 of the real Redis, forwarding."""
    return RedisProxy(PROXY_PORT)
