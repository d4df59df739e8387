"""Tail blocks on the scheduler side without vLLM: keys, save on finish, lookups that are not
block-aligned, the last-token rule, superseding, eviction order and restarts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from test_scheduler import BS, Req, check_slots, make, prompt, report

from server.kv.keys import block_key, parse_tail_key, tail_key, tail_root
from server.kv.metadata import StepPlan
from server.kv.scheduler.scheduler import SessionKVScheduler


@dataclass
class TReq(Req):
    """A request whose token ids are its prompt (a finished one: prompt and answer)."""

    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt


@dataclass
class Turn:
    matched: int
    is_async: bool
    plan: StepPlan
    delayed: bool
    tail_plan: StepPlan


def turn(sched: SessionKVScheduler, req: TReq, *, computed: int | None = None) -> Turn:
    """Admit ``req``, compute all of it in one step, finish it with ``computed`` tokens of KV
    (all but the last by default, as vLLM does), then run the step that saves its tail."""
    n, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert n is not None
    ids = list(range(100, 100 + len(req.prompt) // BS + 1))
    sched.update_state_after_alloc(req, ids, n)
    plan = sched.build_plan([(req.request_id, ids, True, n)], {req.request_id: req.num_tokens - n})
    report(sched, plan)
    req.num_computed_tokens = req.num_tokens - 1 if computed is None else computed
    delayed = sched.request_finished(req, ids)
    tail_plan = sched.build_plan([], {})
    report(sched, tail_plan)
    return Turn(n, is_async, plan, delayed, tail_plan)


def test_tail_key_names_its_parent_and_length() -> None:
    parent = "ab" * 32
    key = tail_key(parent, [1, 2, 3])
    assert parse_tail_key(key) == (parent, 3)
    assert parse_tail_key(parent) is None  # a full block's key
    assert tail_key(parent, [1, 2, 4]) != key and tail_key("cd" * 32, [1, 2, 3]) != key
    assert tail_root("tenant-a", None) != tail_root("tenant-b", None)
    assert tail_root(None, "lora") != tail_root(None, None)
    with pytest.raises(ValueError):
        tail_key(parent, [])


def test_finished_turn_saves_its_tail_and_the_next_turn_loads_it(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(1, 3, extra=3)  # 3 full blocks + 3 tokens; the last has no KV yet
    first = turn(sched, TReq("r1", seq, "s"))
    assert first.delayed  # vLLM keeps the blocks until the worker copied the tail
    (save,) = first.tail_plan.saves
    assert save.block_id == 103 and not save.to_redis and first.tail_plan.release == ["r1"]
    assert parse_tail_key(save.key) == (block_key(TReq("x", seq).block_hashes[2]), 2)
    nxt = TReq("r2", [*seq, 7, 7, 7, 7], "s")
    assert sched.get_num_new_matched_tokens(nxt, 0) == (3 * BS + 2, False)  # not aligned
    sched.update_state_after_alloc(nxt, list(range(200, 205)), 3 * BS + 2)
    plan = sched.build_plan([("r2", list(range(200, 205)), True, 3 * BS + 2)], {"r2": 5})
    (job,) = plan.loads
    assert [i.block_id for i in job.items] == [200, 201, 202, 203] and not job.is_async
    assert job.items[-1].key == save.key and job.items[-1].source == "ram"
    check_slots(sched.index)


def test_tail_is_invisible_until_its_save_is_planned(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(2, 2, extra=3)
    req = TReq("r1", seq, "s")
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    ids = list(range(100, 103))
    sched.update_state_after_alloc(req, ids, n)
    report(sched, sched.build_plan([("r1", ids, True, 0)], {"r1": len(seq)}))
    req.num_computed_tokens = len(seq) - 1
    assert sched.request_finished(req, ids)
    # the next step's lookup runs before its plan is built: only the full blocks count
    assert sched.get_num_new_matched_tokens(TReq("r2", [*seq, 1, 1], "s"), 0) == (2 * BS, False)
    plan = sched.build_plan([], {})
    assert plan.release == ["r1"] and len(plan.saves) == 1
    report(sched, plan)
    assert sched.get_num_new_matched_tokens(TReq("r3", [*seq, 1, 1], "s"), 0) == (
        2 * BS + 2,
        False,
    )


def test_whole_prompt_match_leaves_the_last_token(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(3, 2, extra=3)
    turn(sched, TReq("r1", seq, "s"))  # tail: seq[8:10]
    again = TReq("r2", seq[:-1], "s")  # exactly the tokens with KV
    assert sched.get_num_new_matched_tokens(again, 0) == (len(seq) - 2, False)
    one_token = TReq("r3", seq[: 2 * BS + 1], "s")  # shorter than the tail: cannot check it
    assert sched.get_num_new_matched_tokens(one_token, 0) == (2 * BS, False)


def test_tail_needs_its_tokens_exactly(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(4, 2, extra=4)
    turn(sched, TReq("r1", seq, "s"))
    other = [*seq[: 2 * BS], seq[2 * BS] ^ 1, *seq[2 * BS + 1 :], 5]
    assert sched.get_num_new_matched_tokens(TReq("r2", other, "s"), 0) == (2 * BS, False)


@dataclass
class EmbedsReq(TReq):
    """A request of prompt embeddings (``--enable-prompt-embeds``): its token ids are
    placeholders, only vLLM's block hashes (which hash the embeddings) name its inputs."""

    prompt_embeds: object = "embeddings"


def test_prompt_embeddings_get_whole_blocks_and_no_tail(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(6, 2, extra=3)  # 2 whole blocks and a 2-token tail (the last has no KV)
    first = turn(sched, EmbedsReq("r1", seq, "s"))
    assert not first.tail_plan.saves  # no tail is saved under placeholder token ids
    second = turn(sched, TReq("r2", seq, "s"))  # the same ids as tokens: their own tail
    assert len(second.tail_plan.saves) == 1
    assert sched.get_num_new_matched_tokens(TReq("r4", [*seq, 1], "s"), 0) == (2 * BS + 2, False)
    # embeddings with the same placeholder ids: whole blocks only, never the tokens' tail
    got = sched.get_num_new_matched_tokens(EmbedsReq("r3", [*seq, 1], "s"), 0)
    assert got == (2 * BS, False)


def test_first_block_tail_is_per_tenant_salt(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = [5, 6, 7]  # no full block: the tail's parent is the salted root
    assert turn(sched, TReq("r1", seq, "s", cache_salt="a")).delayed
    assert sched.get_num_new_matched_tokens(TReq("r2", [*seq, 1], "s", cache_salt="a"), 0) == (
        2,
        False,
    )
    assert sched.get_num_new_matched_tokens(TReq("r3", [*seq, 1], "s", cache_salt="b"), 0) == (
        0,
        False,
    )


def test_no_tail_without_session_ram_or_partial_block(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    assert not turn(sched, TReq("r1", prompt(5, 2, extra=3))).delayed  # no session
    aligned = turn(sched, TReq("r2", prompt(6, 2, extra=1), "s"))  # 2 * BS tokens of KV
    assert not aligned.delayed and not aligned.tail_plan.saves
    off = make(tmp_path / "off", ram_blocks=0, disk_blocks=0)
    assert not turn(off, TReq("r3", prompt(7, 2, extra=3), "s")).delayed


def test_next_turn_supersedes_the_tail_unless_another_session_lists_it(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(8, 2, extra=3)
    old = turn(sched, TReq("r1", seq, "s")).tail_plan.saves[0].key
    longer = [*seq, 9, 9, 9, 9]
    second = turn(sched, TReq("r2", longer, "s"))
    new = second.tail_plan.saves[0].key
    assert second.matched == 2 * BS + 2  # it loaded the old tail, then superseded it
    assert new != old and old not in sched.index.blocks and old in second.tail_plan.removes
    sched.catch_up()  # the policy learns the session's keys from the registry thread
    assert sched.policy.keys_of("t", "s")[-1] == new
    # a fork lists the tail: the session's next turn keeps it
    seq2 = prompt(9, 2, extra=3)
    kept = turn(sched, TReq("r3", seq2, "s2")).tail_plan.saves[0].key
    sched.catch_up()  # s2's turn is in the registry
    assert sched.registry.copy_session("t", "s2", "fork", overwrite=False) == "ok"
    sched.catch_up()  # the engine learnt the fork (as from the API process)
    turn(sched, TReq("r4", [*seq2, 4, 4, 4, 4], "s2"))
    assert sched.index.tier_of(kept) == "ram"


def test_tail_from_disk_is_async_and_goes_before_its_session_blocks(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=4, disk_blocks=10)
    seq = prompt(10, 3, extra=3)
    tail = turn(sched, TReq("r1", seq, "s")).tail_plan.saves[0].key  # 4 slots: 3 + tail
    order = sched.policy.order(
        [(k, s.last_access) for k, s in sched.index.blocks.items()], allow_pinned=True
    )
    assert order[0] == tail
    turn(sched, TReq("r2", prompt(11, 1, extra=1), "other"))  # one new block: the tail leaves
    assert sched.index.tier_of(tail) == "disk"
    assert sched.get_num_new_matched_tokens(TReq("r3", [*seq, 3, 3], "s"), 0) == (3 * BS + 2, True)


def test_async_load_in_flight_saves_no_tail(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=2, disk_blocks=10)
    seq = prompt(12, 2, extra=1)
    turn(sched, TReq("r1", seq, "s"))
    turn(sched, TReq("r2", prompt(13, 2, extra=1), "o"))  # seq's blocks leave RAM
    req = TReq("r3", [*seq, 1, 2, 3], "s")
    n, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (2 * BS, True)
    sched.update_state_after_alloc(req, [300, 301, 302], n)
    req.num_computed_tokens = n + 2  # aborted while waiting: the load never finished
    assert not sched.request_finished(req, [300, 301, 302])


def test_restart_finds_tail_files(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=8, disk_blocks=10)
    seq = prompt(14, 2, extra=3)
    turn(sched, TReq("r1", seq, "s"))
    files = {k: 120 for k, s in sched.index.blocks.items() if s.on_disk}
    sched.shutdown()
    settings = sched.settings
    again = SessionKVScheduler(
        settings, block_size=BS, block_bytes=100, file_bytes=120, disk_files=files
    )
    assert again.get_num_new_matched_tokens(TReq("r2", [*seq, 1], "s"), 0) == (2 * BS + 2, True)
    again.shutdown()
