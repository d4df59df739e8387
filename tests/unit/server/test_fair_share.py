"""GenerationGate: each tenant's share of the batch, its queue in order, 429 past it."""

from __future__ import annotations

import asyncio

import pytest

from server.api.fair_share import GenerationGate
from server.api.protocol import APIError


async def test_a_tenant_past_its_share_waits_in_order_and_others_do_not() -> None:
    gate = GenerationGate(2, max_waiting=3)
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("a0", "a1", "a2", "a3", "b0")}

    async def generate(tenant: str, name: str) -> None:
        async with gate.slot(tenant):
            order.append(name)
            await release[name].wait()

    tasks = {n: asyncio.create_task(generate("a", n)) for n in ("a0", "a1", "a2", "a3")}
    await asyncio.sleep(0)
    assert order == ["a0", "a1"] and (gate.running("a"), gate.waiting("a")) == (2, 2)
    tasks["b0"] = asyncio.create_task(generate("b", "b0"))
    await asyncio.sleep(0)
    assert order[-1] == "b0"  # another key never waits behind a's queue
    release["a1"].set()
    await asyncio.sleep(0.01)
    assert order[-1] == "a2" and gate.running("a") == 2  # the freed slot passed on, in order
    for name in ("a0", "a2", "a3", "b0"):
        release[name].set()
    await asyncio.gather(*tasks.values())
    assert order == ["a0", "a1", "b0", "a2", "a3"]
    assert (gate.running("a"), gate.waiting("a"), gate.running("b")) == (0, 0, 0)


async def test_past_the_queue_bound_429_and_a_cancelled_waiter_leaves_no_trace() -> None:
    gate = GenerationGate(1, max_waiting=1)
    held = asyncio.Event()

    async def hold() -> None:
        async with gate.slot("a"):
            await held.wait()

    first = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold())
    await asyncio.sleep(0)
    with pytest.raises(APIError) as info:
        async with gate.slot("a"):
            pass
    assert info.value.status == 429 and "--tenant-generation-share" in info.value.message
    waiter.cancel()  # the client went away while waiting
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.waiting("a") == 0 and gate.running("a") == 1
    held.set()
    await first
    assert gate.running("a") == 0
    async with gate.slot("a"):  # the slot is free again
        assert gate.running("a") == 1
