"""Using the connector from vLLM's offline ``LLM`` / ``AsyncLLM`` (benchmarks, tests).

A benchmark that compares a hit with a cache-off run must make the hit come from the
connector's tiers, not from vLLM's resident prefix cache: it resets that cache between the
two. vLLM refuses the reset while blocks are in use (``reset_prefix_cache()`` returns False and
only logs a warning), and a finished session turn keeps its blocks until the connector's worker
has copied its tail block, one engine step later. :func:`reset_prefix_cache` steps an
in-process engine until the reset succeeds and raises when it never does, so a measurement can
never silently read the resident cache instead of the tiers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["PrefixCacheBusy", "reset_prefix_cache", "reset_prefix_cache_async", "transfer_config"]


def transfer_config(extra: dict[str, Any], model: str | None = None) -> Any:
    """vLLM's ``KVTransferConfig`` selecting the session connector, with ``extra`` as its
    ``kv_connector_extra_config`` (keys: docs/configuration.md); for ``model``, the class
    that lets vLLM run it (:func:`~server.kv.layout.connector_class_for`)."""
    from vllm.config import KVTransferConfig

    from server.kv import layout

    return KVTransferConfig(**layout.transfer_config(extra, model))


class PrefixCacheBusy(RuntimeError):
    """vLLM's prefix cache could not be reset: blocks stayed in use (a request still runs?)."""


def reset_prefix_cache(llm: Any, attempts: int = 500) -> None:
    """Reset ``llm``'s (a ``vllm.LLM``) prefix cache; raise :class:`PrefixCacheBusy` if vLLM
    keeps refusing. An in-process engine core is stepped between attempts (nothing else steps
    it); one in another process steps by itself, so this waits 10 ms instead."""
    from vllm.v1.engine.core_client import InprocClient

    for _ in range(attempts):
        if llm.reset_prefix_cache():
            return
        if isinstance(llm.llm_engine.engine_core, InprocClient):
            llm.llm_engine.step()
        else:
            time.sleep(0.01)
    raise PrefixCacheBusy("vLLM's prefix cache could not be reset: blocks stay in use")


async def reset_prefix_cache_async(engine: Any, attempts: int = 500) -> None:
    """:func:`reset_prefix_cache` for an ``AsyncLLM`` (its engine core steps by itself)."""
    for _ in range(attempts):
        if await engine.reset_prefix_cache():
            return
        await asyncio.sleep(0.01)
    raise PrefixCacheBusy("vLLM's prefix cache could not be reset: blocks stay in use")
