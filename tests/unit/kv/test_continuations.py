"""A session as a tree on the scheduler side without vLLM: every call stream keeps its tail,
rewinds and forks reuse a stored block up to the last shared token, the bound on branches."""

from __future__ import annotations

from pathlib import Path

from test_scheduler import BS, make, prompt
from test_tails import TReq, turn

from server.kv.keys import parse_tail_key
from server.kv.scheduler.continuations import Continuations, branch_blocks, shared_tokens
from server.kv.scheduler.scheduler import SessionKVScheduler


def _packed(tokens: list[int]) -> bytes:
    from array import array

    return array("I", tokens).tobytes()


def session_keys(sched: SessionKVScheduler) -> list[str]:
    """Session ``s``'s keys as the policy knows them once the registry caught up (the policy
    learns them from the registry thread's events, applied at a later step)."""
    sched.catch_up()
    return sched.policy.keys_of("t", "s")


def test_shared_tokens_counts_the_common_prefix() -> None:
    a = list(range(100))
    for m in (0, 1, 37, 63, 99):
        b = [*a[:m], 1000, *a[m + 1 :]]
        assert shared_tokens(_packed(a), _packed(b)) == m
    assert shared_tokens(_packed(a), _packed(a[:10])) == 10
    assert shared_tokens(_packed(a), _packed(a)) == 100


def test_a_nested_stream_no_longer_takes_the_sessions_tail(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=16, disk_blocks=20)
    main = prompt(1, 3, extra=3)
    turn(sched, TReq("r1", main, "s"))  # the agent's call: 3 blocks and a 2-token tail
    turn(sched, TReq("r2", prompt(2, 1, extra=2), "s"))  # a tool's own call, same thread
    tails = [k for k in session_keys(sched) if parse_tail_key(k)]
    assert len(tails) == 2  # both streams' tails are the session's
    nxt = TReq("r3", [*main, 5, 5, 5], "s")
    assert sched.get_num_new_matched_tokens(nxt, 0) == (len(main) - 1, False)


def test_without_branches_a_session_is_its_last_call(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=16, disk_blocks=20, branch_blocks=0)
    main = prompt(1, 3, extra=3)
    old_tail = turn(sched, TReq("r1", main, "s")).tail_plan.saves[0].key
    turn(sched, TReq("r2", prompt(2, 1, extra=2), "s"))
    assert old_tail not in sched.index.blocks  # superseded by the other stream's turn
    nxt = TReq("r3", [*main, 5, 5, 5], "s")
    assert sched.get_num_new_matched_tokens(nxt, 0) == (3 * BS, False)


def test_a_rewind_inside_a_full_block_reuses_it_up_to_the_last_shared_token(
    tmp_path: Path,
) -> None:
    sched = make(tmp_path, ram_blocks=16, disk_blocks=20)
    seq = prompt(3, 4, extra=1)
    turn(sched, TReq("r1", seq, "s"))
    # Back to the checkpoint after 2 blocks and 3 tokens, then a new message.
    fork = TReq("r2", [*seq[: 2 * BS + 3], 7, 7, 7, 7, 7, 7], "s")
    n, is_async = sched.get_num_new_matched_tokens(fork, 0)
    assert (n, is_async) == (2 * BS + 3, False)
    ids = [200, 201, 202, 203]
    sched.update_state_after_alloc(fork, ids, n)
    (job,) = sched.build_plan([("r2", ids, True, n)], {"r2": fork.num_tokens - n}).loads
    assert [i.block_id for i in job.items] == [200, 201, 202]
    assert job.items[-1].key == session_keys(sched)[2] and job.items[-1].partial


def test_a_fork_reuses_part_of_a_tail_and_both_branches_stay(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=16, disk_blocks=20)
    seq = prompt(4, 2, extra=4)  # tail of 3 tokens
    turn(sched, TReq("r1", seq, "s"))
    branch = [*seq[: 2 * BS + 1], 9, 9]  # its own 2-token tail
    assert turn(sched, TReq("r2", branch, "s")).matched == 2 * BS + 1
    tails = [k for k in session_keys(sched) if parse_tail_key(k)]
    assert len(tails) == 2  # the fork's tail and the first branch's
    again = TReq("r3", [*seq[: 2 * BS + 3], 1, 1], "s")  # the first branch again
    assert sched.get_num_new_matched_tokens(again, 0) == (2 * BS + 3, False)


def test_an_extended_tail_is_dropped_and_branches_are_bounded(tmp_path: Path) -> None:
    sched = make(tmp_path, ram_blocks=40, disk_blocks=40, branch_blocks=3)
    seq = prompt(5, 2, extra=3)
    first = turn(sched, TReq("r1", seq, "s")).tail_plan.saves[0].key
    turn(sched, TReq("r2", [*seq, 4, 4, 4], "s"))
    assert first not in session_keys(sched)  # this stream ran through it
    for i in range(4):  # four other streams of two blocks and a tail each
        turn(sched, TReq(f"o{i}", prompt(10 + i, 2, extra=2), "s"))
    keys = session_keys(sched)
    assert len(keys) == 3 + 3  # the last call's path, then three blocks of earlier ones


def test_branch_blocks_keeps_other_paths_in_recency_order() -> None:
    root = "00" * 32
    assert branch_blocks(["a", "b"], ["x", "a", "y"], [], BS, root, 8) == ["a", "b", "x", "y"]
    assert branch_blocks(["a"], ["x", "y", "z"], [], BS, root, 2) == ["a", "x", "y"]
    assert branch_blocks(["a"], ["x"], [], BS, root, 0) == ["a"]


def test_children_per_parent_are_bounded() -> None:
    from server.kv.scheduler.continuations import MAX_CHILDREN

    book = Continuations(BS)
    for i in range(MAX_CHILDREN + 5):
        book.learn("p", f"k{i}", [i, 1, 2])
    assert len(book) == MAX_CHILDREN and not book.knows("p", "k0")
    best = book.longest("p", [MAX_CHILDREN + 4, 1, 9], 3, lambda k: "ram")
    assert best == (f"k{MAX_CHILDREN + 4}", 2, "ram")
    assert book.longest("p", [MAX_CHILDREN + 4, 1, 2], 1, lambda k: "ram") == (
        f"k{MAX_CHILDREN + 4}",
        1,
        "ram",
    )
    assert book.longest("p", [999], 3, lambda k: "ram") is None
    book.prune(lambda k: k.endswith("9"), 0)
    assert len(book) == 2  # k9 and k19


def test_placeholder_ids_never_run_through_an_old_tail() -> None:
    """A prompt of embeddings has placeholder ids: they may equal an old tail's tokens, yet
    the turn did not run through that tail, so the session keeps it (eviction ranking)."""
    from types import SimpleNamespace

    from server.kv.keys import tail_key
    from server.kv.scheduler.tails import parent_of

    req = SimpleNamespace(all_token_ids=[7] * (BS + 3), cache_salt=None, lora_request=None,
                          mm_features=None, prompt_embeds=None, block_hashes=[])  # fmt: skip
    old_tail = tail_key(parent_of(req, 0), [7, 7, 7])
    cont = Continuations(BS)
    assert cont.session_blocks(req, ["a"], [old_tail, "x"], 8) == ["a", "x"]
    embeds = SimpleNamespace(**{**vars(req), "prompt_embeds": object()})
    assert cont.session_blocks(embeds, ["a"], [old_tail, "x"], 8) == ["a", old_tail, "x"]
    image = SimpleNamespace(**{**vars(req), "mm_features": [object()]})  # text then an image
    assert cont.session_blocks(image, ["a"], [old_tail, "x"], 8) == ["a", "x"]
