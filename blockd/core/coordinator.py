"""The partition coordinator: one ``BlockManager`` per pool partition, behind the one contract.

A tenant with ``isolation: dedicated`` has its blocks in a partition of its own (``tenant-<id>``)
or of its group (``group-<name>``); every ``shared`` tenant is in ``shared``
(``blockd.core.tenants.partition_layout``). Each partition is a whole ``BlockManager`` over its
own block-id space ``0..num_blocks-1`` (and the runtime gives each its own pool), so by
construction a block of one partition is never allocated, evicted, hit, preempted or scrubbed
for a tenant of another: the free stack, the LRUs, the prefix index and the victims are per
partition. Block ids on the wire are partition-local and index the one pool tensor the
session's worker maps (``blockd.wire``, "Block ids").

``PartitionCoordinator`` implements ``blockd.core.contract.KVManager`` as a typed composite
(vLLM's ``KVCacheCoordinator`` over its single-type managers is the model): a call naming a
session goes to the session's partition; the read API aggregates (sums, concatenations, merged
pages). The partition layout is fixed for the daemon's life: a tenants reload that would add,
remove or resize a dedicated partition, or move a tenant between partitions, is refused naming
``isolation`` (a restart with the new layout is a new epoch).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from collections.abc import Sequence as Seq

from blockd.core import snapshot
from blockd.core.errors import Internal, InvalidArgument
from blockd.core.events import AllBlocksCleared, BlockStored, CoreEvent, EventSink
from blockd.core.ids import SequenceIds
from blockd.core.manager import BlockManager
from blockd.core.namespace import PrefixScope
from blockd.core.results import (
    AdmitResult,
    AppendResult,
    BatchAppend,
    BlockInfo,
    Counters,
    DoesNotFit,
    PositionInfo,
    SequenceSummary,
    SessionView,
    TenantUsage,
    TierUsage,
)
from blockd.core.spec import PoolSpec
from blockd.core.tenants import SHARED_PARTITION, TenantPolicy, partition_layout
from blockd.core.tier_io import TierIO
from blockd.core.tiering import TierLimits

#: Hears (partition name, event) of every partition (``set_partition_listener``).
PartitionListener = Callable[[str, CoreEvent], None]

__all__ = ["PartitionCoordinator"]


class PartitionCoordinator:
    """The block managers of every partition, routed by session and tenant (module docstring).

    Not thread-safe, like the manager: the daemon calls it from its event loop.
    """

    def __init__(self, spec: PoolSpec, policies: Iterable[TenantPolicy], *,
                 enable_prefix_cache: bool = True, scrub_always: bool = False,
                 ids: SequenceIds | None = None, preemption: str = "priority",
                 tiers: TierLimits | None = None,
                 managers: dict[str, BlockManager] | None = None) -> None:
        policies = list(policies)
        self.spec = spec
        self.block_size = spec.block_size
        self.layout = partition_layout(policies, spec.num_blocks)
        #: Each partition's lower tiers: the configured ones for the shared partition, and for
        #: a dedicated one tiers of its own sized from its members' quotas (``partition_tiers``).
        self.tiers = partition_tiers(policies, tiers or TierLimits(), spec.slot_bytes)
        self._tenant_partition = {p.tenant_id: p.partition for p in policies}
        if managers is not None:  # restored: the layout and tenants the snapshot had
            self.layout = {name: m.num_blocks for name, m in managers.items()}
            self.tiers = {name: m.tiers.limits for name, m in managers.items()}
            self._tenant_partition = {t: name for name, m in managers.items()
                                      for t in m.tenant_policies()}
        #: Each partition's pool shape (the configured one with the partition's num_blocks).
        self.specs = {name: dataclasses.replace(spec, num_blocks=n)
                      for name, n in self.layout.items()}
        self.num_blocks = sum(self.layout.values())
        if managers is None:
            managers = {name: BlockManager(self.specs[name], _members(policies, name),
                                           enable_prefix_cache=enable_prefix_cache,
                                           scrub_always=scrub_always, ids=ids,
                                           preemption=preemption, tiers=self.tiers[name])
                        for name in self.layout}
        if set(managers) != set(self.layout):
            raise Internal(f"partitions {sorted(managers)} do not match the layout "
                           f"{sorted(self.layout)}")
        self.managers = managers
        self._session_partition: dict[str, str] = {}
        self._sink: EventSink | None = None
        self._listener: PartitionListener | None = None

    # -- routing -------------------------------------------------------------------------------

    def partition_of_tenant(self, tenant_id: str) -> str:
        """The partition of a configured tenant (the shared one for an unknown tenant: its
        manager then answers NOT_FOUND on ``tenant_id`` as an unpartitioned daemon would)."""
        return self._tenant_partition.get(tenant_id, SHARED_PARTITION)

    def partition_of_session(self, session_id: str) -> str:
        """The partition of a session (the shared one for an unknown session: its manager
        then answers NOT_FOUND on ``session_id``)."""
        name = self._session_partition.get(session_id)
        if name is None:
            name = next((n for n, m in self.managers.items() if m.has_session(session_id)),
                        SHARED_PARTITION)
            if name != SHARED_PARTITION or self.managers[name].has_session(session_id):
                self._session_partition[session_id] = name
        return name

    def of_session(self, session_id: str) -> BlockManager:
        return self.managers[self.partition_of_session(session_id)]

    def of_tenant(self, tenant_id: str) -> BlockManager:
        return self.managers[self.partition_of_tenant(tenant_id)]

    # -- configuration -------------------------------------------------------------------------

    def set_event_sink(self, events: EventSink | None) -> None:
        """Every partition reports to ``events``; an ``AllBlocksCleared`` of one partition is
        passed on only when no partition indexes a block any more, in its pool or a lower tier
        (its removals were each reported already)."""
        self._sink = events
        self._wire()

    def set_partition_listener(self, listener: PartitionListener | None) -> None:
        """``listener(partition, event)`` hears every partition's events first (what the
        remote tier publishes needs to know whose block an id is)."""
        self._listener = listener
        self._wire()

    def _wire(self) -> None:
        for name, m in self.managers.items():
            m.set_event_sink(None if self._sink is None and self._listener is None
                             else functools.partial(self._forward, name))

    def _forward(self, partition: str, event: CoreEvent) -> None:
        if self._listener is not None:
            self._listener(partition, event)
        if self._sink is None:
            return
        if isinstance(event, AllBlocksCleared) and (self.num_indexed or self.num_lower):
            return
        self._sink(event)

    def set_ids(self, ids: SequenceIds) -> None:
        for m in self.managers.values():
            m.set_ids(ids)

    def set_tier_io(self, partition: str, io: TierIO | None) -> None:
        """What moves the bytes of one partition's lower tiers (its own pool's and slots')."""
        self.managers[partition].set_tier_io(io)

    def reconfigure(self, *, enable_prefix_cache: bool, scrub_always: bool,
                    preemption: str) -> None:
        for m in self.managers.values():
            m.reconfigure(enable_prefix_cache=enable_prefix_cache, scrub_always=scrub_always,
                          preemption=preemption)

    def check_tenants(self, policies: Iterable[TenantPolicy]) -> None:
        """Refuse (InvalidArgument on ``isolation``) a tenant set that changes the partitions."""
        policies = list(policies)
        layout = partition_layout(policies, self.spec.num_blocks)
        if layout != self.layout:
            raise InvalidArgument(
                f"the dedicated partitions would change from {_describe(self.layout)} to "
                f"{_describe(layout)}: partitions are fixed while the daemon runs (restart it "
                "with the new tenants file: a new epoch)", field="isolation")
        shared = self.tiers[SHARED_PARTITION]
        tiers = partition_tiers(policies, shared, self.spec.slot_bytes)
        if tiers != self.tiers:
            changed = sorted(n for n in tiers if tiers[n] != self.tiers.get(n))
            raise InvalidArgument(
                f"the lower tiers of partitions {changed} would change size: a dedicated "
                "partition's host and disk tiers are sized from its members' host_quota_bytes "
                "and disk_quota_bytes and fixed while the daemon runs (restart it)",
                field="host_quota_bytes")
        for p in policies:
            was = self._tenant_partition.get(p.tenant_id)
            if was is not None and was != p.partition:
                raise InvalidArgument(f"tenant {p.tenant_id!r} would move from partition "
                                      f"{was!r} to {p.partition!r}: restart the daemon",
                                      field="isolation")

    def set_tenants(self, policies: Iterable[TenantPolicy]) -> int:
        policies = list(policies)
        self.check_tenants(policies)
        flushed = sum(m.set_tenants(_members(policies, name))
                      for name, m in self.managers.items())
        self._tenant_partition.update({p.tenant_id: p.partition for p in policies})
        return flushed

    # -- sessions and the Step operations (routed) ----------------------------------------------

    def open_session(self, tenant_id: str, session_id: str | None = None) -> str:
        name = self.partition_of_tenant(tenant_id)
        sid = self.managers[name].open_session(tenant_id, session_id)
        self._session_partition[sid] = name
        return sid

    def close_session(self, session_id: str) -> int:
        n = self.of_session(session_id).close_session(session_id)
        self._session_partition.pop(session_id, None)
        return n

    def revoke_session(self, session_id: str) -> int:
        return self.of_session(session_id).revoke_session(session_id)

    def complete_fence(self, session_id: str, fence: int, *, clamp_to_issued: bool = False
                       ) -> int:
        return self.of_session(session_id).complete_fence(session_id, fence,
                                                          clamp_to_issued=clamp_to_issued)

    def begin_step(self, session_id: str, fence: int, completed_fence: int = 0) -> None:
        self.of_session(session_id).begin_step(session_id, fence, completed_fence)

    def admit(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int], *,
              cache: bool = True, priority: int = 0) -> AdmitResult | DoesNotFit:
        return self.of_session(session_id).admit(session_id, scope, tokens, cache=cache,
                                                 priority=priority)

    def append(self, session_id: str, seq_id: str, tokens: bytes | Seq[int],
               fence: int = 0) -> AppendResult | DoesNotFit:
        return self.of_session(session_id).append(session_id, seq_id, tokens, fence)

    def append_batch(self, session_id: str, seq_ids: Seq[str], token_bytes: bytes,
                     counts: Seq[int] | None = None, fence: int = 0) -> BatchAppend:
        return self.of_session(session_id).append_batch(session_id, seq_ids, token_bytes,
                                                        counts, fence)

    def fork(self, session_id: str, seq_id: str, num_children: int = 1) -> list[str]:
        return self.of_session(session_id).fork(session_id, seq_id, num_children)

    def release(self, session_id: str, seq_id: str, fence: int = 0) -> int:
        return self.of_session(session_id).release(session_id, seq_id, fence)

    def commit(self, session_id: str, seq_id: str, fence: int = 0) -> int:
        return self.of_session(session_id).commit(session_id, seq_id, fence)

    def take_preempted(self, session_id: str) -> list[str]:
        return self.of_session(session_id).take_preempted(session_id)

    def take_scrubbed(self) -> list[int]:
        """The blocks to zero after a Step: a Step allocates in one partition (the session's;
        preemption frees only within it), so at most one partition has any."""
        found = [(name, ids) for name, m in self.managers.items() if (ids := m.take_scrubbed())]
        if len(found) > 1:
            raise Internal(f"scrubbed blocks in several partitions: {[n for n, _ in found]}")
        return found[0][1] if found else []

    def flush(self, *, model_id: str | None = None, model_revision: str | None = None,
              lora_id: str | None = None, tenant_id: str | None = None) -> int:
        """A flush of one tenant's blocks goes to its partition; any other to every one."""
        if tenant_id is not None:
            return self.of_tenant(tenant_id).flush(
                model_id=model_id, model_revision=model_revision, lora_id=lora_id,
                tenant_id=tenant_id)
        if model_id is None and model_revision is None and lora_id is None:
            return self.managers[SHARED_PARTITION].flush()  # INVALID_ARGUMENT
        return sum(m.flush(model_id=model_id, model_revision=model_revision, lora_id=lora_id)
                   for m in self.managers.values())

    def adopt_remote(self, tenant_id: str, scope: PrefixScope, tokens: bytes, start: int,
                     count: int) -> int:
        return self.of_tenant(tenant_id).adopt_remote(tenant_id, scope, tokens, start, count)

    # -- queries -------------------------------------------------------------------------------

    def lookup(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int]) -> int:
        return self.of_session(session_id).lookup(session_id, scope, tokens)

    def namespace_keys(self, tenant_id: str, scope: PrefixScope) -> tuple[bytes, bytes]:
        return self.of_tenant(tenant_id).namespace_keys(tenant_id, scope)

    def block_table(self, session_id: str, seq_id: str) -> tuple[list[int], int]:
        return self.of_session(session_id).block_table(session_id, seq_id)

    def inspect(self, session_id: str, seq_id: str, start: int = 0,
                count: int | None = None) -> list[PositionInfo]:
        return self.of_session(session_id).inspect(session_id, seq_id, start, count)

    def sequence_blocks(self, session_id: str, seq_id: str) -> list[BlockInfo]:
        return self.of_session(session_id).sequence_blocks(session_id, seq_id)

    def has_session(self, session_id: str) -> bool:
        return self.of_session(session_id).has_session(session_id)

    def session_view(self, session_id: str) -> SessionView:
        return self.of_session(session_id).session_view(session_id)

    def has_tenant(self, tenant_id: str) -> bool:
        return self.of_tenant(tenant_id).has_tenant(tenant_id)

    def tenant_policy(self, tenant_id: str) -> TenantPolicy:
        return self.of_tenant(tenant_id).tenant_policy(tenant_id)

    def tenant_policies(self) -> dict[str, TenantPolicy]:
        out: dict[str, TenantPolicy] = {}
        for m in self.managers.values():
            out.update(m.tenant_policies())
        return out

    def tenant_usage(self) -> list[TenantUsage]:
        return [u for m in self.managers.values() for u in m.tenant_usage()]

    def sequence_session(self, seq_id: str) -> str | None:
        for m in self.managers.values():
            found = m.sequence_session(seq_id)
            if found is not None:
                return found
        return None

    def sequences_of(self, tenant_ids: Collection[str] | None, after: str = "",
                     limit: int = 1000) -> list[SequenceSummary]:
        """Every partition's page, merged in sequence-id order (each is sorted)."""
        pages = [m.sequences_of(tenant_ids, after=after, limit=limit)
                 for m in self.managers.values()]
        return list(heapq.merge(*pages, key=lambda s: s.seq_id))[:limit]

    def state_counts(self) -> dict[str, int]:
        """Blocks per state, summed over every partition."""
        return self.state_counts_of(None)

    def state_counts_of(self, partitions: Collection[str] | None) -> dict[str, int]:
        """Blocks per state, summed over ``partitions`` (None: all)."""
        out: dict[str, int] = {}
        for name, m in self.managers.items():
            if partitions is None or name in partitions:
                for state, n in m.state_counts().items():
                    out[state] = out.get(state, 0) + n
        return out

    @property
    def counters(self) -> Counters:
        """Every partition's counters, summed (a fresh object)."""
        total = Counters()
        for m in self.managers.values():
            c = m.counters
            for f in dataclasses.fields(Counters):
                value = getattr(c, f.name)
                if isinstance(value, Counter):
                    getattr(total, f.name).update(value)
                else:
                    setattr(total, f.name, getattr(total, f.name) + getattr(c, f.name))
        return total

    @property
    def num_sequences(self) -> int:
        return sum(m.num_sequences for m in self.managers.values())

    @property
    def num_indexed(self) -> int:
        return sum(m.num_indexed for m in self.managers.values())

    def tier_usage(self) -> list[TierUsage]:
        return [dataclasses.replace(u, partition=name) for name, m in self.managers.items()
                for u in m.tier_usage()]

    @property
    def num_lower(self) -> int:
        return sum(m.num_lower for m in self.managers.values())

    def tail_waste_tokens(self) -> int:
        return sum(m.tail_waste_tokens() for m in self.managers.values())

    def indexed_events(self) -> list[BlockStored]:
        return [ev for m in self.managers.values() for ev in m.indexed_events()]

    def check_invariants(self) -> None:
        for m in self.managers.values():
            m.check_invariants()

    # -- snapshots -----------------------------------------------------------------------------

    def dump(self) -> dict[str, bytes]:
        """Each partition's manager as ``blockd.core.snapshot`` bytes."""
        return {name: snapshot.dump(m) for name, m in self.managers.items()}

    @classmethod
    def load(cls, data: dict[str, bytes], spec: PoolSpec, *, ids: SequenceIds
             ) -> PartitionCoordinator:
        """Restored from ``dump``'s bytes: the layout and tenants the snapshot was taken
        under (a tenants file changed meanwhile is then applied as a reload)."""
        managers = {name: snapshot.load(raw, events=None, ids=ids) for name, raw in data.items()}
        return cls(spec, (), ids=ids, managers=managers)


def partition_tiers(policies: Iterable[TenantPolicy], shared: TierLimits, block_bytes: int
                    ) -> dict[str, TierLimits]:
    """Partition name -> its lower tiers. The shared partition has ``shared``; a dedicated
    one tiers of its own holding the sum of its members' ``host_quota_bytes`` and
    ``disk_quota_bytes`` (in whole slots; none where they give none), with the same per-Step
    copy bounds, and a disk tier only where the shared one has one (its file is beside it)."""
    sizes: dict[str, list[int]] = {}
    for p in policies:
        if p.partition != SHARED_PARTITION:
            host, disk = sizes.setdefault(p.partition, [0, 0])
            sizes[p.partition] = [host + (p.host_quota_bytes or 0),
                                  disk + (p.disk_quota_bytes or 0)]
    out = {SHARED_PARTITION: shared}
    for name, (host, disk) in sizes.items():
        out[name] = dataclasses.replace(
            shared, host_slots=host // block_bytes if shared.host_slots else 0,
            disk_slots=disk // block_bytes if shared.disk_slots else 0)
    return out


def _members(policies: Iterable[TenantPolicy], partition: str) -> list[TenantPolicy]:
    return [p for p in policies if p.partition == partition]


def _describe(layout: dict[str, int]) -> str:
    return ", ".join(f"{n}={b}" for n, b in sorted(layout.items()) if n != SHARED_PARTITION) \
        or "none"
