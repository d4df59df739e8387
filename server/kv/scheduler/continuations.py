"""A session as a tree: every continuation it has seen, and reuse up to the last shared token.

Agents make more than one stream of calls per thread: a tool that calls the model itself, a
summarizer, parallel branches, rewinds and forks from an earlier checkpoint. Two things keep
each stream's context:

- **The session lists every branch** (:func:`branch_blocks`). A finished turn's block list is
  its own path (full blocks, then its tail) followed by the blocks of the session's earlier
  paths that it does not extend, most recent first, up to ``limit`` more blocks. An earlier
  tail that this turn's tokens extend is dropped (the turn's own path supersedes it); a tail of
  another branch stays. So a nested call no longer takes the thread's tail, eviction ranks
  every branch as the session's, and delete, expiry, copy and prefetch see them all. With
  ``limit`` 0 a session is its last call's path only.
- **A lookup reuses a stored block up to the last shared token** (:class:`Continuations`). A
  block (full or tail) is stored under its parent's key with its token ids. When a prompt
  leaves the stored blocks inside a block (a rewind to mid-block, a fork, another branch that
  shares only part of the block), the child of the last matched block whose tokens share the
  longest prefix with the prompt's next tokens is loaded whole and its first ``m`` tokens
  count as computed, as a tail's do (the worker's copy of the slots past ``m`` is never read:
  vLLM computes them). The tree is keyed by content, so whichever stream or session of the same
  tenant (the root key is salted per tenant and adapter) wrote a block, any prompt extending
  it finds it.

Contracts (the scheduler side: no torch, never blocks):
- Token ids are known for blocks this process saved or computed, and for block files found at
  start that keep them in their header page (:mod:`server.kv.scheduler.saves` writes them);
  blocks in Redis from another replica are reused whole only (a tail by its exact tokens)
  until this process computes them.
- Per lookup: one parent's children, at most :data:`MAX_CHILDREN` (most recent kept), each
  compared by a binary search over byte slices: O(children x log block_size), independent of
  how much the cache holds. Memory: about 1 KB per stored block of 128 tokens (975 bytes
  measured with ``tracemalloc``: the packed ids, the keys, the dict entries; the child to
  parent map adds one dict entry), at most about
  twice the blocks the index holds (pruned like tails); next to the block itself (11.8 MB for
  SmolLM2 in float32) it is noise.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from server.kv.keys import parse_tail_key, tail_key
from server.kv.scheduler.tails import TailHit, keep_alive, parent_of, prompt_token_ids

MAX_CHILDREN = 16
"""Children remembered per parent block (the most recently learnt)."""


def _packed(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def shared_tokens(stored: bytes, want: bytes) -> int:
    """How many leading tokens (4-byte ids) ``stored`` and ``want`` share."""
    n = min(len(stored), len(want)) // 4
    if stored[: 4 * n] == want[: 4 * n]:
        return n
    lo, hi = 0, n  # stored[:4*lo] == want[:4*lo]; they differ before 4*hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if stored[4 * lo : 4 * mid] == want[4 * lo : 4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Continuations:
    """Parent key -> {child key: its token ids}, for the blocks this process wrote or read."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._children: dict[str, dict[str, bytes]] = {}
        self._parent: dict[str, str] = {}
        """Child key -> parent key (a block's key names its parent: one each)."""
        self._learnt = 0

    def __len__(self) -> int:
        return sum(len(c) for c in self._children.values())

    def learn(self, parent: str, key: str, tokens: Sequence[int]) -> None:
        """Note that block ``key`` (full or tail) continues ``parent`` with ``tokens``."""
        if not self.knows(parent, key):  # pack only what is new
            self.learn_packed(parent, key, _packed(tokens))

    def learn_packed(self, parent: str, key: str, tokens: bytes) -> None:
        """:meth:`learn` with the token ids packed (as a block file's header keeps them)."""
        children = self._children.setdefault(parent, {})
        if key in children:
            return
        children[key] = tokens
        self._parent[key] = parent
        self._learnt += 1
        if len(children) > MAX_CHILDREN:
            oldest = next(iter(children))  # the oldest learnt
            del children[oldest]
            self._parent.pop(oldest, None)

    def learn_blocks(self, request: Any, first: int, keys: list[str]) -> None:
        """Note the request's full blocks from block ``first`` on, whose keys are ``keys``
        (computed or loaded)."""
        token_ids = prompt_token_ids(request)
        if token_ids is None or not keys:
            return
        bs = self.block_size
        parent = parent_of(request, first)
        for i, key in enumerate(keys, first):
            if not self.knows(parent, key):
                self.learn(parent, key, list(token_ids[i * bs : (i + 1) * bs]))
            parent = key

    def learn_tail(self, request: Any, key: str, full_blocks: int) -> None:
        """Note the request's tail ``key`` after its first ``full_blocks`` blocks (just
        queued for its save)."""
        token_ids, parsed = prompt_token_ids(request), parse_tail_key(key)
        if token_ids is None or parsed is None:
            return
        parent, n = parsed
        start = full_blocks * self.block_size
        self.learn(parent, key, list(token_ids[start : start + n]))

    def find(
        self, request: Any, full_blocks: int, tier_of: Callable[[str], str | None]
    ) -> TailHit | None:
        """The stored block that continues the request's first ``full_blocks`` blocks with
        the most of its next tokens (fewer than a block; at most ``num_tokens - 1`` counted in
        all). Whether it is worth a read is the lookup's call
        (:func:`~server.kv.scheduler.shifted.tail_or_shifted`)."""
        token_ids = prompt_token_ids(request)
        if token_ids is None:
            return None
        bs = self.block_size
        start = full_blocks * bs
        room = min(request.num_tokens - 1 - start, bs - 1)
        found = self.longest(
            parent_of(request, full_blocks), list(token_ids[start : start + bs]), room, tier_of
        )
        return None if found is None else TailHit(found[0], full_blocks, found[1], found[2])

    def session_blocks(
        self, request: Any, path: list[str], old: list[str], limit: int
    ) -> list[str]:
        """The session's block list after the request's turn: its ``path``, then the other
        continuations of ``old`` (:func:`branch_blocks`, at most ``limit`` blocks)."""
        if not old:
            return path
        # a prompt of embeddings has placeholder ids that name nothing: it never runs through an
        # old tail, so every other branch is kept; a multimodal prompt's placeholders are ids no
        # text holds, so its ids compare as they are (saved tails are text only)
        embeds = getattr(request, "prompt_embeds", None) is not None
        token_ids = () if embeds else (getattr(request, "all_token_ids", None) or ())
        root = parent_of(request, 0)
        return branch_blocks(path, old, token_ids, self.block_size, root, limit)

    @staticmethod
    def packed(tokens: Sequence[int]) -> bytes:
        """Token ids as this class stores them (4 bytes each)."""
        return _packed(tokens)

    def tokens_of(self, parent: str, key: str) -> bytes | None:
        """The packed token ids of block ``key`` under ``parent``, if remembered."""
        return self._children.get(parent, {}).get(key)

    def stored(self, key: str) -> tuple[str, bytes] | None:
        """(parent key, packed token ids) of block ``key``, if remembered."""
        parent = self._parent.get(key)
        tokens = None if parent is None else self.tokens_of(parent, key)
        return None if parent is None or tokens is None else (parent, tokens)

    def knows(self, parent: str, key: str) -> bool:
        """True if ``key`` is remembered as a child of ``parent``."""
        return key in self._children.get(parent, ())

    def longest(
        self,
        parent: str,
        tokens: Sequence[int],
        room: int,
        tier_of: Callable[[str], str | None],
    ) -> tuple[str, int, str] | None:
        """(key, tokens, tier) of the child of ``parent`` that a tier holds and whose tokens
        share the longest prefix with ``tokens`` (at most ``room`` counted); None if none
        shares a token."""
        children = self._children.get(parent)
        if not children or room <= 0:
            return None
        want = _packed(tokens)
        best: tuple[str, int, str] | None = None
        for key, stored in children.items():
            m = min(shared_tokens(stored, want), room)
            if m <= (best[1] if best else 0):
                continue
            tier = tier_of(key)
            if tier is not None:
                best = (key, m, tier)
        return best

    def prune(self, alive: Callable[[str], bool], limit: int) -> None:
        """Forget blocks no tier holds once more than ``limit`` were learnt since the last
        prune (bounds the memory of blocks evicted or dropped meanwhile)."""
        if self._learnt > limit:
            self._learnt = keep_alive(self._children, alive)
            self._parent = {k: p for p, kids in self._children.items() for k in kids}


def branch_blocks(
    path: list[str],
    old: list[str],
    token_ids: Sequence[int],
    block_size: int,
    root: str,
    limit: int,
) -> list[str]:
    """A session's block list after a turn: the turn's ``path`` (its full blocks, then its
    tail), then the blocks of ``old`` (the session's list before) that the path neither holds
    nor extends, in their order, at most ``limit`` of them. ``root`` is the parent of a tail in
    the first block (the request's salted root); ``token_ids`` the turn's tokens."""
    if limit <= 0 or not old:
        return path
    on_path = set(path)
    position = {key: i for i, key in enumerate(path)}
    out = list(path)
    for key in old:
        if len(out) - len(path) >= limit:
            break
        if key in on_path:
            continue
        parsed = parse_tail_key(key)
        if parsed is not None and _extended(parsed, key, position, token_ids, block_size, root):
            continue
        out.append(key)
        on_path.add(key)
    return out


def _extended(
    parsed: tuple[str, int],
    key: str,
    position: dict[str, int],
    token_ids: Sequence[int],
    block_size: int,
    root: str,
) -> bool:
    """True if the turn's tokens run through old tail ``key`` (its parent lies on the turn's
    path and the turn's next tokens are the tail's)."""
    parent, n = parsed
    if parent == root:
        start = 0
    elif parent in position:
        start = (position[parent] + 1) * block_size
    else:
        return False
    if start + n > len(token_ids):
        return False
    return tail_key(parent, list(token_ids[start : start + n])) == key
