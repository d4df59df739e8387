"""Partial tail blocks: the partly filled last block of a finished turn, saved and reused.

vLLM reuses whole blocks only, so without tails every turn recomputes the end of the previous
turn's prompt and answer (up to ``block_size - 1`` tokens). When a session's request finishes
with ``n`` computed tokens past its last full block, :class:`TailBook` queues a save of that
paged block (vLLM keeps the request's blocks until the worker copied it: ``request_finished``
answers "delay the free" and the worker reports the request in ``finished_sending``). The tail
is keyed by the last full block's key plus the exact ``n`` token ids (:func:`tail_key`), so a
later prompt can use it only when it extends those tokens token for token; vLLM then counts
``m <= n`` of its tokens as computed and computes from there (the worker copies the whole
block: see :mod:`server.kv.worker.worker` for why the slots past ``m`` are harmless).

Contracts:
- The scheduler side alone (no torch, never blocks). A tail becomes visible to lookups only
  once the plan carrying its save is built (:meth:`TailBook.take_pending`), so a lookup never
  plans a load of a tail whose copy has not been queued to the worker yet.
- With a Redis tier a tail is written there too, like any block, and other replicas use it: they
  learn a session's tails from its block list (the registry's changes), and a lookup that
  reaches Redis asks for the tails continuing its blocks in the same round trip.
- A tail costs one block slot in RAM and one block file on disk, like any block; it belongs to
  its session's block list (delete, expiry, copy and prefetch treat it as a block), is ranked
  before the session's full blocks for eviction (:mod:`server.kv.scheduler.policy`), and is
  dropped when the session's next turn no longer lists it and no other session references it.
- A match leaves at least one prompt token to compute (vLLM's rule): a tail that would cover
  the whole prompt loads one token less.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.kv.groups import BlockRef, saveable
from server.kv.keys import block_key, parse_tail_key, tail_key, tail_root
from server.kv.scheduler.index import BlockIndex
from server.kv.scheduler.policy import EvictionPolicy


@dataclass(frozen=True)
class TailHit:
    """A tail a lookup found for block ``index``: its first ``tokens`` tokens count as
    computed (the worker loads the block whole)."""

    key: str
    index: int
    """Index of the request's block the tail fills (its number of full blocks before it)."""
    tokens: int
    tier: str


@dataclass(frozen=True)
class PendingTail:
    """A finished request's tail waiting for the next plan: copy paged ``block_id``."""

    req_id: str
    block_id: BlockRef
    key: str


def prompt_token_ids(request: Any) -> Sequence[int] | None:
    """The request's token ids, or None where they do not name its inputs: multimodal inputs
    (placeholder ids) and prompt embeddings (``--enable-prompt-embeds``: the ids are
    placeholders). vLLM's block hashes cover both, so whole blocks stay reusable; a tail or a
    block shared up to a token inside it is named by token ids, so such a request has none."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    return getattr(request, "all_token_ids", None)


def parent_of(request: Any, full_blocks: int) -> str:
    """The parent key of the tail after the request's first ``full_blocks`` blocks."""
    if full_blocks:
        return block_key(request.block_hashes[full_blocks - 1])
    lora = getattr(request, "lora_request", None)
    return tail_root(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None))


def keep_alive(children: dict[str, dict[str, Any]], alive: Callable[[str], bool]) -> int:
    """Drop the children (parent key -> {key: value}) ``alive`` says no tier holds, and the
    parents left without any; return how many children remain."""
    left = 0
    for parent in list(children):
        kept = {k: v for k, v in children[parent].items() if alive(k)}
        if kept:
            children[parent] = kept
            left += len(kept)
        else:
            del children[parent]
    return left


class TailBook:
    """Which tails exist (by parent key) and which wait to be saved."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_parent: dict[str, dict[str, int]] = {}
        """Parent key -> {tail key: tokens}; may name tails evicted since (lookups check)."""
        self._pending: list[PendingTail] = []
        self._learnt = 0

    def learn(self, *keys: str) -> None:
        """Note tails that are (or are about to be) in a tier: a save just planned, or files
        found at start. Keys of full blocks are ignored."""
        for key in keys:
            parsed = parse_tail_key(key)
            if parsed is not None:
                self._by_parent.setdefault(parsed[0], {})[key] = parsed[1]
                self._learnt += 1

    def prune(self, alive: Callable[[str], bool], limit: int) -> None:
        """Forget tails no tier holds once more than ``limit`` were learnt since the last
        prune (bounds the memory of tails evicted or dropped meanwhile)."""
        if self._learnt > limit:
            self._learnt = keep_alive(self._by_parent, alive)

    def after(self, parents: list[str]) -> list[str]:
        """The known tails that continue any of the blocks ``parents`` (longest first per
        parent): the candidates a Redis lookup checks together with those blocks."""
        return [
            key
            for parent in parents
            for key, _ in sorted(self._by_parent.get(parent, {}).items(), key=lambda kv: -kv[1])
        ]

    def find(
        self, request: Any, full_blocks: int, tier_of: Callable[[str], str | None]
    ) -> TailHit | None:
        """The tail that continues the request's first ``full_blocks`` blocks, if the prompt
        extends its tokens exactly and a tier holds it; at most ``num_tokens - 1`` tokens are
        counted in all (vLLM computes at least one)."""
        token_ids = prompt_token_ids(request)
        if token_ids is None:
            return None
        parent = parent_of(request, full_blocks)
        tails = self._by_parent.get(parent)
        if not tails:
            return None
        start = full_blocks * self.block_size
        room = request.num_tokens - 1 - start
        for key, n in sorted(tails.items(), key=lambda kv: -kv[1]):
            if start + n > request.num_tokens or min(n, room) <= 0:
                continue
            tier = tier_of(key)
            if tier is None:
                continue
            if tail_key(parent, list(token_ids[start : start + n])) == key:
                return TailHit(key, full_blocks, min(n, room), tier)
        return None

    def on_finished(
        self, request: Any, block_ids: list[BlockRef] | None, computed: int, ram_on: bool
    ) -> str | None:
        """Queue the save of a finished request's tail (``computed`` tokens have KV); return
        its key, or None when there is none to save (no partial block, no RAM tier, no token
        ids or block ids, inputs they do not name: :func:`prompt_token_ids`)."""
        token_ids = prompt_token_ids(request)
        if not ram_on or not block_ids or token_ids is None:
            return None
        full = computed // self.block_size
        n = computed - full * self.block_size
        if n <= 0 or full >= len(block_ids) or full > len(request.block_hashes):
            return None
        if not saveable(block_ids[full]):
            return None  # a group holds nothing there
        start = full * self.block_size
        key = tail_key(parent_of(request, full), list(token_ids[start : start + n]))
        self._pending.append(PendingTail(request.request_id, block_ids[full], key))
        return key

    def has_pending(self) -> bool:
        """True while finished requests wait for their tail's save to be planned."""
        return bool(self._pending)

    def plan(
        self,
        index: BlockIndex,
        save: Callable[[list[tuple[BlockRef, str]]], None],
        release: list[str],
    ) -> None:
        """Plan the pending tails' saves with ``save`` ((paged block id, key) pairs; it
        allocates slots and disk space) and append every pending request to ``release``
        (the worker frees their blocks once this step's copies are done). From here on the
        tails are visible to lookups."""
        pending, self._pending = self._pending, []
        wanted: list[tuple[BlockRef, str]] = []
        for tail in pending:
            if tail.key in index.blocks:
                index.touch(tail.key)  # the same tail again (a repeated turn)
            elif all(tail.key != k for _, k in wanted):
                wanted.append((tail.block_id, tail.key))
            self.learn(tail.key)
        if wanted:
            save(wanted)
        release.extend(t.req_id for t in pending)
        self.prune(lambda k: k in index.blocks, 2 * len(index.blocks) + 1024)

    @staticmethod
    def supersede(
        old: list[str], keys: list[str], policy: EvictionPolicy, index: BlockIndex
    ) -> None:
        """A session's turn replaced its block list ``old`` by ``keys`` (already noted in
        ``policy``): drop the tails it no longer lists that no other session lists."""
        for key in old:
            if key not in keys and parse_tail_key(key) and not policy.is_referenced(key):
                index.drop(key, remove_file=True)
