"""``usage.prompt_tokens_details.cached_tokens`` counts only tokens that came from a cache.

vLLM fixes a request's cached tokens (its local prefix-cache hit plus the connector's external
tokens) when it admits the request (``Request.prefill_stats``) and reports them with the first
output. When some of the connector's blocks then fail to load (a damaged or vanished file, an
expired Redis key), ``kv_load_failure_policy="recompute"`` truncates the request's computed
tokens at the first failed block and recomputes the rest, but the admitted count stays: a
response said 768 tokens were cached while 640 of them were recomputed.

:class:`LoadAccounting` runs on the scheduler side. It remembers which paged blocks each
request loads (``on_alloc``) and, when the worker reports blocks that failed to load
(``KVConnectorOutput.invalid_block_ids``), lowers the request's external cached tokens to the
blocks before the first failure (``on_output``): exactly the prefix vLLM keeps. vLLM's own
prompt-token metrics read the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from server.kv.groups import BlockRef


class LoadAccounting:
    """Per request: the paged block ids its external load fills, in prefix order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._loads: dict[str, tuple[Any, list[BlockRef]]] = {}

    def on_alloc(self, request: Any, block_ids: list[BlockRef], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) for a load of
        ``num_external_tokens`` tokens after the request's local prefix-cache hit."""
        stats = getattr(request, "prefill_stats", None)
        if not num_external_tokens or stats is None:
            return
        start = stats.num_local_cached_tokens // self.block_size
        count = -(-num_external_tokens // self.block_size)  # a tail block counts too
        self._loads[request.request_id] = (request, list(block_ids[start : start + count]))

    def on_output(
        self,
        invalid_block_ids: Iterable[int],
        finished: Iterable[str],
        failed: Iterable[str] = (),
    ) -> None:
        """Apply a step's failed block ids and failed loads (``failed_recving``: vLLM
        recomputes such a request whole), then forget the loads that finished."""
        for req_id in failed:
            request, _ = self._loads.get(req_id, (None, []))
            _lower_external(request, 0)
        invalid = set(invalid_block_ids)
        if invalid:
            for req_id, (request, ids) in list(self._loads.items()):
                bad = next((i for i, b in enumerate(ids) if b in invalid), None)
                if bad is None:
                    continue
                self._loads[req_id] = (request, ids[:bad])
                _lower_external(request, bad * self.block_size)
        for req_id in finished:
            self._loads.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """The request finished."""
        self._loads.pop(req_id, None)


def _lower_external(request: Any, kept: int) -> None:
    """Lower the request's external cached tokens to ``kept`` (never raise them)."""
    stats = getattr(request, "prefill_stats", None)
    if stats is not None and kept < stats.num_external_cached_tokens:
        stats.set(
            num_prompt_tokens=stats.num_prompt_tokens,
            num_local_cached_tokens=stats.num_local_cached_tokens,
            num_external_cached_tokens=kept,
        )
