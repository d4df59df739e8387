"""What the scheduler side tells the worker each step, and what the worker reports back.

Plain dataclasses (no torch, no vLLM): :mod:`server.kv.connector` wraps them in vLLM's
``KVConnectorMetadata`` / ``KVConnectorWorkerMetadata``. Block ids are vLLM's paged-cache
block ids (with several KV cache groups, one per group: :mod:`server.kv.groups`); slots
index the RAM pool; keys are hex block hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.kv.groups import BlockRef

NO_SLOT = -1
"""Slot value of a disk load that has no RAM slot (read into a temporary buffer)."""


@dataclass(frozen=True)
class LoadItem:
    """Copy one block into the paged cache from ``source``: "ram" (slot ``slot``), "disk" or
    "redis". A disk or Redis item with a slot reads into that slot first (promoting it to RAM).
    """

    block_id: BlockRef
    key: str
    slot: int
    source: str
    partial: bool = False
    """A block used up to a token inside it (a tail, or a block a rewind or fork shares
    part of): the step that loads it computes its later slots, so a synchronous load copies it
    before the forward, not layer by layer during it."""

    @property
    def from_disk(self) -> bool:
        """True for a read on the I/O thread (disk or Redis)."""
        return self.source != "ram"


@dataclass(frozen=True)
class ShiftSource:
    """A stored block that shifted segments read: in RAM slot ``slot`` (``source`` "ram"), or
    read from disk first (``source`` "disk": into ``slot``, promoting the block to RAM, or into
    a temporary buffer when ``slot`` is :data:`NO_SLOT`)."""

    key: str
    slot: int
    source: str = "ram"


@dataclass(frozen=True)
class ShiftSegment:
    """Tokens ``src .. src + count`` of the job's shifted source number ``source`` go to the
    tokens ``dst .. dst + count`` of a paged block, their keys rotated by ``delta``
    positions."""

    source: int
    src: int
    dst: int
    count: int
    delta: int


@dataclass(frozen=True)
class ShiftItem:
    """One paged block filled token by token from stored blocks at other positions (shifted
    reuse, :mod:`server.kv.scheduler.shifted`): its segments cover every token of it."""

    block_id: BlockRef
    segments: tuple[ShiftSegment, ...]


@dataclass(frozen=True)
class LoadJob:
    """All loads of one request. ``is_async``: the request waits in WAITING_FOR_REMOTE_KVS and
    the worker reports it in ``finished_recving``; otherwise the copies finish before the
    step's forward pass."""

    req_id: str
    items: tuple[LoadItem, ...]
    is_async: bool
    shifted: tuple[ShiftItem, ...] = ()
    """Blocks after ``items`` filled by shifted reuse: before the step's forward when every
    source is in RAM, else (an async job) once the sources' reads finished."""
    shifted_sources: tuple[ShiftSource, ...] = ()
    """The stored blocks ``shifted`` reads; each one with a slot is locked once for the job
    (released once, after the fill)."""

    @property
    def shifted_slots(self) -> tuple[int, ...]:
        """The RAM slots the shifted fill holds until it is done."""
        return tuple(s.slot for s in self.shifted_sources if s.slot != NO_SLOT)

    @property
    def shifted_reads(self) -> tuple[int, ...]:
        """The numbers of the shifted sources read from disk first."""
        return tuple(i for i, s in enumerate(self.shifted_sources) if s.source != "ram")


@dataclass(frozen=True)
class SaveItem:
    """Copy paged block ``block_id`` into RAM slot ``slot`` after the forward pass, then (when
    ``to_disk``) write it to the disk tier on the background thread."""

    block_id: BlockRef
    key: str
    slot: int
    to_disk: bool
    to_redis: bool = False
    parent: str = ""
    """With ``tokens``: the key of the block this one continues (kept in its file's header)."""
    tokens: bytes = b""
    """Its token ids (packed uint32), when known and written to disk: after a restart the
    scheduler side learns them from the file (shifted reuse, reuse up to a token)."""


@dataclass
class StepPlan:
    """The scheduler's instructions for one engine step."""

    loads: list[LoadJob] = field(default_factory=list)
    """Loads into the paged cache (sync ones run before the forward pass)."""
    saves: list[SaveItem] = field(default_factory=list)
    """Blocks completed by this step, to copy out after the forward pass."""
    reads: list[tuple[str, int]] = field(default_factory=list)
    """Prefetch: (key, slot) disk -> RAM reads, on the background thread."""
    removes: list[str] = field(default_factory=list)
    """Disk files to delete (evictions, drops), queued behind earlier writes."""
    release: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM kept for this step's tail saves: report them in
    ``finished_sending`` once the saves are copied."""

    def is_empty(self) -> bool:
        """True when the worker has nothing to do."""
        return not (self.loads or self.saves or self.reads or self.removes or self.release)


@dataclass
class WorkerReport:
    """Completions the worker observed since its last report (one per step).

    Each tensor-parallel rank sends its own (``rank``); :class:`server.kv.scheduler.ranks.RankTally`
    turns them into one report of what every rank completed before the scheduler side
    applies it."""

    rank: int = 0
    """The tensor-parallel rank that sent the report."""
    saved: list[str] = field(default_factory=list)
    """Keys whose RAM copy finished (now loadable from RAM)."""
    written: list[str] = field(default_factory=list)
    """Keys whose disk file was written."""
    write_failed: list[str] = field(default_factory=list)
    """Keys whose disk write failed (disk full, I/O error)."""
    redis_written: list[str] = field(default_factory=list)
    """Keys stored in Redis."""
    redis_failed: list[str] = field(default_factory=list)
    """Keys whose Redis write failed (Redis down or slow: the block is not in Redis)."""
    read_ok: list[str] = field(default_factory=list)
    """Keys read from disk into their RAM slot (loads with a slot, prefetch)."""
    read_failed: list[str] = field(default_factory=list)
    """Keys whose file was missing or bad (the block is a miss from now on)."""
    released_slots: list[int] = field(default_factory=list)
    """Slots a load or read no longer uses (one entry per use)."""
    removed: list[str] = field(default_factory=list)
    """Keys whose file removal finished (removed, already absent, or failed with a warning)."""

    def is_empty(self) -> bool:
        """True when nothing happened."""
        return not any(
            (
                self.saved,
                self.written,
                self.write_failed,
                self.redis_written,
                self.redis_failed,
                self.read_ok,
                self.read_failed,
                self.released_slots,
                self.removed,
            )
        )
