"""A start that serves at once: the disk tier's files and the registry's snapshot come in while
the engine serves (scheduler side: no torch, no blocking).

:class:`FileScan` finds the block files on a background thread and :class:`WarmUp` takes them,
the registry's streamed snapshot and the session changes a bounded amount per step
(``WarmUp.step``), so a start with 10^6 block files serves its first request within a step, and
a block not indexed yet is a miss (recomputed) until it is, never a wrong answer. See
docs/scale.md, "Engine start".
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy, SnapshotItem
from server.kv.scheduler.recovery import warn_unregistered
from server.kv.scheduler.registry_sync import RegistrySync, SessionChange, Snapshot
from server.kv.scheduler.tails import TailBook
from server.kv.tiers.disk import DiskStore

log = logging.getLogger(__name__)


FREEZE_FROM = 5_000
"""Items (files, sessions) taken from which each step's new objects are frozen out of the
cyclic collector (``gc.freeze``); small starts never freeze."""
HOLD_S = 1.0
"""Seconds after start that lookups wait for the start-up scan and snapshot (at most)."""


class FileScan:
    """The disk tier's start-up scan (:meth:`DiskStore.iter_scan`) on a background thread,
    handing chunks of (key, size) to the scheduler thread, with each file's parent key and
    token ids where its header page holds them (:attr:`tokens`: one 4 KiB read per file). When
    the session registry did not exist before this start, the files are deleted instead (as
    :func:`forget_unregistered_files`). ``files``: a scan already done (tests)."""

    def __init__(
        self,
        store: DiskStore | None,
        registry_path: Path | None = None,
        *,
        files: dict[str, int] | None = None,
        chunk: int = 4096,
    ) -> None:
        self.store = store
        self._chunks: collections.deque[list[tuple[str, int]]] = collections.deque()
        self.tokens: dict[str, tuple[str, bytes]] = {}
        """Key -> (parent key, packed token ids) of the files in the chunks not yet taken."""
        self._ended = store is None
        self.started = time.monotonic()
        if files:
            self._chunks.append(sorted(files.items()))
        if store is not None:
            missing = registry_path is not None and not registry_path.exists()
            self._thread = threading.Thread(
                target=self._run, args=(store, missing, registry_path, chunk),
                name="lgkv-disk-scan", daemon=True,
            )  # fmt: skip
            self._thread.start()

    def _run(self, store: DiskStore, missing: bool, registry: Path | None, chunk: int) -> None:
        removed = 0
        try:
            for found in store.iter_scan(chunk):
                if not missing:
                    for key, _ in found:
                        stored = store.read_tokens(key)
                        if stored is not None:
                            self.tokens[key] = stored
                    self._chunks.append(found)
                    continue
                for key, _ in found:
                    store.remove(key)
                removed += len(found)
        except Exception:  # the files not found yet are misses; nothing is served wrong
            log.exception("KV disk tier %s: the start-up scan failed", store.root)
        finally:
            if removed and registry is not None:
                warn_unregistered(registry, removed, store.root)
            self._ended = True

    def take(self) -> list[tuple[str, int]] | None:
        """The next chunk found, or None (none yet, or the scan is done)."""
        return self._chunks.popleft() if self._chunks else None

    @property
    def done(self) -> bool:
        """The scan ended and every chunk was taken."""
        return self._ended and not self._chunks


class WarmUp:
    """What the scheduler side takes in steps after start: the block files :class:`FileScan`
    finds and the policy snapshots the registry thread streams (:class:`Snapshot` chunks).

    :meth:`step` applies them for up to a time budget: snapshot items first (the eviction
    policy learns sessions, pins and leases before their files compete for room), then file
    chunks. Until the first snapshot is in, the disk tier does not evict (:attr:`policy_ready`:
    a pin it does not know yet could be broken), and a registry barrier's answer waits behind
    a snapshot still streaming in (:meth:`defer`), so a control request that waited for the
    registry sees what it read. Keys dropped or removed while the scan runs are noted
    (:meth:`removed`): the scan may have listed their files before they went.
    """

    def __init__(
        self,
        index: BlockIndex,
        policy: EvictionPolicy,
        tails: TailBook,
        sync: RegistrySync,
        files: FileScan,
        *,
        block_bytes: int,
        answered: Callable[[int], None],
        on_files_done: Callable[[], None] | None = None,
        learn: Callable[[str, str, bytes], None] | None = None,
    ) -> None:
        self.index, self.policy, self.tails, self.sync = index, policy, tails, sync
        self.files = files
        self.block_bytes = block_bytes
        self._answered = answered
        self._on_files_done = on_files_done
        self._learn = learn
        """Takes (parent key, key, packed token ids) of a file indexed from the scan."""
        self._snapshots: collections.deque[Snapshot] = collections.deque()
        self._changes: dict[tuple[str, str], SessionChange] = {}
        self._items: Iterator[SnapshotItem] | None = None
        self._tokens: list[int] = []
        self._skip: set[str] = set()
        self._chunk: list[tuple[str, int]] = []
        self._chunk_pos = 0
        self.indexed = 0
        """Block files indexed from the scan."""
        self.taken = 0
        """Files and snapshot items taken."""
        self.files_done = False
        self.policy_ready = False
        """The first snapshot is in."""

    def add_snapshot(self, event: Snapshot) -> None:
        """A chunk of a snapshot, as it arrives (taken in order by :meth:`step`). A new
        snapshot replaces what is left of an older one, and the session changes read before
        it (it holds their state or a newer one)."""
        if event.first:
            self._snapshots.clear()
            self._items = None
            self._changes.clear()
            self.policy.begin_stream()
        self._snapshots.append(event)

    def add_change(self, event: SessionChange) -> None:
        """A session's change read from the registry (its current row and keys): taken by
        :meth:`step` after the snapshot items, a newer one of a session replacing the
        older, so a burst (another process's bulk writes) costs a bounded time per step."""
        skey = (event.tenant, event.session_id)
        self._changes.pop(skey, None)
        self._changes[skey] = event

    def _apply_change(self, event: SessionChange) -> None:
        if event.row is None:
            self.policy.forget(event.tenant, event.session_id)
        else:
            self.policy.record(event.row, event.keys)
            self.tails.learn(*event.keys)  # another replica's tails, if any

    def defer(self, token: int) -> bool:
        """Hold a registry token's answer while a snapshot or session changes read before it
        are still to be taken; False: answer now."""
        if not self._snapshots and not self._changes:
            return False
        self._tokens.append(token)
        return True

    def settle(self, tenant: str, session_id: str) -> None:
        """Take the session's item of the snapshot streaming in now, if it is still to come
        (before a turn of it is noted: the turn starts from the snapshot's gap statistics).
        O(chunks waiting)."""
        skey = (tenant, session_id)
        change = self._changes.pop(skey, None)
        if change is not None:
            self._apply_change(change)  # read before the turn: older than it
            return
        for event in self._snapshots:
            item = event.grouped().get(skey)
            if item is not None:
                self.policy.stream(item)  # taken again in its turn: skipped, as a newer one
                return

    def removed(self, keys: list[str]) -> None:
        """These keys' files were (or are being) removed: skip them if the scan lists them."""
        if not self.files_done:
            self._skip.update(keys)

    def pending(self) -> bool:
        """True while anything is left to take."""
        return bool(self._snapshots) or bool(self._changes) or not self.files_done

    def holding(self) -> bool:
        """True while lookups should wait ("not yet"): for up to :data:`HOLD_S` after start
        while the scan's files are still coming in (a small cache is in by then, so a restart
        hits at once; a large one serves after that, the files not in yet as misses)."""
        if self.files_done:
            return False
        return time.monotonic() - self.files.started < HOLD_S

    def step(self, budget_s: float) -> None:
        """Apply snapshot items, then block files, for up to ``budget_s`` seconds."""
        deadline = time.perf_counter() + budget_s
        before = self.taken
        ready = not self._snapshots or self._take_snapshots(deadline)
        if ready and self._take_changes(deadline) and not self.files_done:
            self._take_files(deadline)
        if self.taken >= FREEZE_FROM and self.taken > before:
            # What the start built lives as long as the engine: keep the cyclic collector's
            # full passes (which walk every tracked object, about 100 ms per 10^5 blocks)
            # off it, as vLLM freezes its own start-up heap (refcounting still frees).
            gc.freeze()

    def finish(self) -> None:
        """Apply everything that arrived so far (tests, tools: never on the hot path)."""
        self.step(float("inf"))

    # ----------------------------------------------------------------- helpers

    def _take_snapshots(self, deadline: float) -> bool:
        """True when no snapshot is left (within the deadline)."""
        policy = self.policy
        while self._snapshots:
            event = self._snapshots[0]
            if self._items is None:
                self._items = iter(event.grouped().values())
            items = self._items
            while True:
                batch = list(itertools.islice(items, 16))
                self.taken += len(batch)
                for item in batch:
                    policy.stream(item)
                    self.tails.learn(*item[2])
                if len(batch) < 16:
                    break
                if time.perf_counter() > deadline:
                    return False
            if event.last:
                while not policy.sweep(256):
                    if time.perf_counter() > deadline:
                        return False
            self._snapshots.popleft()
            self._items = None
            if event.last:
                self.policy_ready = True
                self._answer_tokens()
        return True

    def _take_changes(self, deadline: float) -> bool:
        """True when no change is left (within the deadline)."""
        changes = self._changes
        while changes:
            for _ in range(min(16, len(changes))):
                self._apply_change(changes.pop(next(iter(changes))))
                self.taken += 1
            if time.perf_counter() > deadline:
                break
        if changes:
            return False
        self._answer_tokens()
        return True

    def _answer_tokens(self) -> None:
        if not self._snapshots and not self._changes:
            tokens, self._tokens = self._tokens, []
            for token in tokens:
                self._answered(token)

    def _take_files(self, deadline: float) -> None:
        index, blocks, skip = self.index, self.index.blocks, self._skip
        found: list[str] = []
        while True:
            if self._chunk_pos >= len(self._chunk):
                chunk = self.files.take()
                if chunk is None:
                    break
                self._chunk, self._chunk_pos = chunk, 0
            end = min(self._chunk_pos + 64, len(self._chunk))
            self.taken += end - self._chunk_pos
            for key, size in self._chunk[self._chunk_pos : end]:
                stored = self.files.tokens.pop(key, None)
                if key in skip:
                    skip.discard(key)  # dropped meanwhile: its file is gone or going
                    continue
                state = blocks.get(key)
                if state is not None and state.on_disk:
                    continue  # saved again meanwhile
                if size != index.file_bytes or not index.add_disk_file(key):
                    index.removes.append(key)  # wrong size or over budget
                    continue
                self.tails.learn(key)
                if stored is not None and self._learn is not None:
                    self._learn(stored[0], key, stored[1])
                self.indexed += 1
                if state is None:  # on disk only: published below, built on the registry thread
                    index.dirty.discard(key)
                    found.append(key)
            self._chunk_pos = end
            if time.perf_counter() > deadline:
                break
        if found:
            size = self.block_bytes
            self.sync.write(
                f"locations of {len(found)} block files found at start",
                lambda reg: reg.set_block_tiers({k: (False, True, False, size) for k in found}),
            )
        if self.files.done and self._chunk_pos >= len(self._chunk):
            self.files_done = True
            self._skip = set()
            took = time.monotonic() - self.files.started
            if self.files.store is not None:
                log.info(
                    "KV disk tier %s: %d block files indexed in %.1f s (served meanwhile)",
                    self.files.store.root,
                    self.indexed,
                    took,
                )
            if self._on_files_done is not None:
                self._on_files_done()
