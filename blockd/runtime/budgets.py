"""Per-tenant work budgets: one tenant's flood cannot take the daemon's loop from the others.

The daemon serves every tenant from one single-threaded event loop, so the loop's time is the
resource a tenant can exhaust for all of them. Each call is priced in *work units* before it is
applied (``blockd.runtime.step.tally``: about one unit per token id hashed or stored and a
fixed price per operation, so a unit is roughly a tenth of a microsecond of loop time), and
each tenant draws them from its own token bucket: ``tenants.work_units_per_second`` refill it,
up to ``tenants.work_units_burst``. A call the bucket cannot pay for is refused before anything
is applied, with RESOURCE_EXHAUSTED (reason ``rate``) and how long to wait
(``OverBudget.retry_after_ms``, which the server also sends as the ``retry-after-ms`` trailing
metadata); the tenant's other calls and every other tenant's are unaffected.

A call priced above the burst needs a full bucket (it is charged the burst): the bound of one
call's work is ``server.max_work_per_call``, checked first. Heartbeats and Detach are never
charged: they keep leases alive and give resources back.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from blockd.core.errors import ResourceExhausted

#: The reason label of a refusal for rate.
REASON = "rate"


class OverBudget(ResourceExhausted):
    """The tenant spent its work budget: retry after ``retry_after_ms``."""

    def __init__(self, tenant_id: str, cost: int, rate: float, burst: float,
                 retry_after_ms: int) -> None:
        super().__init__(
            f"rate: tenant {tenant_id!r} is over its work budget (tenants.work_units_per_second"
            f"={rate:g}, tenants.work_units_burst={burst:g}; this call costs {cost} units): "
            f"retry after {retry_after_ms} ms", reason=REASON)
        self.tenant_id = tenant_id
        self.retry_after_ms = retry_after_ms


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float


class WorkBudgets:
    """One token bucket of work units per tenant (created on its first call)."""

    def __init__(self, rate: float, burst: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: Units per second each tenant gets; 0 disables budgets.
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        #: Calls refused for rate, by tenant (for metrics).
        self.refused: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def charge(self, tenant_id: str, units: int) -> None:
        """Take ``units`` from the tenant's bucket, or raise ``OverBudget`` taking nothing."""
        if not self.enabled:
            return
        now = self._clock()
        b = self._buckets.get(tenant_id)
        if b is None:
            b = self._buckets[tenant_id] = _Bucket(self.burst, now)
        else:
            b.level = min(self.burst, b.level + (now - b.at) * self.rate)
            b.at = now
        cost = min(float(units), self.burst)
        if b.level < cost:
            self.refused[tenant_id] += 1
            wait_ms = max(1, int((cost - b.level) / self.rate * 1000) + 1)
            raise OverBudget(tenant_id, units, self.rate, self.burst, wait_ms)
        b.level -= cost

    def forget(self, keep: set[str]) -> None:
        """Drop the buckets of tenants no longer configured (a tenants reload)."""
        for t in [t for t in self._buckets if t not in keep]:
            del self._buckets[t]
