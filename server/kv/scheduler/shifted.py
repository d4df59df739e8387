"""Shifted reuse, scheduler side: a prompt's next tokens found at other positions of its
session's stored blocks (history cut in front or in the middle), the CachedAttention way.

Agents trim their context (``trim_messages``, summaries, cleared tool results), so a turn's
prompt often repeats a long run of the previous turn's tokens at earlier positions. Exact
reuse stops at the first edit. A request that asks for shifted reuse (``vllm_xargs.lgkv_reuse:
"shifted"``, or the server's ``--kv-reuse shifted``) gets, after its exact prefix:

- the session's last path (its full blocks, then its tail) as token ids, from
  :class:`~server.kv.scheduler.continuations.Continuations` (blocks this process saved or
  computed; a path found only on disk or in Redis has none here, and reuses exactly);
- runs (:func:`find_runs`): from the first prompt token not matched exactly, the longest stored
  run that starts with the prompt's next ``min_run`` tokens, again and again, until a token
  found nowhere;
- paged blocks filled from those runs (:func:`plan_blocks`), each token from the stored block
  holding it, its key rotated by the position difference on the worker
  (:mod:`server.kv.worker.shifted_loads`); the last block may be filled in part (vLLM computes
  the rest of it, as after a tail). Sources in RAM are read in place; sources on disk are read
  first (the request then waits in WAITING_FOR_REMOTE_KVS, as for an exact disk hit); a
  source in neither ends the hit. The hit leaves vLLM at least one token to compute.

The KV loaded this way is approximate (each token's KV was computed with the old context
before it): such requests carry a ``cache_salt`` of their own (``lgkvs-<tenant>``, set by the
API process), so their blocks, saved like any, are found only by later shifted requests and
never by a request that did not ask for approximation.

No torch, never blocks: per request O(prompt tokens) byte comparisons over the session's own
path, independent of how much the cache holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.kv.keys import parse_tail_key
from server.kv.scheduler.continuations import Continuations, shared_tokens
from server.kv.scheduler.tails import TailHit, parent_of, prompt_token_ids

_CANDIDATES = 8
"""Occurrences of a run's first tokens compared before the longest is taken."""


@dataclass(frozen=True)
class Segment:
    """Tokens ``src ..`` of stored block ``key`` fill tokens ``dst ..`` of a paged block."""

    key: str
    src: int
    dst: int
    count: int
    delta: int
    """New position minus stored position."""


@dataclass(frozen=True)
class ShiftedHit:
    """Paged blocks ``first, first + 1, ..`` of the request filled from stored blocks (the
    last one in part when ``tokens`` is not a multiple of the block size)."""

    first: int
    blocks: tuple[tuple[Segment, ...], ...]
    tokens: int
    """Tokens the hit fills."""
    disk: bool = False
    """Some source is read from disk first (the load is asynchronous)."""


def session_path(
    continuations: Continuations, root: str, keys: list[str], block_size: int
) -> tuple[bytes, list[str]]:
    """The packed token ids of the session's last path (``keys``: its block list, path
    first, whose first block continues ``root``) and the key of each block, as far as the
    tokens are known."""
    tokens: list[bytes] = []
    blocks: list[str] = []
    parent = root
    for key in keys:
        stored = continuations.tokens_of(parent, key)
        if stored is None:
            break
        tokens.append(stored)
        blocks.append(key)
        if parse_tail_key(key) is not None or len(stored) != 4 * block_size:
            break  # a tail ends the path
        parent = key
    return b"".join(tokens), blocks


def _occurrences(stored: bytes, pattern: bytes) -> list[int]:
    """Token positions where ``pattern`` (packed ids) occurs in ``stored``, at most
    :data:`_CANDIDATES`."""
    found: list[int] = []
    at = stored.find(pattern)
    while at != -1 and len(found) < _CANDIDATES:
        if at % 4 == 0:
            found.append(at // 4)
        at = stored.find(pattern, at + 1)
    return found


def find_runs(
    stored: bytes, prompt: bytes, start: int, end: int, min_run: int
) -> list[tuple[int, int, int]]:
    """``(prompt position, stored position, count)`` runs that cover the prompt's tokens from
    ``start`` on without a gap, each the longest stored run starting with the prompt's next
    ``min_run`` tokens; they stop at ``end`` or where no stored run starts."""
    runs: list[tuple[int, int, int]] = []
    j = start
    while end - j >= min_run:
        want = prompt[4 * j : 4 * end]
        best_at, best = -1, 0
        for at in _occurrences(stored, want[: 4 * min_run]):
            m = shared_tokens(stored[4 * at :], want)
            if m > best:
                best_at, best = at, m
        if best < min_run:
            break
        runs.append((j, best_at, best))
        j += best
    return runs


def plan_blocks(
    runs: list[tuple[int, int, int]],
    blocks: list[str],
    block_size: int,
    usable: Callable[[str], bool],
    head: Segment | None = None,
) -> tuple[tuple[Segment, ...], ...]:
    """Paged blocks from the runs: per block its segments, split where a run or a stored block
    ends; the last block holds what the runs cover of it. The first run starts on a block
    boundary, or ``head.count`` tokens past one when ``head`` (the block's first tokens, read
    in place: the exact match's last block in part) fills them. Stops before the first block
    with a source ``usable(key)`` denies."""
    if not runs:
        return ()
    start = runs[0][0] - (head.count if head is not None else 0)
    covered = runs[-1][0] + runs[-1][2] - start
    out: list[tuple[Segment, ...]] = []
    for b in range(-(-covered // block_size)):
        lo, hi = start + b * block_size, start + (b + 1) * block_size
        segments: list[Segment] = [head] if b == 0 and head is not None else []
        for dst, src, count in runs:
            a, z = max(lo, dst), min(hi, dst + count)
            while a < z:
                s = src + (a - dst)
                block = s // block_size
                n = min(z - a, (block + 1) * block_size - s)
                if block >= len(blocks) or not usable(blocks[block]):
                    return tuple(out)
                segments.append(Segment(blocks[block], s % block_size, a - lo, n, a - s))
                a += n
        out.append(tuple(segments))
    return tuple(out)


def find_shifted(
    request: Any,
    continuations: Continuations,
    session_keys: list[str],
    first: int,
    block_size: int,
    min_run: int,
    tier_of: Callable[[str], str | None],
    part: TailHit | None = None,
) -> ShiftedHit | None:
    """The request's shifted hit from its paged block ``first`` on (its first ``first``
    blocks are computed or loaded exactly; ``session_keys``: its session's block list;
    ``tier_of``: where a block is, "ram" and "disk" serve), or None.

    ``part``: the exact match's last block in part (a tail, or a stored block shared up to a
    token), for block ``first``: the runs then start where it ends, and the hit's first block
    reads its tokens in place. A seam a few tokens into a block (fewer than ``min_run``: with
    16-token blocks, nearly every seam) is found so, and so are tokens recomputed after a seam
    by an earlier request (its tail)."""
    token_ids = prompt_token_ids(request)
    if token_ids is None or not session_keys:
        return None
    stored, blocks = session_path(continuations, parent_of(request, 0), session_keys, block_size)
    if not stored:
        return None
    usable = ("ram", "disk")
    head = None
    if part is not None and part.index == first and part.tier in usable and part.tokens:
        head = Segment(part.key, 0, 0, part.tokens, 0)
    lead = head.count if head is not None else 0
    start = first * block_size + lead
    end = request.num_tokens - 1  # vLLM computes at least one token
    if end - start < min_run:
        return None
    prompt = Continuations.packed(token_ids[:end])
    runs = find_runs(stored, prompt, start, end, min_run)
    planned = plan_blocks(runs, blocks, block_size, lambda key: tier_of(key) in usable, head)
    tokens = sum(s.count for block in planned for s in block)
    if tokens - lead < min_run:
        return None
    disk = any(tier_of(s.key) != "ram" for block in planned for s in block)
    return ShiftedHit(first, planned, tokens, disk)


def tail_or_shifted(
    tail: TailHit | None,
    partial: TailHit | None,
    shift: Callable[[TailHit | None], ShiftedHit | None] | None,
    block_size: int,
) -> tuple[TailHit | None, ShiftedHit | None]:
    """The lookup's last step, after its whole blocks: a saved ``tail``, a stored block
    shared up to a token (``partial``), or a shifted hit (``shift``, given the better of the
    two to lead its first block), whichever fills the most. A partial block outside RAM that
    spares fewer than an eighth of a block is not worth a read on its own; it may still lead
    a shifted hit (a seam a few tokens into a block the session left on disk)."""
    best = tail
    if partial is not None and (tail is None or partial.tokens > tail.tokens):
        best = partial
    shifted = shift(best) if shift is not None else None
    if shifted is not None and shifted.tokens > (best.tokens if best else 0):
        return None, shifted
    small = partial is not None and partial.tier != "ram" and partial.tokens < block_size // 8
    return (tail if best is partial and small else best), None


def tokens_read(request: Any, moved: list[int], exact_tokens: int, block_size: int) -> int:
    """Tokens a request read from other positions: ``moved`` per shifted block its load
    planned after ``exact_tokens`` read in place, cut where vLLM lowered its external cached
    tokens (a block that failed to load, and every block after it, was recomputed)."""
    stats = getattr(request, "prefill_stats", None)
    external = getattr(stats, "num_external_cached_tokens", None)
    loaded = len(moved) if external is None else -(-max(0, external - exact_tokens) // block_size)
    return sum(moved[:loaded])
