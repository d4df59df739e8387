"""The registry's local part in SQLite: where this replica holds blocks, its counters, and
its saved feed positions (tables ``blocks``, ``stats``, ``cursors`` of
:mod:`server.kv.registry.sql`).

:class:`LocalTables` is a mixin of :class:`server.kv.registry.Registry`, which owns the
connection (``_read``, ``_write``). Never shared between replicas: with sessions in Redis
these tables stay in the replica's own file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager

from server.kv.registry.sql import TierCount


class LocalTables:
    """Block locations, counters and cursors over the host's SQLite connection."""

    def _read(self, sql: str, args: Iterable[object] = ()) -> list[tuple]:
        raise NotImplementedError  # the host class's

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError  # the host class's

    def set_block_tiers(self, updates: dict[str, tuple[bool, bool, bool, int]]) -> None:
        """Publish where blocks are: key -> (in RAM, on disk, in Redis, bytes); rows in no
        tier go."""
        if not updates:
            return
        with self._write() as db:
            for key, (ram, disk, redis, nbytes) in updates.items():
                if ram or disk or redis:
                    db.execute(
                        "INSERT INTO blocks (key, nbytes, ram, disk, redis) VALUES (?, ?, ?, ?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET nbytes = excluded.nbytes, "
                        "ram = excluded.ram, disk = excluded.disk, redis = excluded.redis",
                        (key, nbytes, int(ram), int(disk), int(redis)),
                    )
                else:
                    db.execute("DELETE FROM blocks WHERE key = ?", (key,))

    def reset_block_tiers(self) -> None:
        """Forget all published locations (the engine republishes them at start)."""
        with self._write() as db:
            db.execute("DELETE FROM blocks")

    def block_usage(self, keys: Iterable[str]) -> dict[str, TierCount]:
        """Blocks and bytes per tier of the distinct ``keys`` (as published here)."""
        distinct = sorted(set(keys))
        sums = [0] * 6
        for i in range(0, len(distinct), 500):
            chunk = distinct[i : i + 500]
            row = self._read(
                "SELECT coalesce(sum(ram), 0), coalesce(sum(ram * nbytes), 0), "
                "coalesce(sum(disk), 0), coalesce(sum(disk * nbytes), 0), "
                "coalesce(sum(redis), 0), coalesce(sum(redis * nbytes), 0) FROM blocks "
                f"WHERE key IN ({', '.join('?' * len(chunk))})",
                chunk,
            )[0]
            sums = [a + int(b) for a, b in zip(sums, row, strict=True)]
        return {
            "ram": TierCount(sums[0], sums[1]),
            "disk": TierCount(sums[2], sums[3]),
            "redis": TierCount(sums[4], sums[5]),
        }

    # -------------------------------------------------------------------- stats

    def add_stats(self, counters: dict[str, float], gauges: dict[str, float]) -> None:
        """Add ``counters`` to the stored totals and overwrite ``gauges``."""
        with self._write() as db:
            for name, delta in counters.items():
                db.execute(
                    "INSERT INTO stats (name, value) VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                    (name, delta),
                )
            for name, value in gauges.items():
                db.execute(
                    "INSERT INTO stats (name, value) VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                    (name, value),
                )

    def stats(self) -> dict[str, float]:
        """All stored counters and gauges."""
        return {name: float(value) for name, value in self._read("SELECT name, value FROM stats")}

    def get_cursor(self, name: str) -> str | None:
        """A feed position saved by :meth:`set_cursor` (None: none)."""
        rows = self._read("SELECT value FROM cursors WHERE name = ?", (name,))
        return str(rows[0][0]) if rows else None

    def set_cursor(self, name: str, value: str) -> None:
        """Save a feed position under ``name``."""
        with self._write() as db:
            db.execute(
                "INSERT INTO cursors (name, value) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                (name, value),
            )
