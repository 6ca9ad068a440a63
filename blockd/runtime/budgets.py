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

A tenant's own ``work_units_per_second`` / ``work_units_burst`` in the tenants file replace the
daemon-wide ones for it (``set_overrides``, at start and on every reload). A call acting for no
tenant of its caller (an admin's listing) is charged to the credential's own bucket
(``charge_key``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockd.core.errors import ResourceExhausted

if TYPE_CHECKING:
    from blockd.runtime.tenants_file import Principal

#: The reason label of a refusal for rate.
REASON = "rate"


class OverBudget(ResourceExhausted):
    """The tenant spent its work budget: retry after ``retry_after_ms``."""

    def __init__(self, tenant_id: str, cost: int, rate: float, burst: float,
                 retry_after_ms: int, need: int = 0) -> None:
        price = f"needs {need}" if need > cost else f"costs {cost}"
        super().__init__(
            f"rate: tenant {tenant_id!r} is over its work budget (tenants.work_units_per_second"
            f"={rate:g}, tenants.work_units_burst={burst:g}; this call {price} units): "
            f"retry after {retry_after_ms} ms", reason=REASON)
        self.tenant_id = tenant_id
        self.retry_after_ms = retry_after_ms
        self._args = (tenant_id, cost, rate, burst, need)

    def waited(self, ms: int) -> OverBudget:
        """The same refusal answered ``ms`` later: its hint less the time waited."""
        tenant_id, cost, rate, burst, need = self._args
        return OverBudget(tenant_id, cost, rate, burst, max(0, self.retry_after_ms - ms), need)

class OverBound(ResourceExhausted):
    """A Step or Lookup whose bytes alone cost more than ``server.max_work_per_call``:
    refused unread, its bytes charged to the budget of its sender (``key``) first, and held
    like a refusal for rate (``blockd.runtime.refusal_holds``), the whole hold: resending it
    cannot succeed, so a client that does gets one refusal per hold, each paid for."""

    def __init__(self, key: str, refusal: ResourceExhausted) -> None:
        super().__init__(f"{refusal.message}; its bytes were charged to the work budget of "
                         f"{key!r}", reason=refusal.reason, field=refusal.field)
        self.tenant_id = key
        #: No hint to follow: held the longest (``tenants.rate_refusal_hold_ms``).
        self.retry_after_ms = 1 << 30

    def waited(self, ms: int) -> OverBound:
        """The same refusal, answered after the hold."""
        return self


#: A request's bytes are work too: the server parses a Step or Lookup in its tenant's turn and
#: first charges ``parse_units`` of its size (about 3 ns of protobuf parsing per byte, a unit
#: being ~0.1 us: one unit per 32 bytes), so a tenant over its budget is refused before its
#: request is parsed, and bytes no operation prices (unknown fields) are paid for.
PARSE_BYTES_PER_UNIT = 32


def parse_units(nbytes: int) -> int:
    """The work units of parsing a request of ``nbytes`` bytes."""
    return nbytes // PARSE_BYTES_PER_UNIT


#: A Lookup's packed token ids are not parsed but counted from the bytes with numpy
#: (``blockd.runtime.packed``: ~0.1 ns a byte), and only those a hit could cover decoded (priced
#: per token, like their hashing): one unit per 1024 bytes counted.
SCAN_BYTES_PER_UNIT = 1024


def scan_units(nbytes: int) -> int:
    """The work units of counting ``nbytes`` bytes of packed token ids."""
    return nbytes // SCAN_BYTES_PER_UNIT


def reading_need(units: int, id_bytes: int, most: int) -> int:
    """What a tenant's bucket must hold before a request whose reading costs ``units`` is
    read: those units and one per byte that can hold a token id (``id_bytes``; a varint is at
    least one byte), up to ``most``, the most work the request can then be charged. A request
    its tenant could not pay for once read is refused unread: a flood of requests over the
    budget costs no parsing (a refused Step used to be parsed, ~1 ms per 257 KB, before its
    work was found over the budget)."""
    return units + min(id_bytes, most)


#: A Step's journal record is work too, charged after it is written (``WorkBudgets.debit``):
#: its write, and its share of the compactions it brings on (a snapshot rewrites the whole
#: state each time the journal has grown by about a snapshot's size): one unit per 8 bytes.
JOURNAL_BYTES_PER_UNIT = 8


def journal_units(nbytes: int) -> int:
    """The work units of ``nbytes`` journalled."""
    return nbytes // JOURNAL_BYTES_PER_UNIT


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
        #: Tenants' own (rate, burst), from the tenants file; None keeps the daemon-wide one.
        self._overrides: dict[str, tuple[float | None, float | None]] = {}
        #: Calls refused for rate, by tenant (for metrics).
        self.refused: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a budget (the daemon-wide one, or a tenant's own)."""
        return self.rate > 0 or any(r for r, _ in self._overrides.values())

    def limits(self, tenant_id: str) -> tuple[float, float]:
        """The (rate, burst) a tenant's bucket runs on: its own, else the daemon-wide."""
        rate, burst = self._overrides.get(tenant_id, (None, None))
        return (self.rate if rate is None else rate, self.burst if burst is None else burst)

    def set_overrides(self, overrides: Mapping[str, tuple[float | None, float | None]]
                      ) -> None:
        """Tenants' own budgets (a load or reload of the tenants file); a bucket keeps its
        level, cut to its new burst."""
        self._overrides = dict(overrides)
        for t, b in self._buckets.items():
            b.level = min(b.level, self.limits(t)[1])

    def charge(self, tenant_id: str, units: int, need: int = 0) -> None:
        """Take ``units`` from the tenant's bucket, or raise ``OverBudget`` taking nothing.

        ``need``: what the bucket must hold for the call to go on, when that is more than
        ``units`` (a request's bytes are paid for before it is parsed, but it goes on only if
        the bucket could also pay the most work its bytes can carry: ``reading_need``)."""
        rate, burst = self.limits(tenant_id) if self._overrides else (self.rate, self.burst)
        if rate <= 0:
            return
        now = self._clock()
        b = self._buckets.get(tenant_id)
        if b is None:
            b = self._buckets[tenant_id] = _Bucket(burst, now)
        else:
            b.level = min(burst, b.level + (now - b.at) * rate)
            b.at = now
        cost = min(float(units), burst)
        required = min(float(max(units, need)), burst)
        if b.level < required:
            self.refused[tenant_id] += 1
            wait_ms = max(1, int((required - b.level) / rate * 1000) + 1)
            raise OverBudget(tenant_id, units, rate, burst, wait_ms, need)
        b.level -= cost

    def debit(self, tenant_id: str, units: int) -> None:
        """Take ``units`` for work already done (``journal_units``): never refused; the
        bucket may go into debt, at most its burst, which the tenant's next calls wait out."""
        rate, burst = self.limits(tenant_id) if self._overrides else (self.rate, self.burst)
        if rate <= 0 or units <= 0:
            return
        now = self._clock()
        b = self._buckets.setdefault(tenant_id, _Bucket(burst, now))
        b.level = max(-burst, min(burst, b.level + (now - b.at) * rate) - units)
        b.at = now

    def forget(self, keep: set[str]) -> None:
        """Drop the buckets of tenants no longer configured (a tenants reload); credentials'
        own buckets (``@name``) stay."""
        for t in [t for t in self._buckets if t not in keep and not t.startswith("@")]:
            del self._buckets[t]


def charge_key(principal: Principal, tenant_id: str) -> str:
    """The budget (and fair-gate queue) a call is charged to: ``tenant_id`` when the caller
    acts for it, else the credential's own (``@name``; no tenant id starts with ``@``), so no
    caller can spend, or queue in, another tenant's share."""
    return tenant_id if tenant_id in principal.tenants else "@" + principal.name
