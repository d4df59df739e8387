"""The two session registry backends, for tests that must hold for both (parametrized).

:class:`Backend` opens registries the way the product does
(:func:`server.kv.registry_shared.open_registry`): the SQLite file alone, or sessions in the
real Redis on 127.0.0.1:6379 (db 11, a fresh namespace per test, deleted afterwards) with the
local part in the file. A second :meth:`Backend.open` plays another process or replica.
:class:`RedisProxy` is a TCP forwarder to that Redis which a test can take down and bring back
(a real outage as the client sees it, without stopping the shared Redis).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.kv.control import SessionControl
from server.kv.registry_api import EngineRegistry
from server.kv.registry_shared import open_registry

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/11"
PROXY_PORT = 18150


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
            from server.kv.registry_redis import RedisSessions

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


class RedisProxy:
    """Forwards 127.0.0.1:``port`` to the real Redis; :meth:`down` closes the listener and
    every connection (clients see resets and refusals), :meth:`up` listens again."""

    def __init__(self, port: int = PROXY_PORT) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/11"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        """Accept and forward connections again."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            socks, self._socks = self._socks, []
            listener, self._listener = self._listener, None
        for s in [*socks, *([listener] if listener else [])]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    close = down

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((REDIS_HOST, REDIS_PORT))
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)
