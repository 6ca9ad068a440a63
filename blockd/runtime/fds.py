"""File descriptors as a budgeted resource: what sessions may take of ``RLIMIT_NOFILE``.

Every session holds ``FDS_PER_SESSION`` descriptors for as long as it is attached (its fence
page's memfd or file, and the duplicate CPython's ``mmap`` keeps of it), and every gRPC
connection one more. A process that runs out answers every later ``open``/``accept`` with
EMFILE, whoever asks: before this budget, two tenants each within their own ``max_sessions``
exhausted the descriptors and every later Attach, any tenant's, failed with INTERNAL.

So, as etcd, Envoy and Redis do at start:

- the soft limit is raised to the hard one (``raise_soft_limit``; Redis' ``maxclients`` does the
  same), and the limit there then is the budget;
- ``RESERVED`` descriptors plus the metrics and handle-socket connections, the pools, and the
  gRPC connections (``grpc_connections``, enforced by gRPC itself:
  ``grpc.max_allowed_incoming_connections``) are kept out of it (``reserve``);
- a configuration whose session limits (``server.max_sessions``, and the tenants'
  ``max_sessions`` summed) need more than the rest is refused at start, in one line naming the
  keys (``FdBudget.check``: Redis lowers ``maxclients`` with a warning instead; refusing keeps
  the promise the configuration makes);
- each tenant has a share of the sessions the descriptors allow (its ``max_sessions``, or, when
  the tenants' sum exceeds what the descriptors allow, its proportional part of them), so that
  no tenant can exhaust another's (``FdBudget.admit``);
- an Attach is refused with RESOURCE_EXHAUSTED (reason ``fds``) when the process's open
  descriptors leave too little headroom, whatever consumed them, and a session whose fence
  page cannot be opened (EMFILE, ENFILE) is refused the same way, never INTERNAL.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from blockd import logs
from blockd.config import Config
from blockd.core.errors import FailedPrecondition, ResourceExhausted
from blockd.core.tenants import TenantPolicy

log = logging.getLogger("blockd.fds")

#: Descriptors one attached session holds: its fence page's fd and the mmap's duplicate.
FDS_PER_SESSION = 2
#: Descriptors kept for the process itself: interpreter, gRPC's pollers and wakeup fds, the
#: listeners and their locks, the journal, snapshots being written, ZMQ's sockets.
RESERVED = 64
#: Per pool partition: its memory (memfd, state-dir file or exported handles) and tiers' files.
PER_PARTITION = 4
#: Headroom an Attach must leave free in the process (a snapshot, a journal rotation).
HEADROOM = 16
#: gRPC connections allowed at least (operators' blockctl, health probes, a few workers).
MIN_CONNECTIONS = 64
#: Errors that mean "no descriptor to be had".
EXHAUSTED = (errno.EMFILE, errno.ENFILE)


def raise_soft_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard one; returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a sandbox may refuse: keep the soft limit
            log.warning("could not raise RLIMIT_NOFILE's soft limit to the hard one",
                        extra=logs.fields(soft=soft, hard=hard, error=str(exc)))
    return soft, hard


def open_fds() -> int | None:
    """Descriptors this process has open now (None where /proc/self/fd is not readable; the
    limit's worth when not even the listing could be opened)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError as exc:
        if exc.errno in EXHAUSTED:
            return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return None


def session_limit(cfg: Config, policies: Iterable[TenantPolicy]) -> int:
    """Sessions the configuration allows at once: ``server.max_sessions``, or fewer when the
    tenants' ``max_sessions`` sum to less."""
    return min(cfg.server.max_sessions, sum(p.max_sessions for p in policies))


def grpc_connections(cfg: Config, policies: Iterable[TenantPolicy]) -> int:
    """gRPC connections allowed at once: one per session the configuration allows, at least
    ``MIN_CONNECTIONS`` (``grpc.max_allowed_incoming_connections``)."""
    return max(MIN_CONNECTIONS, session_limit(cfg, policies))


def reserve(cfg: Config, policies: Iterable[TenantPolicy], partitions: int) -> int:
    """Descriptors kept out of the sessions' budget (module docstring)."""
    return (RESERVED + cfg.metrics.max_connections + cfg.server.handle_connections
            + PER_PARTITION * partitions + grpc_connections(cfg, policies))


@dataclass
class FdBudget:
    """The sessions ``limit`` descriptors allow, and each tenant's share of them."""

    limit: int
    reserved: int
    #: tenant -> most sessions it may hold by descriptors.
    shares: dict[str, int] = field(default_factory=dict)

    @property
    def sessions(self) -> int:
        """Sessions the descriptors outside the reserve allow."""
        return max(0, (self.limit - self.reserved) // FDS_PER_SESSION)

    @classmethod
    def at_start(cls, cfg: Config, policies: Sequence[TenantPolicy], partitions: int
                 ) -> FdBudget:
        """Raise the soft limit, then the budget of ``policies`` (refused as ``check``)."""
        soft, _hard = raise_soft_limit()
        budget = cls(soft, reserve(cfg, policies, partitions))
        budget.check(cfg, policies)  # logged with the "serving" record (``fields``)
        return budget

    def fields(self) -> dict[str, int]:
        """What the "serving" log record says of the budget."""
        return {"rlimit_nofile": self.limit, "fd_reserved": self.reserved,
                "fd_sessions": self.sessions}

    def check(self, cfg: Config, policies: Sequence[TenantPolicy]) -> None:
        """Set the tenants' shares; FAILED_PRECONDITION naming the keys when the session
        limits need more descriptors than there are (nothing changes then)."""
        need = session_limit(cfg, policies)
        cap = self.sessions
        if need > cap or (policies and cap < len(policies)):
            wanted = self.reserved + FDS_PER_SESSION * need
            raise FailedPrecondition(
                f"server.max_sessions / tenants' max_sessions: {need} sessions need {wanted} "
                f"file descriptors ({FDS_PER_SESSION} each + {self.reserved} reserved) but "
                f"RLIMIT_NOFILE is {self.limit}: lower server.max_sessions or the tenants' "
                "max_sessions, or raise the limit (ulimit -n, LimitNOFILE=, the container "
                "runtime's nofile)", field="server.max_sessions")
        total = sum(p.max_sessions for p in policies)
        self.shares = {p.tenant_id: p.max_sessions if total <= cap
                       else max(1, cap * p.max_sessions // total) for p in policies}

    def admit(self, tenant_id: str, held: Mapping[str, int]) -> None:
        """Before a new session of ``tenant_id`` (``held``: sessions by tenant): refused with
        RESOURCE_EXHAUSTED ``fds`` beyond the tenant's share, or when the process has too
        few descriptors left."""
        share = self.shares.get(tenant_id, self.sessions)
        if held.get(tenant_id, 0) >= share:
            raise ResourceExhausted(
                f"fds: tenant {tenant_id!r} holds its share of the daemon's file descriptors "
                f"({share} sessions of the {self.sessions} RLIMIT_NOFILE={self.limit} allows)",
                reason="fds", field="tenant_id")
        now = open_fds()
        if now is not None and now + FDS_PER_SESSION + HEADROOM > self.limit:
            raise ResourceExhausted(
                f"fds: the daemon has {min(now, self.limit)} of its {self.limit} file "
                "descriptors open: retry once sessions detach", reason="fds")


def exhausted(exc: OSError) -> ResourceExhausted | None:
    """The refusal of an ``OSError`` that means no descriptor was to be had, else None."""
    if exc.errno not in EXHAUSTED:
        return None
    return ResourceExhausted(f"fds: the daemon is out of file descriptors "
                             f"({os.strerror(exc.errno or 0)}): retry once sessions detach",
                             reason="fds")
