"""Reclaim the shared memory a killed server's engine left in ``/dev/shm``.

vLLM's engine processes create POSIX shared-memory segments (``/dev/shm/psm_*``, Python's
``multiprocessing.shared_memory``: the multiprocess executor's message queues, 160 and
240 MiB). A clean stop unlinks them. A ``kill -9`` of the server's process group also kills
Python's resource tracker, which would have unlinked them, so they stay until the machine
reboots and repeated crashes fill its memory.

Contract:

- :func:`record_segments` (the API process, once the engine is up) writes
  ``<cache_dir>/shm/<pid>.json``: the segments this process and its descendants map, each with
  the pid and start time of the processes that map it.
- :func:`reclaim_segments` (the next start on the same cache folder, before its engine
  starts; and a clean stop, for its own record) unlinks every recorded segment whose
  recorded processes are all dead and that no live process maps, logs one warning naming what
  it freed, and deletes the record. A record of a server that still runs is left alone.

Only names this server's own processes mapped are ever unlinked; other servers' segments
(even on the same machine and cache folder) are never touched. Linux only (``/proc``);
elsewhere both functions do nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory segments live on Linux."""
SEGMENT_PREFIX = "psm_"
"""Name prefix of Python's ``multiprocessing.shared_memory`` segments."""
RECORD_DIR = "shm"
"""Folder of the records inside the cache folder."""

_Owner = tuple[int, float]  # pid, process start time (seconds since boot, from /proc)


def record_segments(cache_dir: Path, root_pid: int | None = None) -> list[str]:
    """Record the segments mapped by ``root_pid`` (default: this process) and its descendants.

    Returns the recorded names (sorted). Never raises for a process that vanished meanwhile.
    """
    if not SHM_DIR.is_dir():
        return []
    root = os.getpid() if root_pid is None else root_pid
    owners: dict[str, list[_Owner]] = {}
    for pid in [root, *_descendants(root)]:
        started = _start_time(pid)
        if started is None:
            continue
        for name in _mapped_segments(pid):
            owners.setdefault(name, []).append((pid, started))
    record = {
        "pid": root,
        "started": _start_time(root),
        "segments": {name: owners[name] for name in sorted(owners)},
    }
    folder = Path(cache_dir) / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{root}.json"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / f"{root}.json")
    return sorted(owners)


def reclaim_segments(cache_dir: Path, *, own: bool = False) -> tuple[int, int]:
    """Unlink what dead servers of ``cache_dir`` left; return (segments, bytes) freed.

    ``own=True`` also handles this process's own record (at a clean stop, once its engine
    has exited), which is otherwise skipped as a live server's.
    """
    folder = Path(cache_dir) / RECORD_DIR
    if not folder.is_dir() or not SHM_DIR.is_dir():
        return 0, 0
    freed, freed_bytes = 0, 0
    live_maps: set[str] | None = None
    for path in sorted(folder.glob("*.json")):
        record = _read_record(path)
        if record is None:
            log.warning("shared-memory record %s is unreadable: deleted", path)
            path.unlink(missing_ok=True)
            continue
        server = (int(record.get("pid", -1)), record.get("started"))
        mine = server[0] == os.getpid()
        if _alive(server) and not (own and mine):
            continue  # a running server's segments
        names: list[str] = []
        record_bytes = 0
        kept: dict[str, list] = {}
        for name, owners in dict(record.get("segments", {})).items():
            target = SHM_DIR / name
            if not _is_segment_name(name) or not target.exists():
                continue  # gone already (a clean stop unlinks them)
            if live_maps is None:
                live_maps = _all_mapped_segments()
            if name in live_maps or any(_alive((int(p), s)) for p, s in owners):
                kept[name] = owners  # still in use: try again at the next start
                continue
            with contextlib.suppress(OSError):
                size = target.stat().st_size
                target.unlink()
                record_bytes += size
                names.append(name)
        freed, freed_bytes = freed + len(names), freed_bytes + record_bytes
        if names:
            log.warning(
                "reclaimed %d shared-memory segment(s) (%.0f MiB) in %s left by server pid %d "
                "that did not stop cleanly: %s",
                len(names),
                record_bytes / (1 << 20),
                SHM_DIR,
                server[0],
                ", ".join(names),
            )
        if kept:
            path.write_text(json.dumps({**record, "segments": kept}))
        else:
            path.unlink(missing_ok=True)
    return freed, freed_bytes


def _is_segment_name(name: str) -> bool:
    return name.startswith(SEGMENT_PREFIX) and "/" not in name and name not in (".", "..")


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _descendants(pid: int) -> list[int]:
    """Pids of every descendant of ``pid`` (from /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat_fields(int(entry.name))
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _start_time(pid: int) -> float | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    stat = _stat_fields(pid)
    if stat is None or stat[0] == "Z":
        return None
    return float(stat[19])


def _alive(owner: tuple[int, object]) -> bool:
    pid, started = owner
    return pid > 0 and started is not None and _start_time(pid) == started


def _mapped_segments(pid: int) -> set[str]:
    """Names of ``/dev/shm/psm_*`` segments mapped by ``pid``."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    prefix = f"{SHM_DIR}/{SEGMENT_PREFIX}"
    names = set()
    for line in text.splitlines():
        at = line.find(prefix)
        if at >= 0:
            names.add(line[at + len(str(SHM_DIR)) + 1 :].split()[0])
    return names


def _all_mapped_segments() -> set[str]:
    """Segments any live process maps (so a segment still in use is never unlinked)."""
    names: set[str] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            names |= _mapped_segments(int(entry.name))
    return names
