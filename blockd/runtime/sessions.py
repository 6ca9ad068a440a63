"""Sessions as the daemon sees them: credentials, leases, fence pages and the last answer.

The core keeps a session's sequences and fences; this module keeps what only the daemon needs:
who owns the session (authentication, then ownership on every call), its lease (renewed by
every call, reaped when it expires), its fence page (which the worker writes and the daemon
polls), the fences' announce times (for the oldest-pending-fence metric) and the last Step's
answer (a retried step_id is answered, not reapplied).

Every change is journalled through ``record`` (``blockd.runtime.recovery``; a no-op without
``state.dir`` and while the journal is replayed). Fences follow one rule, the core's: a value
read from the worker's fence page is clamped to the fences issued so far (a worker cannot
retire blocks no Step named); a fence an RPC reports (Heartbeat) beyond them is refused.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from blockd import logs
from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import LeaseConfig
from blockd.core.contract import KVManager
from blockd.core.errors import FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted
from blockd.pools.fences import FencePage
from blockd.runtime import fds
from blockd.runtime.journal_records import (
    AttachRecord,
    DetachRecord,
    FenceRecord,
    Record,
    RevokeRecord,
)
from blockd.runtime.state_store import StateStore
from blockd.runtime.tenants_file import Principal, TenantsFile

log = logging.getLogger("blockd.sessions")

#: Closed revoked sessions remembered, to tell their next call why (oldest forgotten first).
MAX_REVOKED = 4096
#: Sessions closed by their own Detach remembered, so that a call of another holder of the
#: session (the vLLM scheduler side, after its worker detached at shutdown) is told so instead
#: of NOT_FOUND, the answer on which a client re-attaches (oldest forgotten first).
MAX_DETACHED = 4096

#: What a snapshot keeps of a session: id, tenant, owner, worker name, lease, last step id and
#: the last answer's bytes.
SavedSession = tuple[str, str, str, str, int, int, bytes | None]


@dataclass(slots=True)
class SessionInfo:
    """What the daemon knows about a session besides the core's view."""

    id: str
    tenant_id: str
    owner: str
    worker_name: str
    lease_ms: int
    expires_at: float
    last_step_id: int = 0
    last_response: pb.StepResponse | None = None
    #: (fence, monotonic time it was announced), oldest first, until completed.
    fence_times: deque[tuple[int, float]] = field(default_factory=deque)
    #: Where the worker publishes its completed fence (polled by the daemon).
    fence_page: FencePage | None = None
    #: Why a tenants reload ended the session ("" while it is live): see ``Sessions.revoke``.
    revoked: str = ""


class Sessions:
    """The attached sessions of one epoch. Runs on the daemon's event loop."""

    def __init__(self, manager: KVManager, *, epoch: int, tenants: TenantsFile,
                 lease: LeaseConfig, max_sessions: int, store: StateStore | None,
                 record: Callable[[Record], None], fd_budget: fds.FdBudget | None = None,
                 fence_slots: int = 1) -> None:
        self.m = manager
        #: Fence completions applied so far (any session's): the fence poller reads it to tell
        #: progress from an idle wait (``server.app.poll_fences``).
        self.fences_completed = 0
        #: Slots of a fence page (the pool's tensor-parallel shards): one rank's worker each.
        self.fence_slots = fence_slots
        self.epoch = epoch
        #: Credentials (and the tenants they may act for); replaced by a reload.
        self.tenants = tenants
        self.lease = lease
        self.max_sessions = max_sessions
        self.store = store
        self.record = record
        #: What sessions may take of the process's file descriptors (``blockd.runtime.fds``).
        self.fd_budget = fd_budget
        self._by_id: dict[str, SessionInfo] = {}
        #: Attached sessions by tenant (each tenant's share of the descriptors).
        self._per_tenant: Counter[str] = Counter()
        #: Closed revoked sessions -> why (the last ``MAX_REVOKED``): their next call says why.
        self._revoked: dict[str, str] = {}
        #: Sessions closed by a Detach -> their credential's name (the last ``MAX_DETACHED``).
        self._detached: dict[str, str] = {}
        #: Seconds the daemon itself did not run (see ``now``), and the reaper's last run (or
        #: this object's creation: a stall before the first run counts too).
        self._stalled = 0.0
        self._last_reap = time.monotonic()

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[SessionInfo]:
        return iter(list(self._by_id.values()))

    def find(self, session_id: str) -> SessionInfo | None:
        return self._by_id.get(session_id)

    def now(self) -> float:
        """The daemon's *alive time*: the monotonic clock less every stall of the daemon.

        Leases are measured on it, so a lease only runs while the daemon runs. A stall is time
        the reaper ran later than its interval: the process was stopped (SIGSTOP, a VM pause,
        swapping) or the event loop was held (a flood of calls queued before the workers'
        heartbeats). During a stall a worker's heartbeat cannot get in, so a lease that
        expired then says nothing about the worker: every lease is extended by the stall,
        and a worker that kept heartbeating is never reaped because the daemon did not listen.
        """
        return time.monotonic() - self._stalled

    # -- credentials ---------------------------------------------------------------------------

    def authenticate(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> Principal:
        """The caller named by an ``authorization: Bearer <token>`` header (or anonymous)."""
        token = None
        for key, value in metadata or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                if scheme.lower() != "bearer":
                    token = ""
        return self.tenants.authenticate(token)

    def get(self, principal: Principal, session_id: str, epoch: int | None = None, *,
            revoked_ok: bool = False) -> SessionInfo:
        """The caller's session: owned by its credential (the name, unique in the tenants
        file), which must still act for the session's tenant. NOT_FOUND, PERMISSION_DENIED,
        FAILED_PRECONDITION for a session a reload revoked (unless ``revoked_ok``: a Detach)
        or a stale epoch, and for a worker's call (one naming its ``epoch``) of a session its
        credential detached: a client re-attaches on NOT_FOUND (a reaped session, a restarted
        daemon), never after a Detach. Another credential gets NOT_FOUND, the unknown id's
        answer."""
        info = self._by_id.get(session_id)
        if info is None:
            if session_id in self._revoked:
                raise FailedPrecondition(f"the session was ended by a tenants reload "
                                         f"({self._revoked[session_id]}): attach again",
                                         field="session_id")
            if epoch is not None and self._detached.get(session_id) == principal.name:
                raise FailedPrecondition("the session was detached: attach a new one to go on",
                                         field="session_id")
            raise NotFound("unknown or expired session", field="session_id")
        if info.owner != principal.name and not principal.admin:
            raise PermissionDenied("the session belongs to another credential",
                                   field="session_id")
        if info.revoked and not revoked_ok:
            raise FailedPrecondition(f"the session was ended by a tenants reload "
                                     f"({info.revoked}): attach again", field="session_id")
        if not (principal.admin or info.revoked) and info.tenant_id not in principal.tenants:
            raise PermissionDenied("this credential may no longer act for the session's "
                                   "tenant", field="session_id")
        if epoch is not None and epoch != self.epoch:
            raise FailedPrecondition(
                f"epoch {epoch} is stale (current {self.epoch}): re-attach", field="epoch")
        return info

    def owning(self, principal: Principal, session_id: str, sequence_id: str) -> SessionInfo:
        """The named session (the caller's own, ``get``); or, with ``session_id`` empty (an
        operator's blockctl), the session holding ``sequence_id`` when it acts for one of the
        caller's tenants (any, for an admin). Another tenant's sequence is NOT_FOUND with the
        very answer an unknown id gets: a listing or an inspection never reveals it exists."""
        if session_id:
            return self.get(principal, session_id)
        found = self.m.sequence_session(sequence_id)
        info = self._by_id.get(found) if found is not None else None
        if info is None or not (principal.admin or info.tenant_id in principal.tenants):
            raise NotFound("unknown sequence", field="sequence_id")
        return info

    # -- attach, detach, leases ----------------------------------------------------------------

    def attach(self, principal: Principal, tenant_id: str, worker_name: str, lease_ms: int,
               resume_session_id: str = "") -> SessionInfo:
        """A new session (journalled), or the caller's own session ``resume_session_id``."""
        principal.require_tenant(tenant_id)
        if not self.m.has_tenant(tenant_id):
            raise PermissionDenied("this credential may not act for that tenant",
                                   field="tenant_id")
        lc = self.lease
        lease = max(lc.min_ms, min(lc.max_ms, lease_ms or lc.default_ms))
        if resume_session_id and resume_session_id in self._by_id:
            info = self._by_id[resume_session_id]
            if info.owner != principal.name or info.tenant_id != tenant_id:
                raise PermissionDenied("that session belongs to another credential",
                                       field="resume_session_id")
            if info.revoked:
                raise FailedPrecondition(f"that session was ended by a tenants reload "
                                         f"({info.revoked})", field="resume_session_id")
            info.lease_ms = lease
            self.renew(info)
            return info
        if len(self._by_id) >= self.max_sessions:
            raise ResourceExhausted("the daemon's session limit is reached", reason="sessions")
        if self.fd_budget is not None:
            self.fd_budget.admit(tenant_id, self._per_tenant)
        info = self.open(None, tenant_id, principal.name, worker_name, lease)
        self.record(AttachRecord(info.id, info.tenant_id, info.owner, info.worker_name, lease))
        log.info("session attached", extra=logs.fields(tenant=tenant_id, worker=worker_name,
                                                       lease_ms=lease))
        return info

    def open(self, sid: str | None, tenant_id: str, owner: str, worker_name: str,
             lease_ms: int) -> SessionInfo:
        """Open the core session too (an attach, or its journal record replayed). A fence page
        that cannot be opened for want of descriptors is RESOURCE_EXHAUSTED ``fds``, and the
        core session is closed again: nothing changed."""
        sid = self.m.open_session(tenant_id, sid)
        try:
            return self._add(sid, tenant_id, owner, worker_name, lease_ms)
        except OSError as exc:
            self.m.close_session(sid)
            refusal = fds.exhausted(exc)
            if refusal is None:
                raise
            raise refusal from None

    def restore(self, saved: SavedSession) -> None:
        """A session of a snapshot (the core session is in the manager's snapshot). A
        restarted daemon gives every worker a full lease to reconnect in."""
        sid, tenant_id, owner, worker_name, lease_ms, last_step_id, last_response = saved
        info = self._add(sid, tenant_id, owner, worker_name, lease_ms)
        info.last_step_id = last_step_id
        if last_response is not None:
            info.last_response = pb.StepResponse.FromString(last_response)

    def saved(self) -> list[SavedSession]:
        """What a snapshot keeps of every session (see ``restore``)."""
        return [(i.id, i.tenant_id, i.owner, i.worker_name, i.lease_ms, i.last_step_id,
                 i.last_response.SerializeToString() if i.last_response is not None else None)
                for i in self._by_id.values()]

    def saved_revoked(self) -> dict[str, str]:
        """What a snapshot keeps of the closed revoked sessions (see ``restore_revoked``)."""
        return dict(self._revoked)

    def restore_revoked(self, revoked: dict[str, str]) -> None:
        """The closed revoked sessions of a snapshot, oldest first (the last ``MAX_REVOKED``)."""
        for sid, why in list(revoked.items())[-MAX_REVOKED:]:
            self._revoked[str(sid)] = str(why)

    def _add(self, sid: str, tenant_id: str, owner: str, worker_name: str,
             lease_ms: int) -> SessionInfo:
        """The daemon's side of a core session, with a full lease and its fence page."""
        page = FencePage(self.store.fence_path(sid) if self.store else None)
        info = SessionInfo(sid, tenant_id, owner, worker_name, lease_ms,
                           self.now() + lease_ms / 1000, fence_page=page)
        self._by_id[sid] = info
        self._per_tenant[tenant_id] += 1
        return info

    def renew(self, info: SessionInfo) -> None:
        info.expires_at = self.now() + info.lease_ms / 1000

    def detach(self, info: SessionInfo, reason: str, *, poll_fence: bool = True) -> int:
        """Close the session and release its sequences; returns how many.

        ``poll_fence``: first apply what the worker published last (it still counts for
        commits). A journal replay passes False: the fences it saw are journal records.
        """
        if poll_fence:
            self.poll_fence(info)
        released = self.m.close_session(info.id)
        del self._by_id[info.id]
        self._per_tenant[info.tenant_id] -= 1
        if info.revoked:
            self._revoked[info.id] = info.revoked
            if len(self._revoked) > MAX_REVOKED:
                del self._revoked[next(iter(self._revoked))]
        elif reason == "detach":
            self._detached[info.id] = info.owner
            if len(self._detached) > MAX_DETACHED:
                del self._detached[next(iter(self._detached))]
        self.record(DetachRecord(info.id, reason))
        if info.fence_page is not None:
            info.fence_page.close(unlink=True)
        log.info("session closed", extra=logs.fields(tenant=info.tenant_id,
                                                     worker=info.worker_name, reason=reason,
                                                     sequences=released))
        return released

    def reap(self) -> int:
        """Close every session whose lease has expired in alive time (``now``); returns how
        many. Called every ``lease.reap_interval_ms``: the time past that since its last run is
        a stall of the daemon, taken out of alive time first."""
        t = time.monotonic()
        late = t - self._last_reap - self.lease.reap_interval_ms / 1000
        if late > 0:
            self._stalled += late
            if late > 1.0:
                log.warning("the daemon stalled: leases extended by the stall",
                            extra=logs.fields(stall_s=round(late, 3)))
        self._last_reap = t
        now = self.now()
        expired = [i for i in self._by_id.values() if i.expires_at < now
                   or (i.revoked and self.m.session_view(i.id).oldest_waiting_fence is None)]
        for info in expired:
            self.detach(info, "revoked" if info.revoked else "lease expired")
        return len(expired)

    # -- revocation (a tenants reload) --------------------------------------------------------

    def revocations(self, fresh: TenantsFile) -> list[tuple[SessionInfo, str]]:
        """The live sessions ``fresh`` ends, each with why: its tenant is gone, its credential
        is gone, or the credential no longer acts for the tenant."""
        creds = {w.name: w.tenants for w in fresh.workers}
        if fresh.anonymous is not None:
            creds[fresh.anonymous.name] = fresh.anonymous.tenants
        configured = {p.tenant_id for p in fresh.tenants}
        out = []
        for info in self._by_id.values():
            if info.revoked:
                continue
            if info.tenant_id not in configured:
                out.append((info, f"tenant {info.tenant_id!r} was removed"))
            elif info.owner not in creds:
                out.append((info, f"credential {info.owner!r} was removed"))
            elif info.tenant_id not in creds[info.owner]:
                out.append((info, f"credential {info.owner!r} may no longer act for tenant "
                                  f"{info.tenant_id!r}"))
        return out

    def revoke(self, info: SessionInfo, reason: str) -> int:
        """End a session a reload took the rights of (journalled): its sequences are released
        under its fences and its unconfirmed commits dropped (``BlockManager.revoke_session``);
        every later call but a Detach is FAILED_PRECONDITION naming ``reason``; the reaper
        closes it once its fences complete (its fence page is still polled) or its lease
        expires. Returns the sequences released."""
        released = self.m.revoke_session(info.id)
        info.revoked = reason
        self.record(RevokeRecord(info.id, reason))
        log.warning("session revoked", extra=logs.fields(
            tenant=info.tenant_id, worker=info.worker_name, reason=reason, sequences=released))
        return released

    # -- fences --------------------------------------------------------------------------------

    def poll_fence(self, info: SessionInfo) -> None:
        """Apply the fence the worker published in its fence page, clamped to those issued."""
        if info.fence_page is None:
            return
        value = info.fence_page.read(self.fence_slots)
        if value:
            self._completed(info, self.m.complete_fence(info.id, value, clamp_to_issued=True))

    def poll_fences(self) -> bool:
        """Read the fence page of every session that has a fence announced and not completed
        (an idle session's page is not read); True while one still has."""
        pending = False
        for info in list(self._by_id.values()):
            if info.fence_page is None or not self._fence_pending(info):
                continue
            self.poll_fence(info)
            pending = pending or self._fence_pending(info)
        return pending

    def _fence_pending(self, info: SessionInfo) -> bool:
        view = self.m.session_view(info.id)
        return view.issued_fence > view.completed_fence

    def complete_fence(self, info: SessionInfo, fence: int) -> None:
        """A fence the worker reported by RPC (Heartbeat): beyond those issued is refused."""
        self._completed(info, self.m.complete_fence(info.id, fence))

    def _completed(self, info: SessionInfo, done: int) -> None:
        if done:
            self.fences_completed += 1
            self.record(FenceRecord(info.id, done))
            self._note_fences(info, 0)

    def stepped(self, info: SessionInfo, req: pb.StepRequest, resp: pb.StepResponse) -> None:
        """After a Step was applied: its fence's announce time, its answer, a renewed lease."""
        self._note_fences(info, req.fence)
        info.last_step_id = req.step_id
        info.last_response = resp
        self.renew(info)

    def _note_fences(self, info: SessionInfo, fence: int) -> None:
        """Track when fences were announced (for the oldest-pending-fence age metric)."""
        completed = self.m.session_view(info.id).completed_fence
        times = info.fence_times
        while times and times[0][0] <= completed:
            times.popleft()
        if fence and (not times or times[-1][0] < fence):
            times.append((fence, time.monotonic()))

    def oldest_pending_fence_age(self) -> float:
        """Seconds since the oldest fence that still holds blocks back was announced."""
        now = time.monotonic()
        oldest = now
        for info in self._by_id.values():
            first = self.m.session_view(info.id).oldest_waiting_fence
            if first is None:
                continue
            for f, t in info.fence_times:
                if f >= first:
                    oldest = min(oldest, t)
                    break
        return now - oldest

    def close(self) -> None:
        """Unmap the fence pages (their files stay for the next daemon with ``state.dir``)."""
        for info in self._by_id.values():
            if info.fence_page is not None:
                info.fence_page.close()
