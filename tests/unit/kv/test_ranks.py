"""Tensor-parallel reports: an event counts once every rank reported it; refused layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.kv.metadata import WorkerReport
from server.kv.scheduler.ranks import ParallelismNotSupported, RankTally, check_parallel

A, B = "aa" * 32, "bb" * 32


def test_one_rank_passes_reports_through() -> None:
    tally = RankTally(1)
    report = WorkerReport(saved=[A], released_slots=[3, 3])
    assert tally.combine([report]) == report
    assert tally.pending() == 0


def test_keyed_events_wait_for_every_rank_across_steps() -> None:
    tally = RankTally(2)
    step1 = tally.combine([WorkerReport(rank=0, saved=[A, B], written=[A])])
    assert step1.saved == [] and step1.written == []
    step2 = tally.combine([WorkerReport(rank=1, saved=[A, B]), WorkerReport(rank=0, removed=[B])])
    assert step2.saved == [A, B] and step2.written == [] and step2.removed == []
    step3 = tally.combine([WorkerReport(rank=1, written=[A], removed=[B])])
    assert step3.written == [A] and step3.removed == [B]
    assert tally.pending() == 0


def test_one_rank_failing_fails_the_block() -> None:
    tally = RankTally(2)
    out = tally.combine(
        [
            WorkerReport(rank=0, written=[A], read_ok=[B], redis_written=[A]),
            WorkerReport(rank=1, write_failed=[A], read_failed=[B], redis_written=[A]),
        ]
    )
    assert out.written == [] and out.write_failed == [A]
    assert out.read_ok == [] and out.read_failed == [B]
    assert out.redis_written == [A]


def test_repeated_outcomes_pair_in_order() -> None:
    tally = RankTally(2)
    tally.combine([WorkerReport(rank=0, written=[A]), WorkerReport(rank=0, write_failed=[A])])
    out = tally.combine([WorkerReport(rank=1, written=[A, A])])
    assert out.written == [A] and out.write_failed == [A]


def test_a_slot_use_ends_when_every_rank_released_it() -> None:
    tally = RankTally(2)
    assert tally.combine([WorkerReport(rank=0, released_slots=[5, 5, 6])]).released_slots == []
    out = tally.combine([WorkerReport(rank=1, released_slots=[5, 6])])
    assert sorted(out.released_slots) == [5, 6]
    assert tally.combine([WorkerReport(rank=1, released_slots=[5])]).released_slots == [5]
    assert tally.pending() == 0


def test_a_report_of_an_unknown_rank_is_an_error() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        RankTally(2).combine([WorkerReport(rank=2)])


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("pipeline_parallel_size", "--pipeline-parallel-size 2"),
        ("decode_context_parallel_size", "--decode-context-parallel-size 2"),
    ],
)
def test_pipeline_and_context_parallel_are_refused_naming_the_flag(field: str, flag: str) -> None:
    config = SimpleNamespace(tensor_parallel_size=2, **{field: 2})
    with pytest.raises(ParallelismNotSupported, match=flag) as err:
        check_parallel(config)
    assert "--tensor-parallel-size" in str(err.value) and "--no-kv-offload" in str(err.value)


def test_tensor_parallel_is_accepted() -> None:
    assert check_parallel(SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)) == 2
