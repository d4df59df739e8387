"""A TCP proxy in front of the real Redis that a test can take down, hang or bring back.

Tests of Redis outages use it instead of stopping the Redis other tests share: clients see
exactly what an outage looks like from their side. ``down()`` refuses connections and cuts
the open ones; ``hang()`` accepts connections and never answers (a hung Redis: only socket
timeouts end a call); ``up()`` forwards again (and cuts the hung connections, so clients
reconnect).
"""

from __future__ import annotations

import contextlib
import socket
import threading

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


class RedisProxy:
    """127.0.0.1:``port`` -> the real Redis, in one of the modes ``up``, ``hung``, ``down``."""

    def __init__(self, port: int, db: int = 11, *, mode: str = "up") -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/{db}"
        self.mode = "down"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.hang() if mode == "hung" else self.up()

    def up(self) -> None:
        """Forward new connections to Redis (hung ones are cut)."""
        self._set("up")

    def hang(self) -> None:
        """Accept connections and never answer."""
        self._set("hung")

    def down(self) -> None:
        """Refuse new connections and cut the open ones."""
        with self._lock:
            listener, self._listener, self.mode = self._listener, None, "down"
        if listener is not None:  # first, so no client reconnects between the two steps
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self._cut()

    close = down

    def _set(self, mode: str) -> None:
        self._cut()
        with self._lock:
            self.mode = mode
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _cut(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self.mode == "down":
                    client.close()
                    continue
                self._socks.append(client)
                if self.mode != "up":
                    continue  # held open, never answered
            upstream = socket.create_connection((REDIS_HOST, REDIS_PORT))
            with self._lock:
                self._socks.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)
