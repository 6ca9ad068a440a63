"""The daemon's state beyond the core: sessions with leases, credentials, the pool, epochs,
and (with ``state.dir``) the journal and snapshots that let a restarted daemon carry on.

``Daemon`` is what the servicer calls. Everything here runs on the server's event loop.

Crash recovery (docs/decisions.md, "Crash recovery"): every change the daemon applies is
journalled before it is acknowledged: attaches, detaches and reaps, fence completions, Steps
(the request plus the sequence ids the daemon minted), flushes and tenant reloads. A restart
loads the last snapshot, replays the journal through the same code (``replaying`` skips the
side effects already done: scrubbing, fence-page polls, journal writes), and continues with
the same epoch: workers' block ids, sequences and mapped pool stay valid.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import Config
from blockd.core import snapshot
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
from blockd.server.journal import Journal
from blockd.server.journal import read as read_journal
from blockd.server.state_store import StateStore

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
        self.store = StateStore(cfg.state.dir) if cfg.state.dir else None
        self.journal: Journal | None = None
        #: True while the journal is replayed: side effects already happened once.
        self.replaying = False
        self.generation = 0
        self._snapshot_bytes = 0
        self.snapshots = 0
        self.last_snapshot_seconds = 0.0
        self._saved_sessions: list[tuple[Any, ...]] = []
        saved = self._saved_state()
        self.pool: HostPool | CudaPool
        if saved is not None:
            self.manager = snapshot.load(saved["manager"], on_event=None)
            self.pool = HostPool(self.spec, path=self.store.pool_path,  # type: ignore[union-attr]
                                 reuse=True)
            #: This incarnation of the pool (>= 1): block ids of another epoch mean nothing.
            self.epoch: int = saved["epoch"]
            self.generation = saved["generation"]
            self._saved_sessions = saved["sessions"]
        else:
            self.manager = BlockManager(self.spec, self.tenants.tenants,
                                        enable_prefix_cache=cfg.cache.enable_prefix_cache,
                                        scrub_always=cfg.cache.scrub_always,
                                        preemption=cfg.cache.preemption)
            if cfg.pool.backend == "cuda":
                # Imported here: CPU installs never load cuda-python. CudaPool refuses with the
                # reason (no driver, no device, no VMM) as FAILED_PRECONDITION on pool.backend.
                from blockd.pools.cuda import CudaPool

                self.pool = CudaPool(self.spec, prefault=cfg.pool.prefault)
            else:
                self.pool = HostPool(self.spec, prefault=cfg.pool.prefault,
                                     path=self.store.pool_path if self.store else None)
            self.epoch = int.from_bytes(os.urandom(6), "little") | 1
        self.sessions: dict[str, SessionInfo] = {}
        for saved_session in self._saved_sessions:
            self._restore_session(*saved_session)
        self.draining = False
        self.started = time.time()

    # -- crash recovery ------------------------------------------------------------------------

    def _saved_state(self) -> dict[str, Any] | None:
        """The last snapshot if this daemon can carry on from it; otherwise a clean start."""
        store = self.store
        if store is None:
            return None
        if self.cfg.pool.backend == "cuda":
            # A CUDA VMM allocation dies with the process that created it unless some process
            # still holds an exported handle; the daemon does not re-import workers' handles
            # (docs/decisions.md), so a restart is a new epoch that workers detect.
            log.warning("state.dir is set but the cuda pool cannot outlive the daemon: every "
                        "restart starts a new epoch (workers re-attach and recompute)")
            store.wipe()
            self.store = None
            return None
        try:
            saved = store.read_snapshot()
        except Exception as exc:
            log.error("cannot read the snapshot in %s (%s): starting a new epoch", store.dir,
                      exc)
            store.wipe()
            return None
        if saved is None:
            store.wipe()
            return None
        problem = None
        if saved.get("version") != 1:
            problem = f"snapshot version {saved.get('version')!r}"
        elif saved["spec"] != dataclasses.asdict(self.spec):
            problem = f"the pool was {saved['spec']}, the configuration says {self.spec}"
        elif not os.path.exists(store.pool_path):
            problem = "the pool file is gone"
        if problem is not None:
            log.warning("not recovering from %s: %s; starting a new epoch", store.dir, problem)
            store.wipe()
            return None
        return saved

    def _restore_session(self, sid: str, tenant_id: str, owner: str, worker_name: str,
                         lease_ms: int, last_step_id: int, last_response: bytes | None) -> None:
        # A restarted daemon gives every worker a full lease to reconnect in.
        info = self._session_info(sid, tenant_id, owner, worker_name, lease_ms)
        info.last_step_id = last_step_id
        if last_response is not None:
            info.last_response = pb.StepResponse.FromString(last_response)

    def recover(self, apply_step: Callable[[SessionInfo, pb.StepRequest], pb.StepResponse]
                ) -> None:
        """Replay the journal after the snapshot, then start a new snapshot and journal.

        Called once by the server before it serves, with the servicer's Step application.
        Without ``state.dir`` it only installs the event hook.
        """
        store = self.store
        if store is None:
            self.manager.on_event = self.events.on_core_event
            return
        t0 = time.perf_counter()
        records = 0
        self.replaying = True
        try:
            for record in read_journal(store.journal_path(self.generation)):
                self._replay(record, apply_step)
                records += 1
        finally:
            self.replaying = False
        resumed = bool(self._saved_sessions) or records > 0 or len(self.manager.index) > 0
        if self.cfg.server.check_invariants:
            self.manager.check_invariants()
        # The journal was replayed under the settings it was written with; from here on the
        # configuration of this start applies.
        m = self.manager
        m.enable_prefix_cache = self.cfg.cache.enable_prefix_cache
        m.scrub_always = self.cfg.cache.scrub_always
        m.preempt = self.cfg.cache.preemption == "priority"
        m.on_event = self.events.on_core_event
        if resumed:
            self._announce_index()
        self.manager.minted = []
        self.snapshot()
        table = self.manager.tenants
        active = {p.tenant_id: p for p, on in zip(table.policies, table.active, strict=True) if on}
        if active != {p.tenant_id: p for p in self.tenants.tenants}:
            self.reload_tenants(self.tenants)  # the file changed while the daemon was down
        recovered = {
            "sessions": len(self.sessions), "sequences": len(self.manager.sequences),
            "indexed_blocks": len(self.manager.index), "journal_records": records,
            "seconds": round(time.perf_counter() - t0, 4),
        }
        if resumed:
            log.info("recovered epoch=%d %s", self.epoch,
                     " ".join(f"{k}={v}" for k, v in recovered.items()))

    def _replay(self, record: list[Any],
                apply_step: Callable[[SessionInfo, pb.StepRequest], pb.StepResponse]) -> None:
        kind = record[0]
        m = self.manager
        if kind == "step":
            _, sid, raw, minted = record
            req = pb.StepRequest()
            req.ParseFromString(raw)
            m.replay_ids = deque(minted)
            try:
                apply_step(self.sessions[sid], req)
            finally:
                m.replay_ids = None
        elif kind == "fence":
            m.complete_fence(record[1], record[2])
        elif kind == "attach":
            _, sid, tenant_id, owner, worker_name, lease_ms = record
            self._open_session(sid, tenant_id, owner, worker_name, lease_ms)
        elif kind == "detach":
            self.detach(self.sessions[record[1]], record[2])
        elif kind == "flush":
            m.flush(**record[1])
        elif kind == "tenants":
            m.set_tenants(pickle.loads(record[1]))  # noqa: S301 (our own journal)
        else:
            raise ValueError(f"unknown journal record {kind!r}")

    def _announce_index(self) -> None:
        """KV-event subscribers of the new process: everything they knew may be stale, so
        say so, then list every block the index still holds (parents first)."""
        m = self.manager
        emit = self.events.on_core_event
        emit("all_cleared", {})
        index = m.index
        for key, b in index.map.items():
            emit("stored", {"block": b, "key": key, "parent": index.parent[b],
                            "ns": m.namespaces.get(index.ns[b]), "tokens": index.tokens[b]})

    def record(self, record: list[Any]) -> None:
        """Journal one applied change (no-op without ``state.dir`` and during a replay)."""
        journal = self.journal
        if journal is None or self.replaying:
            return
        journal.append(record)
        if journal.size >= max(self.cfg.state.snapshot_min_bytes, 2 * self._snapshot_bytes):
            self.snapshot()

    def record_step(self, info: SessionInfo, req: pb.StepRequest) -> None:
        minted = self.manager.minted
        if self.journal is not None and not self.replaying:
            self.record(["step", info.id, req.SerializeToString(), list(minted or ())])
        if minted:
            minted.clear()

    def snapshot(self) -> None:
        """Write a snapshot of everything, then start the next journal generation."""
        store = self.store
        if store is None:
            return
        t0 = time.perf_counter()
        state = {
            "version": 1, "spec": dataclasses.asdict(self.spec), "epoch": self.epoch,
            "generation": self.generation + 1, "manager": snapshot.dump(self.manager),
            "sessions": [(i.id, i.tenant_id, i.owner, i.worker_name, i.lease_ms,
                          i.last_step_id, i.last_response.SerializeToString()
                          if i.last_response is not None else None)
                         for i in self.sessions.values()],
        }
        self._snapshot_bytes = store.write_snapshot(state)
        self.generation += 1
        if self.journal is not None:
            self.journal.close()
        self.journal = Journal(store.journal_path(self.generation))
        store.remove_journals(keep=self.generation)
        self.snapshots += 1
        self.last_snapshot_seconds = time.perf_counter() - t0
        log.debug("snapshot generation=%d bytes=%d seconds=%.4f", self.generation,
                  self._snapshot_bytes, self.last_snapshot_seconds)

    # -- credentials and tenants ---------------------------------------------------------------

    def _load_tenants(self) -> TenantsFile:
        if self.cfg.tenants.file:
            return tenants_file.load(self.cfg.tenants.file)
        return tenants_file.default(self.spec.num_blocks, self.cfg.tenants.allow_anonymous)

    def reload_tenants(self, fresh: TenantsFile | None = None) -> None:
        """SIGHUP: re-read the tenants file; sessions and blocks are kept."""
        fresh = fresh or self._load_tenants()
        self.manager.set_tenants(fresh.tenants)
        self.record(["tenants", pickle.dumps(list(fresh.tenants))])
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
        info = self._open_session(None, req.tenant_id, principal.name, req.worker_name, lease)
        self.record(["attach", info.id, info.tenant_id, info.owner, info.worker_name, lease])
        log.info("session attached tenant=%s worker=%s lease_ms=%d", req.tenant_id,
                 req.worker_name, lease)
        return info

    def _open_session(self, sid: str | None, tenant_id: str, owner: str, worker_name: str,
                      lease_ms: int) -> SessionInfo:
        core = self.manager.open_session(tenant_id, sid)
        return self._session_info(core.id, tenant_id, owner, worker_name, lease_ms)

    def _session_info(self, sid: str, tenant_id: str, owner: str, worker_name: str,
                      lease_ms: int) -> SessionInfo:
        """The server side of a core session, with a full lease and its fence page."""
        page = FencePage(self.store.fence_path(sid) if self.store else None)
        info = SessionInfo(sid, tenant_id, owner, worker_name, lease_ms,
                           time.monotonic() + lease_ms / 1000, fence_page=page)
        self.sessions[sid] = info
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
        self.record(["detach", info.id, reason])
        if info.fence_page is not None:
            info.fence_page.close(unlink=True)
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
        if info.fence_page is None or self.replaying:
            return
        core = self.manager.sessions[info.id]
        value = info.fence_page.read()
        if value > core.completed:
            # A value beyond the fences announced so far is clamped: completing a fence no
            # Step named would retire blocks on the worker's word alone.
            value = min(value, core.issued)
            if value > core.completed:
                self.complete_fence(info, value)

    def complete_fence(self, info: SessionInfo, fence: int) -> None:
        """The worker's GPU work up to ``fence`` is done (its fence page or a Heartbeat)."""
        if fence > self.manager.sessions[info.id].completed:
            self.manager.complete_fence(info.id, fence)
            self.record(["fence", info.id, fence])
        self.note_fences(info, 0)

    def flush(self, **filters: str | None) -> int:
        n = self.manager.flush(**filters)  # type: ignore[arg-type]
        self.record(["flush", filters])
        return n

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
        """Release this process's handles. With ``state.dir`` the files stay: the next daemon
        carries on with the same epoch, sessions that did not detach, and the cache."""
        for info in self.sessions.values():
            if info.fence_page is not None:
                info.fence_page.close()
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        self.pool.close()
