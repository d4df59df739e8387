"""Tensor-parallel ranks' reports, combined into what the engine as a whole has done.

With ``tensor_parallel_size`` N, vLLM runs N workers; each holds its own shard of every
block's KV heads, so each moves its own bytes (RAM pool, its own files, its own Redis keys)
and sends its own :class:`WorkerReport` each step. vLLM's ``KVOutputAggregator`` (in
``vllm/distributed/kv_transfer/kv_connector/utils.py``) already counts
``finished_sending`` / ``finished_recving`` per request until all N workers reported it, and
unions ``invalid_block_ids``; it hands our worker metadata to our ``aggregate``, which keeps the
N reports apart (:class:`server.kv.connector.SessionKVWorkerMetadata`). The scheduler side is
one process deciding for all ranks, so a block is saved, written, read or removed only once
every rank did it; :class:`RankTally` keeps that count across steps (ranks' background disk
and Redis jobs finish at different times):

- ``saved``, ``removed``: reported once every rank reported it.
- ``written`` / ``write_failed``, ``read_ok`` / ``read_failed``, ``redis_written`` /
  ``redis_failed``: once every rank has an outcome, a success if every rank succeeded, else
  the failure (a block with one rank's shard missing is a miss; the scheduler then removes the
  other ranks' files, as it does for any failed write or read).
- ``released_slots``: a slot use ends when every rank released it (one entry per use and rank).

Outcomes of one key are matched in order per rank, so a key saved twice pairs first with
first. With one rank, reports pass through unchanged.

:func:`check_parallel` is the one place that says which parallel layouts the connector serves
(the connector at engine start, and the server before it starts vLLM).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from server.kv.metadata import WorkerReport

_OUTCOMES: tuple[tuple[str, str | None], ...] = (
    ("saved", None),
    ("written", "write_failed"),
    ("redis_written", "redis_failed"),
    ("read_ok", "read_failed"),
    ("removed", None),
)
"""(success field, failure field or None) of every keyed event of :class:`WorkerReport`."""


class ParallelismNotSupported(ValueError):
    """A vLLM parallel layout the connector cannot serve (pipeline or context parallel)."""


def check_parallel(parallel_config: Any) -> int:
    """The tensor-parallel size of vLLM's ``ParallelConfig`` (or of the serve namespace), after
    refusing layouts in which a rank holds only some layers (pipeline) or some tokens (context
    parallel) of a block. Raises :class:`ParallelismNotSupported` naming the flag."""
    refused = (
        ("pipeline_parallel_size", "--pipeline-parallel-size", "pipeline parallelism"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size",
         "prefill context parallelism"),
        ("decode_context_parallel_size", "--decode-context-parallel-size",
         "decode context parallelism"),
    )  # fmt: skip
    for attr, flag, what in refused:
        size = int(getattr(parallel_config, attr, 1) or 1)
        if size > 1:
            raise ParallelismNotSupported(
                f"The session KV connector does not support {what} ({flag} {size}): each rank "
                f"would hold only some layers or tokens of a block. Use {flag} 1 (tensor "
                "parallelism, --tensor-parallel-size N, is supported), or --no-kv-offload to "
                "serve without the session KV cache."
            )
    return int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)


class RankTally:
    """Combines the per-rank reports of ``tp_size`` workers (scheduler side, no torch)."""

    def __init__(self, tp_size: int) -> None:
        if tp_size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self._pending: dict[str, dict[str, list[deque[bool]]]] = {ok: {} for ok, _ in _OUTCOMES}
        """Per success field, per key: each rank's outcomes not yet matched."""
        self._slots: list[Counter[int]] = [Counter() for _ in range(tp_size)]
        """Per rank: slot releases not yet matched by every rank."""

    def combine(self, reports: Iterable[WorkerReport]) -> WorkerReport:
        """The events of ``reports`` (this step's, any ranks) that every rank has now done,
        with what earlier steps left waiting."""
        reports = list(reports)
        if self.tp_size == 1:
            return _concat(reports)
        out = WorkerReport()
        for report in reports:
            if not 0 <= report.rank < self.tp_size:
                raise ValueError(f"report of rank {report.rank}, tensor-parallel size is "
                                 f"{self.tp_size}")  # fmt: skip
            for ok, failed in _OUTCOMES:
                book = self._pending[ok]
                for key in getattr(report, ok):
                    self._note(book, key, report.rank, True)
                for key in getattr(report, failed) if failed else ():
                    self._note(book, key, report.rank, False)
            self._slots[report.rank].update(report.released_slots)
        for ok, failed in _OUTCOMES:
            book = self._pending[ok]
            for key in list(book):
                self._settle(book, key, getattr(out, ok), getattr(out, failed) if failed else [])
        for slot in list(self._slots[0]):
            done = min(counts[slot] for counts in self._slots)
            if done:
                out.released_slots.extend([slot] * done)
                for counts in self._slots:
                    counts[slot] -= done
                    if not counts[slot]:
                        del counts[slot]
        return out

    def pending(self) -> int:
        """Events some rank has reported and another has not (for tests and logs)."""
        keyed = sum(len(book) for book in self._pending.values())
        return keyed + sum(len(counts) for counts in self._slots)

    def _note(self, book: dict[str, list[deque[bool]]], key: str, rank: int, ok: bool) -> None:
        queues = book.get(key)
        if queues is None:
            queues = book[key] = [deque() for _ in range(self.tp_size)]
        queues[rank].append(ok)

    @staticmethod
    def _settle(
        book: dict[str, list[deque[bool]]], key: str, oks: list[str], fails: list[str]
    ) -> None:
        queues = book[key]
        while all(queues):
            outcomes = [q.popleft() for q in queues]
            (oks if all(outcomes) else fails).append(key)
        if not any(queues):
            del book[key]


def _concat(reports: list[WorkerReport]) -> WorkerReport:
    """One rank's reports (normally one a step) as one."""
    if len(reports) == 1:
        return reports[0]
    out = WorkerReport()
    for report in reports:
        for name in WorkerReport.__dataclass_fields__:
            if name != "rank":
                getattr(out, name).extend(getattr(report, name))
    return out
