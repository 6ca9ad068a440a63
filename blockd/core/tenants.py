"""Tenant policy: quota, guaranteed blocks, priority, sharing domain, scrub-on-reuse, limits,
isolation (the shared region or a dedicated partition, ``partition_layout``).

Policies come from the daemon's tenants file (server side). A client names the tenant it acts
for; the server checks the credential and the *server* derives the sharing domain from the
policy, so a client can never pick another tenant's domain.

Limits: everything a tenant makes is counted against its own policy (``TenantTable`` keeps the
counts per slot), so the daemon's memory is bounded by the sum of the tenants' limits whatever
one tenant sends: live sequences (fork children included), sessions, waiting fence entries per
session, and metadata bytes, a documented cost per sequence (``SEQUENCE_BYTES`` plus
``TABLE_ENTRY_BYTES`` and the token bytes of each block in its table) and per indexed block
(``INDEXED_BLOCK_BYTES`` for every block of the quota, reserved up front: any block the tenant
holds may be indexed). A request priority above ``max_request_priority`` counts as that cap
against other tenants (``blockd.core.preemption``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

from blockd.core.errors import InvalidArgument, NotFound, ResourceExhausted

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

#: Upper bound on configured tenants: tenant slots are stored per block as uint16, and metrics
#: carry one label value per tenant, so the number must stay small and bounded.
MAX_TENANTS = 1024

#: Metadata cost of one live sequence, fixed part: the object, its id and dict slot, its key
#: stream state (XXH3, ~600 bytes) and its lists (measured ~1.3 KB in tests/core/test_limits.py).
SEQUENCE_BYTES = 2048
#: Metadata cost of each block in a sequence's table besides its token bytes: the table entry,
#: the chain entry and an uncommitted block's key.
TABLE_ENTRY_BYTES = 80
#: Metadata cost of one indexed block (its prefix-index entry and key), reserved for every block
#: of a tenant's quota.
INDEXED_BLOCK_BYTES = 128
#: Defaults of the limits (generous for one laptop tenant, bounded for many).
DEFAULT_MAX_SEQUENCES = 65_536
DEFAULT_MAX_SESSIONS = 256
DEFAULT_MAX_PENDING_FENCES = 8192
#: Metadata bytes a tenant's sequences may use by default, on top of its quota's index cost.
DEFAULT_SEQUENCE_METADATA_BYTES = 256 * 2**20


def sequence_bytes(num_blocks: int, block_size: int) -> int:
    """The documented metadata cost of a sequence with ``num_blocks`` blocks in its table."""
    return SEQUENCE_BYTES + num_blocks * (TABLE_ENTRY_BYTES + 4 * block_size)


class Isolation(enum.Enum):
    """Whose workers a tenant's K/V bytes are trusted with (docs/security.md, trust model)."""

    #: The tenant's blocks live in the shared region: every worker of every shared tenant maps
    #: it, so each of them is trusted with the bytes of all of them (one engine, many tenants).
    SHARED = "shared"
    #: The tenant's blocks live in a partition of its own (or of its group), sized from its
    #: policy, never lent to another tenant and mapped only by its own (or its group's)
    #: sessions.
    DEDICATED = "dedicated"


#: The partition of every shared tenant (``TenantPolicy.partition``).
SHARED_PARTITION = "shared"


class Sharing(enum.Enum):
    """Who may get prefix-cache hits on blocks a tenant's requests computed."""

    #: Only the tenant itself.
    PRIVATE = "private"
    #: Every tenant of the same named group.
    GROUP = "group"
    #: Every tenant whose policy is public.
    PUBLIC = "public"


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's policy. Quotas and guarantees are in blocks."""

    #: Stable tenant name (also the metrics label), ``[A-Za-z0-9][A-Za-z0-9_.-]{0,62}``.
    tenant_id: str
    #: Most blocks the tenant may hold at once (live, pending and cached together).
    quota_blocks: int
    #: Blocks kept available for this tenant however busy the others are.
    guaranteed_blocks: int = 0
    #: Higher runs first and is preempted last.
    priority: int = 0
    #: Sharing domain kind.
    sharing: Sharing = Sharing.PRIVATE
    #: Group name; required with ``Sharing.GROUP``, empty otherwise.
    group: str = ""
    #: Zero this tenant's blocks before they are handed to a different tenant.
    scrub_on_reuse: bool = True
    #: Most live sequences (admitted and forked) at once.
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    #: Most attached sessions at once.
    max_sessions: int = DEFAULT_MAX_SESSIONS
    #: Most releases and commits one session may have waiting for fences.
    max_pending_fences: int = DEFAULT_MAX_PENDING_FENCES
    #: Most metadata bytes (see the module docstring); None: the default sequence allowance
    #: plus the quota's index cost. Never below the quota's index cost.
    max_metadata_bytes: int | None = None
    #: Highest request priority that counts against other tenants (higher orders only the
    #: tenant's own requests).
    max_request_priority: int = 0
    #: Shared region or a dedicated partition (``Isolation``).
    isolation: Isolation = Isolation.SHARED
    #: Most bytes of the host tier the tenant's prefixes may hold (None: the whole tier; for a
    #: dedicated partition, also its host tier's size: None or 0 gives it none).
    host_quota_bytes: int | None = None
    #: The same for the disk tier.
    disk_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.tenant_id):
            raise InvalidArgument(f"tenant_id {self.tenant_id!r} is not a valid name",
                                  field="tenant_id")
        if self.quota_blocks < 0:
            raise InvalidArgument("quota_blocks must be >= 0", field="quota_blocks")
        if not 0 <= self.guaranteed_blocks <= self.quota_blocks:
            raise InvalidArgument("guaranteed_blocks must be in 0..quota_blocks",
                                  field="guaranteed_blocks")
        if self.sharing is Sharing.GROUP and not _NAME.match(self.group):
            raise InvalidArgument("a group sharing policy needs a valid group name", field="group")
        if self.sharing is not Sharing.GROUP and self.group:
            raise InvalidArgument("group is only meaningful with sharing=group", field="group")
        for name in ("max_sequences", "max_sessions", "max_pending_fences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1", field=name)
        index = INDEXED_BLOCK_BYTES * self.quota_blocks
        if self.max_metadata_bytes is None:
            object.__setattr__(self, "max_metadata_bytes",
                               index + DEFAULT_SEQUENCE_METADATA_BYTES)
        elif self.max_metadata_bytes < index + SEQUENCE_BYTES:
            raise InvalidArgument(
                f"max_metadata_bytes must be at least {index + SEQUENCE_BYTES} (the quota's "
                f"index cost, {INDEXED_BLOCK_BYTES} per block, plus one sequence)",
                field="max_metadata_bytes")
        for name in ("host_quota_bytes", "disk_quota_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise InvalidArgument(f"{name} must be an integer >= 0", field=name)
        if not -2**31 <= self.max_request_priority < 2**31:
            raise InvalidArgument("max_request_priority must be an int32",
                                  field="max_request_priority")
        if self.isolation is Isolation.DEDICATED:
            if self.sharing is Sharing.PUBLIC:
                raise InvalidArgument(
                    "isolation dedicated cannot share publicly: a public prefix is hit by "
                    "every public tenant, whose workers would then read this tenant's bytes "
                    "(use sharing private, or group for a partition its members share)",
                    field="isolation")
            if self.quota_blocks < 1:
                raise InvalidArgument("a dedicated tenant's partition is sized from "
                                      "quota_blocks, which must be >= 1", field="quota_blocks")

    @property
    def partition(self) -> str:
        """The partition the tenant's blocks live in: ``SHARED_PARTITION``, ``tenant-<id>``
        (dedicated, private) or ``group-<name>`` (dedicated, group: one per group, mapped by
        its members only). A name safe as a file name."""
        if self.isolation is Isolation.SHARED:
            return SHARED_PARTITION
        if self.sharing is Sharing.GROUP:
            return f"group-{self.group}"
        return f"tenant-{self.tenant_id}"

    @property
    def sequence_metadata_bytes(self) -> int:
        """The metadata bytes left for sequences once the quota's index cost is reserved."""
        return int(self.max_metadata_bytes or 0) - INDEXED_BLOCK_BYTES * self.quota_blocks

    @property
    def sharing_domain(self) -> str:
        """The domain string that goes into every prefix key of this tenant's requests."""
        if self.sharing is Sharing.PRIVATE:
            return f"private:{self.tenant_id}"
        if self.sharing is Sharing.GROUP:
            return f"group:{self.group}"
        return "public"


def partition_layout(policies: Iterable[TenantPolicy], shared_blocks: int
                     ) -> dict[str, int]:
    """Partition name -> blocks, the shared region first (``shared_blocks``, the pool's
    configured size). A dedicated partition holds the sum of its members' quotas, so each
    member can always reach its quota. Refused (naming ``isolation``): a group whose members
    do not all have the same isolation (a shared member's workers would map the group's
    prefixes, or a dedicated one's bytes would be hit from the shared region)."""
    layout = {SHARED_PARTITION: shared_blocks}
    kinds: dict[str, Isolation] = {}
    for p in policies:
        if p.sharing is Sharing.GROUP:
            seen = kinds.setdefault(p.group, p.isolation)
            if seen is not p.isolation:
                raise InvalidArgument(f"group {p.group!r} mixes shared and dedicated tenants "
                                      f"({p.tenant_id!r} is {p.isolation.value}): every member "
                                      "of a group needs the same isolation", field="isolation")
        if p.isolation is Isolation.DEDICATED:
            layout[p.partition] = layout.get(p.partition, 0) + p.quota_blocks
    return layout


class TenantTable:
    """Configured tenants and the small integer slot each one has in per-block arrays.

    Slots are never reused while the daemon runs: a reload that drops a tenant keeps its slot
    (its blocks keep their owner until they are freed) and refuses new work for it.

    Per slot it also counts what the tenant holds against its limits (the manager writes the
    counts, admission reads them): live sequences, their metadata bytes, sessions.
    """

    def __init__(self, policies: list[TenantPolicy] | tuple[TenantPolicy, ...] = ()) -> None:
        self._slots: dict[str, int] = {}
        self.policies: list[TenantPolicy] = []
        self.active: list[bool] = []
        self.sequences: list[int] = []
        self.sequence_bytes: list[int] = []
        self.sessions: list[int] = []
        self.replace(list(policies))

    def replace(self, policies: list[TenantPolicy]) -> None:
        """Install a new set of policies (a reload). Existing tenants keep their slots."""
        seen: set[str] = set()
        for p in policies:
            if p.tenant_id in seen:
                raise InvalidArgument(f"tenant {p.tenant_id!r} is configured twice",
                                      field="tenant_id")
            seen.add(p.tenant_id)
        if len(set(self._slots) | seen) > MAX_TENANTS:
            raise InvalidArgument(f"at most {MAX_TENANTS} tenants", field="tenants")
        self.active = [False] * len(self.policies)
        for p in policies:
            slot = self._slots.get(p.tenant_id)
            if slot is None:
                slot = len(self.policies)
                self._slots[p.tenant_id] = slot
                self.policies.append(p)
                self.active.append(True)
                self.sequences.append(0)
                self.sequence_bytes.append(0)
                self.sessions.append(0)
            else:
                self.policies[slot] = p
                self.active[slot] = True

    def add_session(self, slot: int) -> None:
        """Count a session of ``slot``'s tenant; RESOURCE_EXHAUSTED at its ``max_sessions``."""
        policy = self.policies[slot]
        if self.sessions[slot] >= policy.max_sessions:
            raise ResourceExhausted(f"tenant {policy.tenant_id!r} has max_sessions "
                                    f"({policy.max_sessions}) attached", reason="max_sessions",
                                    field="tenant_id")
        self.sessions[slot] += 1

    def slot(self, tenant_id: str) -> int:
        """The slot of an active tenant; NotFound names the field otherwise."""
        slot = self._slots.get(tenant_id)
        if slot is None or not self.active[slot]:
            raise NotFound(f"unknown tenant {tenant_id!r}", field="tenant_id")
        return slot

    def __len__(self) -> int:
        return len(self.policies)

    def __contains__(self, tenant_id: object) -> bool:
        slot = self._slots.get(tenant_id) if isinstance(tenant_id, str) else None
        return slot is not None and self.active[slot]
