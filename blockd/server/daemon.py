"""The daemon's state beyond the core: sessions with leases, credentials, the pool, epochs.

``Daemon`` is what the servicer calls. Everything here runs on the server's event loop.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import Config
from blockd.core.errors import (
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from blockd.core.manager import BlockManager
from blockd.core.spec import PoolSpec
from blockd.pools.fences import PAGE_BYTES, FencePage
from blockd.pools.host import HostPool

if TYPE_CHECKING:
    from blockd.pools.cuda import CudaPool
from blockd.server import tenants_file
from blockd.server.events import EventLog
from blockd.server.tenants_file import Principal, TenantsFile

log = logging.getLogger("blockd.daemon")


@dataclass(slots=True)
class SessionInfo:
    """What the server knows about a session besides the core's view."""

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


def pool_spec(cfg: Config) -> PoolSpec:
    p = cfg.pool
    return PoolSpec(block_size=p.block_size, num_blocks=p.num_blocks, num_layers=p.num_layers,
                    num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, dtype=p.dtype,
                    tp_size=p.tp_size)


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.spec = pool_spec(cfg)
        if cfg.pool.backend not in ("host", "cuda"):
            raise FailedPrecondition(
                f"pool backend {cfg.pool.backend!r} is unknown; use 'host' or 'cuda'",
                field="pool.backend")
        self.tenants = self._load_tenants()
        self.events = EventLog(block_size=self.spec.block_size)
        self.manager = BlockManager(self.spec, self.tenants.tenants,
                                    enable_prefix_cache=cfg.cache.enable_prefix_cache,
                                    scrub_always=cfg.cache.scrub_always,
                                    on_event=self.events.on_core_event)
        self.pool: HostPool | CudaPool
        if cfg.pool.backend == "cuda":
            # Imported here: CPU installs never load cuda-python. CudaPool refuses with the
            # reason (no driver, no device, no VMM) as FAILED_PRECONDITION on pool.backend.
            from blockd.pools.cuda import CudaPool

            self.pool = CudaPool(self.spec, prefault=cfg.pool.prefault)
        else:
            self.pool = HostPool(self.spec, prefault=cfg.pool.prefault)
        #: This incarnation of the pool (>= 1): block ids of another epoch mean nothing here.
        self.epoch = int.from_bytes(os.urandom(6), "little") | 1
        self.sessions: dict[str, SessionInfo] = {}
        self.draining = False
        self.started = time.time()

    # -- credentials and tenants ---------------------------------------------------------------

    def _load_tenants(self) -> TenantsFile:
        if self.cfg.tenants.file:
            return tenants_file.load(self.cfg.tenants.file)
        return tenants_file.default(self.spec.num_blocks, self.cfg.tenants.allow_anonymous)

    def reload_tenants(self) -> None:
        """SIGHUP: re-read the tenants file; sessions and blocks are kept."""
        fresh = self._load_tenants()
        self.manager.set_tenants(fresh.tenants)
        self.tenants = fresh
        log.info("tenants reloaded tenants=%d workers=%d", len(fresh.tenants), len(fresh.workers))

    def authenticate(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> Principal:
        token = None
        for key, value in metadata or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                if scheme.lower() != "bearer":
                    token = ""
        return self.tenants.authenticate(token)

    # -- sessions ------------------------------------------------------------------------------

    def attach(self, principal: Principal, req: pb.AttachRequest) -> SessionInfo:
        if self.draining:
            raise Unavailable("the daemon is draining; attach to its replacement")
        principal.require_tenant(req.tenant_id)
        if req.tenant_id not in self.manager.tenants:
            raise PermissionDenied("this credential may not act for that tenant",
                                   field="tenant_id")
        lc = self.cfg.lease
        lease = req.lease_ms or lc.default_ms
        lease = max(lc.min_ms, min(lc.max_ms, lease))
        resume = req.resume_session_id
        if resume and resume in self.sessions:
            info = self.sessions[resume]
            if info.owner != principal.name or info.tenant_id != req.tenant_id:
                raise PermissionDenied("that session belongs to another worker",
                                       field="resume_session_id")
            info.lease_ms = lease
            self.renew(info)
            return info
        if len(self.sessions) >= self.cfg.server.max_sessions:
            raise ResourceExhausted("the daemon's session limit is reached", reason="sessions")
        page = FencePage()
        core = self.manager.open_session(req.tenant_id)
        info = SessionInfo(core.id, req.tenant_id, principal.name, req.worker_name, lease,
                           time.monotonic() + lease / 1000, fence_page=page)
        self.sessions[core.id] = info
        log.info("session attached tenant=%s worker=%s lease_ms=%d", req.tenant_id,
                 req.worker_name, lease)
        return info

    def session(self, principal: Principal, session_id: str, epoch: int | None = None
                ) -> SessionInfo:
        """The caller's session; NOT_FOUND, PERMISSION_DENIED or a stale-epoch error."""
        info = self.sessions.get(session_id)
        if info is None:
            raise NotFound("unknown or expired session", field="session_id")
        if info.owner != principal.name and not principal.admin:
            raise PermissionDenied("the session belongs to another worker", field="session_id")
        if epoch is not None and epoch != self.epoch:
            raise FailedPrecondition(
                f"epoch {epoch} is stale (current {self.epoch}): re-attach", field="epoch")
        return info

    def renew(self, info: SessionInfo) -> None:
        info.expires_at = time.monotonic() + info.lease_ms / 1000

    def detach(self, info: SessionInfo, reason: str) -> int:
        self.poll_fence(info)  # whatever the worker published last still counts for commits
        released = self.manager.close_session(info.id)
        del self.sessions[info.id]
        if info.fence_page is not None:
            info.fence_page.close()
        log.info("session closed tenant=%s worker=%s reason=%s sequences=%d", info.tenant_id,
                 info.worker_name, reason, released)
        return released

    def reap(self) -> int:
        """Close every session whose lease has expired; returns how many."""
        now = time.monotonic()
        expired = [i for i in self.sessions.values() if i.expires_at < now]
        for info in expired:
            self.detach(info, "lease expired")
        return len(expired)

    def poll_fence(self, info: SessionInfo) -> None:
        """Apply the fence the worker published in its fence page, if it advanced."""
        if info.fence_page is None:
            return
        core = self.manager.sessions[info.id]
        value = info.fence_page.read()
        if value > core.completed:
            # A value beyond the fences announced so far is clamped: completing a fence no
            # Step named would retire blocks on the worker's word alone.
            value = min(value, core.issued)
            if value > core.completed:
                self.manager.complete_fence(info.id, value)
                self.note_fences(info, 0)

    def poll_fences(self) -> None:
        for info in list(self.sessions.values()):
            self.poll_fence(info)

    def handle_for(self, session_id: str) -> tuple[dict[str, object], list[int]] | None:
        """What the handle server sends a session's worker (called from its thread)."""
        info = self.sessions.get(session_id)
        if info is None or info.fence_page is None:
            return None
        spec = self.spec
        header: dict[str, object] = {
            "epoch": self.epoch, "backend": self.pool.backend, "pool_bytes": self.pool.size,
            "num_blocks": spec.num_blocks, "block_size": spec.block_size,
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "dtype": spec.dtype, "tp_size": spec.tp_size,
            "fence_page_bytes": PAGE_BYTES,
        }
        if self.pool.backend == "cuda":
            # One exported VMM handle per tensor-parallel shard, in device order, then the
            # fence page (see blockd_client.cuda_view).
            header.update(self.pool.header())  # type: ignore[union-attr]
            return header, [*self.pool.fds, info.fence_page.fd]  # type: ignore[union-attr]
        return header, [self.pool.fd, info.fence_page.fd]  # type: ignore[union-attr]

    def note_fences(self, info: SessionInfo, fence: int) -> None:
        """Track when fences were announced (for the oldest-pending-fence age metric)."""
        completed = self.manager.sessions[info.id].completed
        times = info.fence_times
        while times and times[0][0] <= completed:
            times.popleft()
        if fence and (not times or times[-1][0] < fence):
            times.append((fence, time.monotonic()))

    def oldest_pending_fence_age(self) -> float:
        now = time.monotonic()
        oldest = now
        for info in self.sessions.values():
            core = self.manager.sessions.get(info.id)
            if core is None or not core.waiting:
                continue
            first = core.waiting[0][0]
            for f, t in info.fence_times:
                if f >= first:
                    oldest = min(oldest, t)
                    break
        return now - oldest

    def close(self) -> None:
        for info in self.sessions.values():
            if info.fence_page is not None:
                info.fence_page.close()
        self.pool.close()
