"""A per-tenant fair gate in front of the runtime: turns go round the tenants, not by arrival.

The daemon serves every call on one event loop, and each call's work runs without yielding, so
without a gate calls are served in the order their tasks reach the loop: a tenant that keeps
many calls in flight makes every other tenant's call wait behind all of them. Each handler of a
tenant-charged RPC instead takes a *turn* here (``async with gate.turn(key, cost)``): it joins
its tenant's queue and waits; one turn is given at a time, by deficit round robin over the
tenants with waiting calls (each visit adds ``quantum`` work units to the tenant's deficit; it is
served while its next call's cost fits). A tenant's call therefore waits for at most the call
being served and about ``quantum`` units of each other tenant's work, however many calls the
others keep queued.

Every call waits at least once (the turn is handed out from a callback scheduled after the
calls already on the loop's ready queue), so calls whose tasks are ready together are ordered
by the gate, not by which task the loop ran first. asyncio only: no grpc here.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

#: The gate's price of a call's own handling (authentication, conversion, the gRPC path),
#: added to its work units: a flood of cheap or refused calls still spends its tenant's turns.
CALL_UNITS = 256
#: Work units a tenant's deficit grows by on each visit.
DEFAULT_QUANTUM = 4096


@dataclass(slots=True)
class _Tenant:
    waiting: deque[tuple[asyncio.Future[None], int]] = field(default_factory=deque)
    deficit: int = 0
    #: Whether this visit's quantum was added (a visit lasts until the next call does not fit).
    credited: bool = False


class FairGate:
    """Turns by deficit round robin across the tenants (keys) with waiting calls."""

    def __init__(self, quantum: int = DEFAULT_QUANTUM) -> None:
        if quantum < 1:
            raise ValueError("quantum must be >= 1")
        self.quantum = quantum
        self._tenants: dict[str, _Tenant] = {}
        #: Keys with waiting calls; the first is being visited.
        self._ring: deque[str] = deque()
        self._busy = False
        self._kicked = False
        #: Turns given, by key (for tests and metrics).
        self.turns: dict[str, int] = {}

    @property
    def waiting(self) -> int:
        """Calls waiting for a turn."""
        return sum(len(t.waiting) for t in self._tenants.values())

    def waiting_of(self, key: str) -> int:
        """Calls of ``key`` waiting for a turn (cancelled ones until a dispatch drops them)."""
        t = self._tenants.get(key)
        return 0 if t is None else len(t.waiting)

    @asynccontextmanager
    async def turn(self, key: str, cost: int, *, resume: bool = False
                   ) -> AsyncIterator[Callable[[int], None]]:
        """Wait for ``key``'s turn, hold it for the body, then hand it on.

        ``resume``: the next turn of a call that already had one (its work, after its
        reading): it waits at the front of its tenant's queue, so the tenant's calls keep
        their order, and other tenants' calls are served in between as for any turn.

        The body gets ``spend(units)``: work found only once the turn was taken (a request
        parsed in its turn, priced by its bytes until then), taken from the tenant's deficit
        now (it may go below zero: its next calls wait for more visits). A tenant that leaves
        the ring (no call waiting) leaves its deficit, or debt, with it, as in DRR."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        t = self._tenants.get(key)
        if t is None:
            t = self._tenants[key] = _Tenant()
            self._ring.append(key)
        if resume:
            t.waiting.appendleft((fut, max(0, cost)))
        else:
            t.waiting.append((fut, CALL_UNITS + max(0, cost)))
        self._kick(loop)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(loop)  # granted, then cancelled before it ran: hand it on
            raise  # a cancelled waiter stays queued until a dispatch drops it
        try:
            yield functools.partial(self._spend, t)
        finally:
            self._release(loop)

    @staticmethod
    def _spend(t: _Tenant, units: int) -> None:
        t.deficit -= max(0, units)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        self._busy = False
        self._kick(loop)

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._busy and not self._kicked:
            self._kicked = True
            loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._kicked = False
        ring = self._ring
        while not self._busy and ring:
            key = ring[0]
            t = self._tenants[key]
            while t.waiting and t.waiting[0][0].cancelled():
                t.waiting.popleft()
            if not t.waiting:  # nothing left: its deficit goes with it (DRR)
                ring.popleft()
                del self._tenants[key]
                continue
            fut, cost = t.waiting[0]
            if t.deficit < cost and not t.credited:
                t.deficit += self.quantum
                t.credited = True
            if t.deficit < cost:  # the visit ends; the next tenant's begins
                t.credited = False
                ring.rotate(-1)
                continue
            t.waiting.popleft()
            t.deficit -= cost
            self._busy = True
            self.turns[key] = self.turns.get(key, 0) + 1
            fut.set_result(None)
