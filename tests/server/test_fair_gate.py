"""The fair gate (blockd/runtime/fair_gate.py): turns go round the tenants by deficit round robin,
not by arrival. Pure asyncio, deterministic: the order of turns is checked, never a time."""

from __future__ import annotations

import asyncio

import pytest

from blockd.runtime.fair_gate import CALL_UNITS, FairGate


async def _calls(gate: FairGate, arrivals: list[tuple[str, int]]) -> list[str]:
    """Start every call at once (in arrival order); return the order their turns came."""
    served: list[str] = []

    async def call(i: int, key: str, cost: int) -> None:
        async with gate.turn(key, cost):
            served.append(f"{key}{i}")

    await asyncio.gather(*(call(i, k, c) for i, (k, c) in enumerate(arrivals)))
    return served


def test_a_call_waits_for_one_turn_of_the_flooder_not_its_whole_queue() -> None:
    gate = FairGate(quantum=4096)
    # B queues eight calls of 3000 units, then A one: A is second, not ninth.
    order = asyncio.run(_calls(gate, [("b", 3000)] * 8 + [("a", 100)]))
    assert order[:2] == ["b0", "a8"], order
    assert order[2:] == [f"b{i}" for i in range(1, 8)]  # one tenant's calls stay in order
    assert gate.turns == {"b": 8, "a": 1} and gate.waiting == 0


def test_turns_share_work_units_not_calls() -> None:
    gate = FairGate(quantum=1000)
    # A's calls cost 3 quanta (with CALL_UNITS), B's only CALL_UNITS: each visit gives B about
    # a quantum's worth of calls, and A's call is served once three visits have paid for it.
    order = asyncio.run(_calls(gate, [("a", 3000 - CALL_UNITS)] * 2 + [("b", 0)] * 12))
    assert order == ([f"b{i}" for i in range(2, 9)] + ["a0"] + [f"b{i}" for i in range(9, 14)]
                     + ["a1"]), order


def test_a_single_tenant_is_served_in_arrival_order_whatever_the_cost() -> None:
    gate = FairGate(quantum=10)
    order = asyncio.run(_calls(gate, [("a", 5000), ("a", 1), ("a", 90_000)]))
    assert order == ["a0", "a1", "a2"]


def test_an_error_in_a_turn_hands_the_gate_on() -> None:
    gate = FairGate()

    async def run() -> list[str]:
        served: list[str] = []

        async def bad() -> None:
            async with gate.turn("a", 1):
                raise ValueError("the call failed")

        async def good() -> None:
            async with gate.turn("b", 1):
                served.append("b")

        res = await asyncio.gather(bad(), good(), return_exceptions=True)
        assert isinstance(res[0], ValueError)
        return served

    assert asyncio.run(run()) == ["b"]
    assert gate.waiting == 0


def test_a_cancelled_waiter_is_skipped_and_loses_nothing_for_others() -> None:
    gate = FairGate()

    async def run() -> list[str]:
        served: list[str] = []
        hold = asyncio.Event()

        async def holder() -> None:
            async with gate.turn("a", 1):
                await hold.wait()  # holds the gate until the waiters are queued
                served.append("a")

        async def waiter(key: str) -> None:
            async with gate.turn(key, 1):
                served.append(key)

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        c = asyncio.create_task(waiter("c"))
        b = asyncio.create_task(waiter("b"))
        await asyncio.sleep(0)
        assert gate.waiting == 2
        c.cancel()
        hold.set()
        await asyncio.gather(h, b)
        with pytest.raises(asyncio.CancelledError):
            await c
        return served

    assert asyncio.run(run()) == ["a", "b"]
    assert gate.waiting == 0


def test_quantum_must_be_positive() -> None:
    with pytest.raises(ValueError):
        FairGate(quantum=0)


def test_work_spent_inside_a_turn_makes_the_tenant_wait_more_visits() -> None:
    """A call priced low at its turn (a request priced by its bytes) that then spends more (its
    parsed work) pays it from its tenant's deficit: its next call waits for the visits that
    pay the debt back, while the other tenant is served each visit."""

    async def run(extra: int) -> list[str]:
        gate = FairGate(quantum=1000)
        served: list[str] = []

        async def call(i: int, key: str) -> None:
            async with gate.turn(key, 0) as spend:  # CALL_UNITS each: 3 per visit
                served.append(f"{key}{i}")
                if key == "a" and i == 0:
                    spend(extra)

        await asyncio.gather(*(call(i, "a") for i in range(2)),
                             *(call(i, "b") for i in range(2, 14)))
        return served

    assert asyncio.run(run(0))[:5] == ["a0", "a1", "b2", "b3", "b4"]
    # a's deficit: 1000 - 256 - 2000 = -1256; two more visits (+1000 each) before a1 fits,
    # while b is served 3 calls, then 4 (its 232 units left over and a quantum).
    order = asyncio.run(run(2000))
    assert order == ["a0", "b2", "b3", "b4", "b5", "b6", "b7", "b8", "a1"] + [
        f"b{i}" for i in range(9, 14)], order


def test_a_resumed_turn_waits_at_the_front_of_its_tenants_queue() -> None:
    """A large request's work gets a second turn (``resume``): another tenant's call is served
    between its reading and its work (which costs more than what is left of the visit), and
    the tenant's own next call stays behind it."""
    gate = FairGate(quantum=4096)

    async def run() -> list[str]:
        served: list[str] = []

        async def large() -> None:
            async with gate.turn("b", 100):
                served.append("b0-read")
            async with gate.turn("b", 20_000, resume=True):
                served.append("b0-work")

        async def small(name: str, key: str) -> None:
            async with gate.turn(key, 100):
                served.append(name)

        await asyncio.gather(large(), small("b1", "b"), small("a0", "a"))
        return served

    order = asyncio.run(run())
    assert order == ["b0-read", "a0", "b0-work", "b1"], order
    assert gate.waiting == 0
