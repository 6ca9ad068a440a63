"""Refusals for rate are answered when the budget could pay again, not at once.

A tenant over its work budget is refused with RESOURCE_EXHAUSTED and how long to wait
(``budgets.OverBudget.retry_after_ms``). A client that ignores the hint and calls again at
once gets the next refusal at once, and so on: a loop of refusals, each of which still costs
the daemon's shared event loop the call's handling (receiving its bytes, authenticating it,
its turn in the fair gate, the answer), however little work the budget lets through. A held
refusal is answered only once its hint has passed (at most ``max_ms``,
``tenants.rate_refusal_hold_ms``): a client that keeps one call in flight then makes about one
call per hint, whatever it ignores.

A hold takes nothing but a timer: the call has left its turn (the gate serves others) and
its request was refused unread where it could be (``budgets.reading_need``). At most
``per_key`` refusals of one budget key wait at once; beyond, they are answered at once, so
holds never grow with a tenant's concurrency (memory: at most ``per_key`` held requests per
key, each within ``server.max_message_bytes``). A request whose bytes alone are over
``server.max_work_per_call`` is refused unread too, its bytes charged to its sender's budget
first, and its refusal held the same way (``budgets.OverBound``). asyncio only: no grpc here.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from blockd.runtime.budgets import OverBound, OverBudget

#: What is held: a refusal for rate, or of a request whose bytes are over the per-call bound
#: (``budgets.OverBound``: charged, then held the longest, since resending it cannot succeed).
Held = OverBudget | OverBound

#: The longest a refusal is held by default, milliseconds (``tenants.rate_refusal_hold_ms``).
MAX_HOLD_MS = 250
#: Refusals of one budget key held at once.
HOLDS_PER_KEY = 8


class RefusalHolds:
    """Holds refusals for rate until their retry hint passes (``hold``)."""

    def __init__(self, max_ms: int = MAX_HOLD_MS, per_key: int = HOLDS_PER_KEY) -> None:
        if max_ms < 0 or per_key < 0:
            raise ValueError("max_ms and per_key must be >= 0")
        self.max_ms = max_ms
        self.per_key = per_key
        #: Refusals waiting now, by budget key.
        self.waiting: Counter[str] = Counter()

    async def hold(self, refusal: Held) -> Held:
        """Wait out ``refusal``'s hint (at most ``max_ms``) unless ``per_key`` refusals of its
        key already wait; the refusal to answer, its hint less the time waited."""
        key = refusal.tenant_id
        ms = min(refusal.retry_after_ms, self.max_ms)
        if ms <= 0 or self.waiting[key] >= self.per_key:
            return refusal
        self.waiting[key] += 1
        t0 = time.monotonic()
        try:
            await asyncio.sleep(ms / 1000)
        finally:
            self.waiting[key] -= 1
            if not self.waiting[key]:
                del self.waiting[key]
        return refusal.waited(int((time.monotonic() - t0) * 1000))
