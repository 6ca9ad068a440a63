"""What the core's operations and queries return: the interface between the core and its callers.

The result type is the interface (vLLM's ``KVCacheBlocks`` is the model): callers above the core
(the runtime, the server, apps) read these records and never the manager's internal arrays.
"Does not fit" is a value, :class:`DoesNotFit`, not an exception.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from blockd.core.errors import BlockdError


@dataclass(frozen=True, slots=True)
class DoesNotFit:
    """An allocation that cannot be satisfied; nothing was changed.

    ``reason`` is a bounded label: ``"quota"`` (the tenant's quota, after evicting its own
    cached blocks), ``"pool"`` (free plus evictable blocks), ``"guarantee"`` (blocks kept for
    other tenants' guaranteed minimums), or ``"preempting"``: lower-priority sequences were
    just preempted to make room, and their blocks become reusable once their workers' fences
    complete (retry then). Only a ``"preempting"`` answer changed anything: the preemptions.

    A per-tenant limit names itself (``blockd.core.tenants``): ``"max_sequences"`` (``needed``
    and ``available`` count sequences) or ``"max_metadata_bytes"`` (bytes); ``unit`` says which.
    """

    reason: str
    needed: int
    available: int

    @property
    def unit(self) -> str:
        """What ``needed`` and ``available`` count: blocks, sequences or bytes."""
        return _UNITS.get(self.reason, "blocks")


_UNITS = {"max_sequences": "sequences", "max_metadata_bytes": "bytes"}


@dataclass(frozen=True, slots=True)
class AdmitResult:
    seq_id: str
    #: Prompt tokens whose K/V is already in the pool: a multiple of block_size, always less
    #: than the prompt length (the last token is computed so the worker has its logits).
    num_cached_tokens: int
    block_table: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy one block's K/V (all layers) before the step's kernels run."""

    src: int
    dst: int


class AppendResult(NamedTuple):
    """An append's answer. A named tuple, not a frozen dataclass: it is built once per token
    on the per-token path, and a tuple is built in half the time (still immutable)."""

    #: Logical index from which ``block_ids`` replace or extend the worker's table.
    start_index: int
    block_ids: list[int]
    num_tokens: int
    #: The copy-on-write copy this append needs, if the last block was shared.
    copy: CopyOp | None = None


@dataclass(slots=True)
class BatchAppend:
    """Result of ``append_batch``: per entry, in request order."""

    #: Tokens of each sequence after the append (0 for a failed entry).
    num_tokens: list[int]
    #: (entry index, result) for the entries whose block table changed.
    deltas: list[tuple[int, AppendResult]] = field(default_factory=list)
    #: (entry index, error) for the entries that failed; the others applied.
    errors: list[tuple[int, BlockdError | DoesNotFit]] = field(default_factory=list)


@dataclass(slots=True)
class Counters:
    """Monotonic counters (Prometheus ``_total`` metrics). Written by the core only."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    scrubbed_blocks: int = 0
    allocated_blocks: int = 0
    released_blocks: int = 0
    #: Sequences a snapshot found no committed token ids for (see ``blockd.core.snapshot``).
    uncacheable_after_snapshot: int = 0
    alloc_failures: Counter[str] = field(default_factory=Counter)
    #: Sequences preempted for a higher-priority request, by the victim's tenant id.
    preemptions: Counter[str] = field(default_factory=Counter)
    #: Prompt tokens admits found on each lower tier (loaded), by tier name.
    tier_hit_tokens: Counter[str] = field(default_factory=Counter)
    #: Blocks copied into each lower tier (spills into the top one, demotions below), by tier.
    tier_stored_blocks: Counter[str] = field(default_factory=Counter)
    #: Blocks loaded from each lower tier into the pool, by tier.
    tier_loaded_blocks: Counter[str] = field(default_factory=Counter)
    #: Loads whose slot failed its check or could not be read (a miss), by tier.
    tier_load_failures: Counter[str] = field(default_factory=Counter)
    #: Entries each lower tier evicted (demoted or dropped), by tier.
    tier_evictions: Counter[str] = field(default_factory=Counter)
    #: Evicted pool prefixes not kept below, by why (``budget``, ``no_room``, ``duplicate``).
    tier_spill_skipped: Counter[str] = field(default_factory=Counter)
    #: Lower hits computed instead of loaded, by why: ``budget`` (the Step's load budget was
    #: spent: counted once per admit it cut short) or ``after_failure`` (behind a failed load).
    tier_loads_skipped: Counter[str] = field(default_factory=Counter)
    #: Slot writes that failed (``<tier>_write``).
    tier_errors: Counter[str] = field(default_factory=Counter)
    #: Blocks fetched from outside the node (the remote tier) that joined each lower tier.
    tier_adopted_blocks: Counter[str] = field(default_factory=Counter)
    #: Fetched blocks that did not join, by why: ``gap`` (the prefix before them left),
    #: ``key_taken``, ``no_room``.
    tier_adopt_skipped: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class PositionInfo:
    """The seeds' debugging step 1: where one token position lives."""

    position: int
    logical_block: int
    offset: int
    physical_block: int
    slot: int


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One physical block as a caller may see it."""

    block: int
    #: One of ``blockd.core.blocks.STATE_NAMES``.
    state: str
    #: Block tables naming the block.
    ref_count: int


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One configured (active) tenant's policy figures and what it holds now."""

    tenant_id: str
    #: Blocks it is charged for (``blockd.core.blocks``, the charging rule): those it holds
    #: (live, or released under a fence not yet complete) and the cached ones it keeps.
    used_blocks: int
    #: Of those, the cached ones it keeps (evictable for its own admits).
    cached_blocks: int
    quota_blocks: int
    guaranteed_blocks: int
    priority: int
    #: Its sequences preempted so far (monotonic).
    preemptions: int


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One lower tier of one manager (partition): its slots and who holds them."""

    tier: str
    num_slots: int
    used_slots: int
    #: Bytes of one slot (one block across every plane and shard).
    slot_bytes: int
    #: Used slots by tenant id (tenants holding none are left out).
    by_tenant: dict[str, int]
    #: The partition whose tier it is ("" from a single manager; the coordinator names it).
    partition: str = ""


@dataclass(frozen=True, slots=True)
class SessionView:
    """A session's fence and sequence figures (the runtime's answer-size bound and metrics)."""

    session_id: str
    tenant_id: str
    #: Highest fence any Step named so far.
    issued_fence: int
    #: Highest fence the worker reported done.
    completed_fence: int
    num_sequences: int
    #: Preemptions of its sequences not yet reported in a StepResponse.
    num_unreported_preemptions: int
    #: The lowest fence that still holds releases or commits back, or None.
    oldest_waiting_fence: int | None


@dataclass(frozen=True, slots=True)
class SequenceSummary:
    """One live sequence as an operator's listing shows it (``CoreQueries.sequences_of``)."""

    seq_id: str
    session_id: str
    tenant_id: str
    num_tokens: int
    #: Blocks in its table: ceil(num_tokens / block_size).
    num_blocks: int
