"""Control requests on the scheduler side: ``PREFETCH_OP``, ``SYNC_OP`` and ``BARRIER_OP``.

The API process reaches the engine with one-token requests carrying an operation marker
(:mod:`server.kv.registry.control`). The scheduler side holds such a request (answers vLLM
"not yet", None, at each lookup) until its work is done, then lets it run its one token:

- prefetch: plans disk -> RAM reads of the session's blocks that are on disk only (keys as
  the policy knows them: this engine's own turns at once, other processes' changes within the
  registry thread's poll), waits for the reads, then for the block locations to be published
  (a flush and a registry barrier), so the API process reads the new RAM counts.
- sync: flushes, has the registry thread purge expired sessions and read every change (which
  also means every turn record queued before it is committed), applies the drops, then waits
  until the worker removed the freed files. A ``DELETE`` answers after it.
- barrier: flushes and waits for a registry barrier: every record queued before it is
  committed and every change recorded before it applied. The API process runs it before it
  reads or changes a session, so it sees every turn that finished before.

Nothing here touches the registry or any file: it plans, and counts what is outstanding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from langgraph_kvcache.contract import BARRIER_OP, PREFETCH_OP, SYNC_OP
from server.kv.metadata import NO_SLOT, StepPlan
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy
from server.kv.scheduler.registry_sync import RegistrySync

CONTROL_OPS = (PREFETCH_OP, SYNC_OP, BARRIER_OP)
"""The ``XARG_OP`` values this module holds (any other op runs as a plain request)."""


@dataclass
class _Hold:
    op: str
    keys: set[str] = field(default_factory=set)
    """Reads (prefetch) or file removals (sync) not yet confirmed by the worker."""
    token: int | None = None
    """Registry thread token awaited (None: not asked yet)."""
    answered: bool = False


class ControlOps:
    """Holds control requests until their work is done (see the module docstring)."""

    def __init__(
        self,
        index: BlockIndex,
        policy: EvictionPolicy,
        sync: RegistrySync,
        flush: Callable[[], None],
        removing: set[str],
    ) -> None:
        self.index = index
        self.policy = policy
        self.sync = sync
        self._flush = flush
        """Queue a forced publish of block locations and counters."""
        self._removing = removing
        """The scheduler's keys whose file removal the worker has not confirmed (live set)."""
        self._held: dict[str, _Hold] = {}

    def step(
        self, req_id: str, op: str, session: tuple[str, str] | None, plan: StepPlan
    ) -> tuple[int | None, bool]:
        """The lookup answer for a control request: (None, False) while held, then (0, False).
        An unknown op runs at once as a plain one-token request."""
        if op not in CONTROL_OPS:
            return 0, False
        hold = self._held.get(req_id)
        if hold is None:
            hold = self._held[req_id] = _Hold(op)
            if op == PREFETCH_OP and session is not None:
                hold.keys = self._plan_reads(session, plan)
            elif op == SYNC_OP:
                self._flush()
                hold.token = self.sync.sync()
            elif op == BARRIER_OP:
                self._flush()
                hold.token = self.sync.barrier()
        self.advance()
        return (0, False) if hold.answered and not hold.keys else (None, False)

    def advance(self) -> None:
        """Ask for a prefetch's publish once its reads are done."""
        for hold in self._held.values():
            if hold.op == PREFETCH_OP and not hold.keys and hold.token is None:
                self._flush()
                hold.token = self.sync.barrier()

    def answered(self, token: int) -> None:
        """The registry thread answered ``token`` (its drops are applied already)."""
        for hold in self._held.values():
            if hold.token is not None and hold.token <= token and not hold.answered:
                hold.answered = True
                if hold.op == SYNC_OP:
                    hold.keys = set(self.index.removes) | self._removing

    def confirmed(self, keys: set[str]) -> None:
        """The worker finished these reads or removals."""
        for hold in self._held.values():
            hold.keys -= keys

    def forget(self, req_id: str) -> None:
        """The request finished."""
        self._held.pop(req_id, None)

    def pending(self) -> bool:
        """True while a held request waits for something."""
        return any(h.keys or not h.answered for h in self._held.values())

    def _plan_reads(self, session: tuple[str, str], plan: StepPlan) -> set[str]:
        keys = self.policy.keys_of(*session)
        todo = [
            k
            for k in keys
            if self.index.tier_of(k) == "disk" and self.index.blocks[k].slot == NO_SLOT
        ]
        slots = self.index.alloc_slots(len(todo), protect=set(keys))
        pending: set[str] = set()
        for key, slot in zip(todo, slots, strict=False):
            state = self.index.blocks[key]
            state.slot, state.ram_ready, state.locks = slot, False, state.locks + 1
            self.index.touch(key)
            plan.reads.append((key, slot))
            pending.add(key)
        return pending
