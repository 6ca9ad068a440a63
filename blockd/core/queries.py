"""The core's query API: read-only views of its state as result records (``blockd.core.results``).

``CoreQueries`` is the read half of the ``BlockManager`` facade (the manager inherits it): the
records callers above the core see are built here, in one place, so that the runtime, the
server and the apps never read the rooms' arrays. Nothing here changes any state.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from blockd.core.blocks import STATE_NAMES, BlockArrays
from blockd.core.errors import NotFound, PermissionDenied
from blockd.core.events import BlockStored
from blockd.core.fences import Session
from blockd.core.invariants import check_invariants
from blockd.core.namespace import Namespace, NamespaceTable, PrefixScope
from blockd.core.results import (
    BlockInfo,
    Counters,
    PositionInfo,
    SequenceSummary,
    SessionView,
    TenantUsage,
    TierUsage,
)
from blockd.core.sequence import Sequence, TailWaste, as_token_bytes
from blockd.core.tenants import TenantPolicy, TenantTable

if TYPE_CHECKING:
    from blockd.core.caching import PrefixCache
    from blockd.core.prefix_index import PrefixIndex
    from blockd.core.tiering import Tiering


def positions(seq: Sequence, block_size: int, start: int, count: int | None
              ) -> list[PositionInfo]:
    """Every position's logical block, offset, physical block and slot, from ``start``.

    ``slot = block_table[p // B] * B + p % B``: the formula the kernels use.
    """
    B = block_size
    end = seq.num_tokens if count is None else min(seq.num_tokens, start + count)
    out = []
    for p in range(max(0, start), end):
        lb, off = divmod(p, B)
        pb = seq.table[lb]
        out.append(PositionInfo(p, lb, off, pb, pb * B + off))
    return out


def block_info(blocks: BlockArrays, ids: Iterable[int]) -> list[BlockInfo]:
    state = blocks.state
    ref = blocks.ref
    return [BlockInfo(b, STATE_NAMES[state[b]], ref[b]) for b in ids]


def tenant_usage(tenants: TenantTable, blocks: BlockArrays, counters: Counters
                 ) -> list[TenantUsage]:
    """The one loop over active tenants (Stats, metrics and tools all read this)."""
    out = []
    for slot, policy in enumerate(tenants.policies):
        if tenants.active[slot]:
            out.append(TenantUsage(
                tenant_id=policy.tenant_id, used_blocks=blocks.usage[slot],
                cached_blocks=blocks.cached[slot], quota_blocks=policy.quota_blocks,
                guaranteed_blocks=policy.guaranteed_blocks, priority=policy.priority,
                preemptions=counters.preemptions.get(policy.tenant_id, 0)))
    return out


def session_view(session: Session, tenant_id: str) -> SessionView:
    waiting = session.waiting
    return SessionView(
        session_id=session.id, tenant_id=tenant_id, issued_fence=session.issued,
        completed_fence=session.completed, num_sequences=session.num_sequences,
        num_unreported_preemptions=len(session.preempted),
        oldest_waiting_fence=waiting[0][0] if waiting else None)


class CoreQueries:
    """The read API of the ``BlockManager`` (which sets these attributes; see manager.py)."""

    block_size: int
    blocks: BlockArrays
    tenants: TenantTable
    counters: Counters
    cache: PrefixCache
    index: PrefixIndex
    tiers: Tiering
    sessions: dict[str, Session]
    sequences: dict[str, Sequence]
    tail: TailWaste

    enable_prefix_cache: bool
    namespaces: NamespaceTable

    # The manager's lookups of the caller's ids (they raise the errors naming the field).
    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound("unknown session", field="session_id")
        return session

    def _sequence(self, session: Session, seq_id: str) -> Sequence:
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise session.unknown_sequence(seq_id)
        if seq.session != session.id:
            raise PermissionDenied("the sequence belongs to another session",
                                   field="sequence_id")
        return seq

    def _namespace(self, scope: PrefixScope, tenant: int) -> Namespace:
        return self.namespaces.for_request(scope, tenant,
                                           self.tenants.policies[tenant].sharing_domain)

    def _room(self, session: Session, waits: bool = True) -> int | None:
        """The session's ``max_pending_fences`` where an operation adds a waiting entry."""
        return self.tenants.policies[session.tenant].max_pending_fences if waits else None

    def lookup(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int]) -> int:
        """Tokens of a prompt whose K/V is cached and visible to this session's tenant (or
        committed by this session under a fence not yet complete: its own admissions hit it),
        in the pool or on a lower tier (an admit would load those).

        Allocates nothing and does not touch the LRU. Capped like ``admit``: a multiple of the
        block size, less than the prompt length.
        """
        session = self._session(session_id)
        raw = as_token_bytes(tokens, "token_ids")
        length = len(raw) // 4
        if length == 0 or not self.enable_prefix_cache:
            return 0
        ns = self._namespace(scope, session.tenant)
        try:
            hits, below = self.tiers.match_prefix(ns.id, ns.root_key, raw,
                                                  (length - 1) // self.block_size,
                                                  session.pending, in_step=False)
            return (len(hits) + len(below)) * self.block_size
        finally:
            self.namespaces.release_if_unused(ns)

    def namespace_keys(self, tenant_id: str, scope: PrefixScope) -> tuple[bytes, bytes]:
        """The canonical encoding of the namespace a request of ``tenant_id`` with ``scope``
        gets (its fields and the tenant's sharing domain: what remote keys derive from) and
        its root key (what ``BlockStored.root_key`` names it by)."""
        slot = self.tenants.slot(tenant_id)
        ns = self._namespace(scope, slot)
        try:
            return ns.canonical, ns.root_key
        finally:
            self.namespaces.release_if_unused(ns)

    def block_table(self, session_id: str, seq_id: str) -> tuple[list[int], int]:
        """(block ids, number of tokens) of a sequence of this session."""
        seq = self._sequence(self._session(session_id), seq_id)
        return seq.table.tolist(), seq.num_tokens

    def inspect(self, session_id: str, seq_id: str, start: int = 0,
                count: int | None = None) -> list[PositionInfo]:
        """Every position's logical block, offset, physical block and slot (seeds' step 1)."""
        seq = self._sequence(self._session(session_id), seq_id)
        return positions(seq, self.block_size, start, count)

    def sequence_blocks(self, session_id: str, seq_id: str) -> list[BlockInfo]:
        """State and reference count of each block of a sequence of this session, in table
        order."""
        seq = self._sequence(self._session(session_id), seq_id)
        return block_info(self.blocks, seq.table)

    def block_info(self, blocks: Iterable[int]) -> list[BlockInfo]:
        """State and reference count of each block, in order."""
        return block_info(self.blocks, blocks)

    def block_state(self, block: int) -> str:
        return STATE_NAMES[self.blocks.state[block]]

    def state_counts(self) -> dict[str, int]:
        counts = self.blocks.count_states()
        return {name: counts[i] for i, name in enumerate(STATE_NAMES)}

    def tenant_usage(self) -> list[TenantUsage]:
        """Every active tenant's policy figures and current holdings, in slot order."""
        return tenant_usage(self.tenants, self.blocks, self.counters)

    def has_tenant(self, tenant_id: str) -> bool:
        return tenant_id in self.tenants

    def tenant_policy(self, tenant_id: str) -> TenantPolicy:
        """The policy of an active tenant (NOT_FOUND on ``tenant_id`` otherwise)."""
        return self.tenants.policies[self.tenants.slot(tenant_id)]

    def tenant_policies(self) -> dict[str, TenantPolicy]:
        """The active tenants' policies by id."""
        t = self.tenants
        return {p.tenant_id: p for p, on in zip(t.policies, t.active, strict=True) if on}

    def has_session(self, session_id: str) -> bool:
        return session_id in self.sessions

    def session_view(self, session_id: str) -> SessionView:
        session = self._session(session_id)
        return session_view(session, self.tenants.policies[session.tenant].tenant_id)

    def sequence_session(self, seq_id: str) -> str | None:
        """The session holding a live sequence (an operator's lookup), or None."""
        seq = self.sequences.get(seq_id)
        return seq.session if seq is not None else None

    def sequences_of(self, tenant_ids: Collection[str] | None, after: str = "",
                     limit: int = 1000) -> list[SequenceSummary]:
        """Live sequences of these tenants (``None``: every tenant), in sequence-id order,
        those whose id sorts after ``after``, at most ``limit``: an operator's paged listing
        (O(sequences) per page; not for the hot path). Unknown tenant ids match nothing."""
        t = self.tenants
        slots = None if tenant_ids is None else {t.slot(x) for x in tenant_ids if x in t}
        chosen = heapq.nsmallest(limit, (s for s in self.sequences.values()
                                         if s.id > after and (slots is None or s.tenant in slots)),
                                 key=lambda s: s.id)
        return [SequenceSummary(s.id, s.session, t.policies[s.tenant].tenant_id, s.num_tokens,
                                len(s.table)) for s in chosen]

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def num_indexed(self) -> int:
        """Blocks in the prefix index."""
        return len(self.index)

    def tier_usage(self) -> list[TierUsage]:
        """Every lower tier's slots and who holds them (none without lower tiers)."""
        return self.tiers.usage()

    @property
    def num_lower(self) -> int:
        """Entries on the lower tiers."""
        return len(self.tiers)

    def tail_waste_tokens(self) -> int:
        """Unused token slots in the last blocks of live sequences (a running total: O(1))."""
        return self.tail.tokens

    def indexed_events(self) -> list[BlockStored]:
        """A ``BlockStored`` for every indexed block, parents first (a subscriber's resync)."""
        return self.cache.indexed_events()

    def check_invariants(self) -> None:
        """Raise ``Internal`` on any violated invariant (``blockd.core.invariants``)."""
        check_invariants(self)  # type: ignore[arg-type]

