"""What Stats answers, and to whom: the pool's capacity to every caller, its own figures to a
tenant, the pool-wide counters and every tenant's figures only to an admin (docs/security.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.lower_tiers import TIER_ORDER
from blockd.runtime import convert

if TYPE_CHECKING:
    from blockd.core.coordinator import PartitionCoordinator
    from blockd.runtime.sessions import Sessions
    from blockd.runtime.tenants_file import Principal


def answer(principal: Principal, partitions: PartitionCoordinator, sessions: Sessions, *,
           epoch: int, block_size: int) -> pb.StatsResponse:
    """The pool's shape and block states (the capacity a worker schedules against), and
    the caller's own figures: its tenants' usage, sessions and sequences. The pool-wide
    counters (prefix-cache hits, evictions, copies) and every tenant's sessions and
    sequences only for an admin, or a caller acting for every configured tenant (the
    laptop default): to anyone else they would tell what the other tenants do (they are 0
    to it; docs/security.md)."""
    m = partitions
    everything = principal.admin or set(m.tenant_policies()) <= principal.tenants
    # A caller's capacity is that of its tenants' partitions (all of them for an admin).
    scope = None if everything else {partitions.partition_of_tenant(t)
                                     for t in principal.tenants}
    counts = partitions.state_counts_of(scope)
    layout = partitions.layout
    resp = pb.StatsResponse(
        epoch=epoch, num_blocks=sum(n for p, n in layout.items()
                                    if scope is None or p in scope),
        block_size=block_size, blocks_free=counts["free"],
        blocks_writing=counts["writing"], blocks_committed=counts["committed"],
        blocks_pending=counts["pending"], blocks_cached=counts["cached"])
    if everything:
        c = m.counters
        resp.MergeFrom(pb.StatsResponse(
            prefix_queried_tokens_total=c.queried_tokens,
            prefix_hit_tokens_total=c.hit_tokens,
            evictions_total=c.evictions, cow_copies_total=c.cow_copies,
            num_sessions=len(sessions), num_sequences=m.num_sequences))
    else:  # O(sessions), bounded by server.max_sessions
        own = [m.session_view(i.id) for i in sessions
               if i.tenant_id in principal.tenants and m.has_session(i.id)]
        resp.num_sessions = len(own)
        resp.num_sequences = sum(v.num_sequences for v in own)
    for usage in sorted(m.tenant_usage(), key=lambda u: u.tenant_id):
        if principal.admin or usage.tenant_id in principal.tenants:
            resp.tenants.append(convert.tenant_usage(usage))
    _tiers(resp, partitions, scope, everything)
    return resp


def _tiers(resp: pb.StatsResponse, partitions: PartitionCoordinator, scope: set[str] | None,
           everything: bool) -> None:
    """The lower tiers of the caller's partitions; their counters as the pool's (above)."""
    usage = [u for u in partitions.tier_usage() if scope is None or u.partition in scope]
    c = partitions.counters
    for name in TIER_ORDER:
        mine = [u for u in usage if u.tier == name]
        if not mine:
            continue
        out = resp.tiers.add(tier=name, num_slots=sum(u.num_slots for u in mine),
                             used_slots=sum(u.used_slots for u in mine),
                             slot_bytes=mine[0].slot_bytes)
        if everything:
            out.hit_tokens_total = c.tier_hit_tokens[name]
            out.stored_blocks_total = c.tier_stored_blocks[name]
            out.loaded_blocks_total = c.tier_loaded_blocks[name]
            out.load_failures_total = c.tier_load_failures[name]
