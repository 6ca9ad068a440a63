"""Tenant policy: quota, guaranteed blocks, priority, sharing domain, scrub-on-reuse.

Policies come from the daemon's tenants file (server side). A client names the tenant it acts
for; the server checks the credential and the *server* derives the sharing domain from the
policy, so a client can never pick another tenant's domain.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from blockd.core.errors import InvalidArgument, NotFound

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

#: Upper bound on configured tenants: tenant slots are stored per block as uint16, and metrics
#: carry one label value per tenant, so the number must stay small and bounded.
MAX_TENANTS = 1024


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

    @property
    def sharing_domain(self) -> str:
        """The domain string that goes into every prefix key of this tenant's requests."""
        if self.sharing is Sharing.PRIVATE:
            return f"private:{self.tenant_id}"
        if self.sharing is Sharing.GROUP:
            return f"group:{self.group}"
        return "public"


class TenantTable:
    """Configured tenants and the small integer slot each one has in per-block arrays.

    Slots are never reused while the daemon runs: a reload that drops a tenant keeps its slot
    (its blocks keep their owner until they are freed) and refuses new work for it.
    """

    def __init__(self, policies: list[TenantPolicy] | tuple[TenantPolicy, ...] = ()) -> None:
        self._slots: dict[str, int] = {}
        self.policies: list[TenantPolicy] = []
        self.active: list[bool] = []
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
            else:
                self.policies[slot] = p
                self.active[slot] = True

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
