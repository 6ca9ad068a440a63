"""The block manager's one typed contract: what the runtime, the server and the apps may call.

``KVManager`` is a structural Protocol. Two classes implement it: ``BlockManager``
(``blockd.core.manager``: one pool's blocks and all policy) and ``PartitionCoordinator``
(``blockd.core.coordinator``: one ``BlockManager`` per pool partition, a call naming a session
routed to the session's partition, the read calls summed). Callers above the core hold a
``KVManager`` (or the coordinator, for what only it has: the partition layout and snapshots),
never a ``BlockManager``'s rooms; ``mypy --strict`` over blockd/core, blockd/runtime and
blockd/server checks every call against this contract, and ``tests/test_architecture.py``
checks that both implementations have each method with the same signature.

Ids: a session id names one session of one partition; block ids are those of the session's
partition (``blockd.wire``, "Block ids"); sequence ids are unique across partitions.

Errors: every method raises ``blockd.core.errors.BlockdError`` subclasses naming the bad field,
and changes nothing when it does; "does not fit" is a return value (``DoesNotFit``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

from blockd.core.events import BlockStored, EventSink
from blockd.core.ids import SequenceIds
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
from blockd.core.tenants import TenantPolicy

__all__ = ["KVManager"]


class KVManager(Protocol):
    """The operations of the Step protocol, sessions and fences, flushes and the read API."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (every partition's, for the coordinator)."""
        ...

    # -- configuration ------------------------------------------------------------------------

    def set_event_sink(self, events: EventSink | None) -> None: ...

    def set_ids(self, ids: SequenceIds) -> None: ...

    def reconfigure(self, *, enable_prefix_cache: bool, scrub_always: bool,
                    preemption: str) -> None: ...

    def set_tenants(self, policies: Iterable[TenantPolicy]) -> int:
        """Reload the tenant policies; returns the blocks flushed (removed tenants' private
        prefixes)."""
        ...

    # -- sessions and fences ------------------------------------------------------------------

    def open_session(self, tenant_id: str, session_id: str | None = None) -> str: ...

    def close_session(self, session_id: str) -> int: ...

    def revoke_session(self, session_id: str) -> int: ...

    def complete_fence(self, session_id: str, fence: int, *, clamp_to_issued: bool = False
                       ) -> int: ...

    def begin_step(self, session_id: str, fence: int, completed_fence: int = 0) -> None: ...

    # -- the Step operations ------------------------------------------------------------------

    def admit(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int], *,
              cache: bool = True, priority: int = 0) -> AdmitResult | DoesNotFit: ...

    def append(self, session_id: str, seq_id: str, tokens: bytes | Seq[int],
               fence: int = 0) -> AppendResult | DoesNotFit: ...

    def append_batch(self, session_id: str, seq_ids: Seq[str], token_bytes: bytes,
                     counts: Seq[int] | None = None, fence: int = 0) -> BatchAppend: ...

    def fork(self, session_id: str, seq_id: str, num_children: int = 1) -> list[str]: ...

    def release(self, session_id: str, seq_id: str, fence: int = 0) -> int: ...

    def commit(self, session_id: str, seq_id: str, fence: int = 0) -> int: ...

    def take_preempted(self, session_id: str) -> list[str]: ...

    def take_scrubbed(self) -> list[int]:
        """Blocks the last Step handed out that must be zeroed first (ids of the pool of the
        Step's session)."""
        ...

    def flush(self, *, model_id: str | None = None, model_revision: str | None = None,
              lora_id: str | None = None, tenant_id: str | None = None) -> int: ...

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int]) -> int: ...

    def namespace_keys(self, tenant_id: str, scope: PrefixScope) -> tuple[bytes, bytes]:
        """(canonical bytes, root key) of the namespace a request of the tenant with ``scope``
        gets."""
        ...

    def adopt_remote(self, tenant_id: str, scope: PrefixScope, tokens: bytes, start: int,
                     count: int) -> int:
        """Fetched blocks ``start..start+count-1`` of a prompt join the tenant's lower tier
        (their bytes staged in the partition's ``TierIO``); returns how many joined."""
        ...

    def block_table(self, session_id: str, seq_id: str) -> tuple[list[int], int]: ...

    def inspect(self, session_id: str, seq_id: str, start: int = 0,
                count: int | None = None) -> list[PositionInfo]: ...

    def sequence_blocks(self, session_id: str, seq_id: str) -> list[BlockInfo]: ...

    def has_session(self, session_id: str) -> bool: ...

    def session_view(self, session_id: str) -> SessionView: ...

    def has_tenant(self, tenant_id: str) -> bool: ...

    def tenant_policy(self, tenant_id: str) -> TenantPolicy: ...

    def tenant_policies(self) -> dict[str, TenantPolicy]: ...

    def tenant_usage(self) -> list[TenantUsage]: ...

    def sequence_session(self, seq_id: str) -> str | None: ...

    def sequences_of(self, tenant_ids: Collection[str] | None, after: str = "",
                     limit: int = 1000) -> list[SequenceSummary]: ...

    def state_counts(self) -> dict[str, int]: ...

    @property
    def counters(self) -> Counters: ...

    @property
    def num_sequences(self) -> int: ...

    @property
    def num_indexed(self) -> int: ...

    def tier_usage(self) -> list[TierUsage]:
        """Every lower tier of every partition: slots, used, by tenant."""
        ...

    @property
    def num_lower(self) -> int:
        """Entries on the lower tiers (every partition's)."""
        ...

    def tail_waste_tokens(self) -> int: ...

    def indexed_events(self) -> list[BlockStored]: ...

    def check_invariants(self) -> None: ...


if TYPE_CHECKING:  # mypy checks that both implementations conform (nothing runs here)
    from blockd.core.coordinator import PartitionCoordinator
    from blockd.core.manager import BlockManager

    def _conforms(m: BlockManager, c: PartitionCoordinator) -> tuple[KVManager, KVManager]:
        return m, c
