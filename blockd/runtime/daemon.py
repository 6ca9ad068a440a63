"""The daemon beyond the core: the composition root of one epoch of blockd.

``Daemon`` builds the parts (pool spec, pool, block manager, sequence-id minter, event log,
sessions, crash recovery) and is what the gRPC transport calls: one method per RPC, taking the
authenticated caller and the request message and returning the response message (the runtime
speaks protobuf, never grpc). Each method checks what only the daemon knows (credentials, the
epoch, draining, per-request limits), makes its core calls, journals the change, and converts
the result (``blockd.runtime.convert``). Everything here runs on the server's event loop.

With ``state.dir`` a restarted daemon carries on from its snapshot and journal
(``blockd.runtime.recovery``); ``blockd.runtime.startup.start`` is the one way to get a
recovered daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from blockd import logs
from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import Config
from blockd.core.contract import KVManager
from blockd.core.coordinator import PartitionCoordinator, partition_tiers
from blockd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from blockd.core.events import AllBlocksCleared
from blockd.core.ids import SequenceIds
from blockd.core.tenants import SHARED_PARTITION, partition_layout
from blockd.core.tiering import TierLimits
from blockd.pools.base import Pool
from blockd.runtime import convert, fds, step, tenants_file
from blockd.runtime.budgets import OverBudget, WorkBudgets, charge_key, journal_units
from blockd.runtime.events import EventLog
from blockd.runtime.journal_records import FlushRecord, TenantsRecord
from blockd.runtime.listing import SequenceIndex
from blockd.runtime.pool_handles import PoolHandles
from blockd.runtime.reads import Reads
from blockd.runtime.recovery import Recovery
from blockd.runtime.remote import RemoteTier
from blockd.runtime.sessions import Sessions
from blockd.runtime.state_store import StateStore
from blockd.runtime.step import StepLimits
from blockd.runtime.storage import Storage, check_machine
from blockd.runtime.tenants_file import Principal, TenantsFile

log = logging.getLogger("blockd.daemon")




class Daemon(Reads):
    """One daemon process's state. Build it with ``blockd.runtime.startup.start``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.spec = cfg.pool.spec()
        sc = cfg.server
        self.limits = StepLimits(max_operations_per_step=sc.max_operations_per_step,
                                 max_tokens_per_operation=sc.max_tokens_per_operation,
                                 max_message_bytes=sc.max_message_bytes,
                                 max_work_per_call=sc.max_work_per_call)
        #: Each tenant's work budget (``blockd.runtime.budgets``): one tenant's flood cannot
        #: take the shared event loop from the others.
        self.budgets = WorkBudgets(cfg.tenants.work_units_per_second,
                                   cfg.tenants.work_units_burst)
        self.tenants = self._load_tenants()
        self.budgets.set_overrides(self.tenants.budgets)
        self.events = EventLog()
        self.ids = SequenceIds()
        #: Called after a Step announced a fence (the server's fence poller wakes on it).
        self.on_fence: Callable[[], None] = lambda: None
        #: Failed Step operations and batch entries, by status name (a bounded label set).
        self.op_errors: Counter[str] = Counter()
        layout = partition_layout(self.tenants.tenants, self.spec.num_blocks)
        #: RLIMIT_NOFILE raised and budgeted: limits it cannot meet are refused here.
        self.fds = fds.FdBudget.at_start(cfg, self.tenants.tenants, len(layout))
        self.recovery = Recovery(self._state_store(),
                                 snapshot_min_bytes=cfg.state.snapshot_min_bytes,
                                 reserve_bytes=cfg.state.reserve_bytes)
        store = self.recovery.store
        check_machine(cfg)  # before any tier is built (its index takes memory too)
        host, disk, spills, loads = cfg.tiers.limits(self.spec.slot_bytes)
        limits = TierLimits(host_slots=host, disk_slots=disk, max_spill_blocks=spills,
                            max_load_blocks=loads)
        tiers = partition_tiers(self.tenants.tenants, limits, self.spec.slot_bytes)
        saved = self.recovery.load(self.spec, layout, tiers, ids=self.ids)
        #: One block manager per pool partition behind the manager's contract
        #: (``blockd.core.coordinator``).
        self.partitions: PartitionCoordinator
        if saved is not None and store is not None:
            self.partitions = saved.manager
            #: This incarnation of the pool (>= 1): block ids of another epoch mean nothing.
            self.epoch: int = saved.epoch
        else:
            self.partitions = PartitionCoordinator(
                self.spec, self.tenants.tenants, enable_prefix_cache=cfg.cache.enable_prefix_cache,
                scrub_always=cfg.cache.scrub_always, ids=self.ids,
                preemption=cfg.cache.preemption, tiers=limits)
            self.epoch = int.from_bytes(os.urandom(6), "little") | 1
        #: The same object, as the contract every call outside partition bookkeeping uses.
        self.manager: KVManager = self.partitions
        #: Each partition's own pool (memfd or VMM allocation; a session's worker receives only
        #: its partition's: ``handles``) and lower tiers' stores.
        self.storage = Storage(cfg, self.partitions, state_dir=store.dir if store else None,
                               shared_path=store.pool_path if store else "",
                               reuse=saved is not None)
        self.pools: dict[str, Pool] = self.storage.pools
        #: The tier many nodes share (``blockd.runtime.remote``; started by ``recover``).
        self.remote = (RemoteTier(cfg.tiers, self.partitions, self.pools, self.spec)
                       if cfg.tiers.remote else None)
        self.pool = self.pools[SHARED_PARTITION]
        #: vLLM's medium names: where the blocks live ("GPU" or "CPU").
        self.medium = self.pool.medium
        self.sessions = Sessions(self.manager, epoch=self.epoch, tenants=self.tenants,
                                 lease=cfg.lease, max_sessions=sc.max_sessions, store=store,
                                 record=self.recovery.record, fd_budget=self.fds,
                                 fence_slots=self.spec.tp_size)
        self._resumed = saved is not None and bool(saved.sessions)
        for s in saved.sessions if saved is not None else ():
            self.sessions.restore(s)
        self.sessions.restore_revoked(saved.revoked if saved is not None else {})
        #: What the handle socket sends a session's worker, and the fetch secret it asks for.
        self.handles = PoolHandles(self.sessions, self.pools, self.partitions, self.epoch, store)
        #: Live sequence ids per tenant, sorted: ListSequences pages in O(page).
        self.index = SequenceIndex(self.partitions, self.sessions, self.budgets, self.limits,
                                   self.spec.block_size)
        self.draining = False
        self.started = time.time()

    def start_draining(self) -> None:
        """The drain begins: new sessions are refused, and every event stream ends now (its
        follower, waiting for an event, is woken to see it) instead of at the grace's end."""
        self.draining = True
        self.events.wake()

    def _state_store(self) -> StateStore | None:
        if not self.cfg.state.dir:
            return None
        store = StateStore(self.cfg.state.dir)
        if self.cfg.pool.backend == "cuda":
            # A CUDA VMM allocation dies with the process that created it unless some process
            # still holds an exported handle; the daemon does not re-import workers' handles
            # (docs/decisions.md), so a restart is a new epoch that workers detect.
            log.warning("state.dir is set but the cuda pool cannot outlive the daemon: every "
                        "restart starts a new epoch (workers re-attach and recompute)")
            store.wipe()
            store.close()
            return None
        return store

    def recover(self) -> None:
        """Replay the journal after the snapshot, then start a new snapshot and journal.

        Called once before serving; without ``state.dir`` it only connects the event log.
        """
        t0 = time.perf_counter()
        m = self.manager
        self.storage.replaying()  # the journalled copies moved their bytes when first made
        records = self.recovery.replay(m, self.sessions, self.ids, epoch=self.epoch,
                                       errors=self.op_errors, tier_io=self._replay_tier_io)
        self.storage.connect()
        resumed = self._resumed or records > 0 or m.num_indexed > 0
        self.check()
        # The journal was replayed under the settings it was written with; from here on the
        # configuration of this start applies.
        cc = self.cfg.cache
        m.reconfigure(enable_prefix_cache=cc.enable_prefix_cache, scrub_always=cc.scrub_always,
                      preemption=cc.preemption)
        m.set_event_sink(self.events.on_core_event)
        if resumed:
            # KV-event subscribers of the new process: everything they knew may be stale, so
            # say so, then list every block the index still holds (parents first).
            self.events.on_core_event(AllBlocksCleared())
            for ev in m.indexed_events():
                self.events.on_core_event(ev)
        if self.recovery.enabled:
            self.ids.record()
            self._snapshot()
            self.recovery.check_room()  # too small a state.dir is refused, in one line
        if self.remote is not None:
            self.remote.start(asyncio.get_running_loop(), self.storage, self.recovery,
                              self._after_adopt, self.events.on_core_event)
        self.index.rebuild()
        if m.tenant_policies() != {p.tenant_id: p for p in self.tenants.tenants} \
                or self.sessions.revocations(self.tenants):
            self.reload_tenants(self.tenants)  # the file changed while the daemon was down
        if resumed:
            log.info("recovered", extra=logs.fields(
                epoch=self.epoch, sessions=len(self.sessions), sequences=m.num_sequences,
                indexed_blocks=m.num_indexed, journal_records=records,
                seconds=round(time.perf_counter() - t0, 4)))

    def _replay_tier_io(self, session_id: str, failed: tuple[int, ...], *,
                        tenant_id: str = "") -> None:
        """A replayed record's tier copies answer as they did (``Storage.replay_step``)."""
        parts = self.partitions
        self.storage.replay_step(parts.partition_of_tenant(tenant_id) if tenant_id
                                 else parts.partition_of_session(session_id), failed)

    def _after_adopt(self) -> None:
        self._journalled()
        self.check()

    def _snapshot(self) -> None:
        self.recovery.snapshot(self.partitions, self.sessions, self.spec, self.epoch)

    def _journalled(self) -> None:
        """After a journalled change: compact the journal into a snapshot when it is due. A
        snapshot that cannot be written is deferred (the journal still holds everything): the
        change was journalled, so its caller gets its answer."""
        if self.recovery.due:
            try:
                self._snapshot()
            except OSError as exc:
                log.warning("snapshot deferred: it cannot be written",
                            extra=logs.fields(error=exc.strerror or str(exc)))

    def check(self) -> None:
        """With ``server.check_invariants``: every core invariant, after each call."""
        if self.cfg.server.check_invariants:
            self.check_invariants()

    def check_invariants(self) -> None:
        """Every core invariant (O(num_blocks)); a violation raises
        ``blockd.core.errors.Internal``, also under ``python -O``."""
        self.manager.check_invariants()

    # -- tenants -------------------------------------------------------------------------------

    def _load_tenants(self) -> TenantsFile:
        if self.cfg.tenants.file:
            return tenants_file.load(self.cfg.tenants.file)
        return tenants_file.default(self.spec.num_blocks, self.cfg.tenants.allow_anonymous)

    def reload_tenants(self, fresh: TenantsFile | None = None) -> None:
        """SIGHUP: re-read the tenants file (a bad one raises, naming the field, and the
        previous tenants stay). Sessions and blocks are kept, except that sessions whose tenant
        or credential is gone, or whose credential no longer acts for their tenant, are revoked
        (``Sessions.revoke``), and a removed tenant's private prefixes are flushed."""
        fresh = fresh or self._load_tenants()
        self.partitions.check_tenants(fresh.tenants)  # nothing changes on a refusal
        self.fds.check(self.cfg, fresh.tenants)
        revoked = self.sessions.revocations(fresh)
        for info, reason in revoked:
            self.sessions.revoke(info, reason)
        flushed = self.manager.set_tenants(fresh.tenants)
        self.recovery.record(TenantsRecord(tuple(fresh.tenants)))
        self.tenants = self.sessions.tenants = fresh
        self.budgets.forget({p.tenant_id for p in fresh.tenants})
        self.budgets.set_overrides(fresh.budgets)
        self._journalled()
        log.info("tenants reloaded", extra=logs.fields(
            tenants=len(fresh.tenants), workers=len(fresh.workers),
            sessions_revoked=len(revoked), blocks_flushed=flushed))

    # -- sessions ------------------------------------------------------------------------------

    def attach(self, principal: Principal, req: pb.AttachRequest) -> pb.AttachResponse:
        convert.check_id(req.tenant_id, "tenant_id")
        convert.check_id(req.worker_name, "worker_name", required=False)
        if not req.HasField("layout"):
            raise InvalidArgument("the worker must state its KV layout", field="layout")
        spec = self.spec
        wanted = convert.spec_from_layout(req.layout, spec.num_blocks)
        mismatch = spec.layout_mismatches(wanted)
        if mismatch:
            name = mismatch[0]
            raise FailedPrecondition(
                f"layout mismatch: the pool has {name}={getattr(spec, name)!r}, the worker "
                f"expects {getattr(wanted, name)!r}", field=f"layout.{name}")
        if self.draining:
            raise Unavailable("the daemon is draining; attach to its replacement")
        if not req.resume_session_id:
            self.recovery.require_space(256)  # a new session is new work
        principal.require_tenant(req.tenant_id)
        self.budgets.charge(req.tenant_id, step.ATTACH_UNITS)
        info = self.sessions.attach(principal, req.tenant_id, req.worker_name, req.lease_ms,
                                    req.resume_session_id)
        self._journalled()
        policy = self.manager.tenant_policy(info.tenant_id)
        own = self.partitions.specs[policy.partition]  # what its worker maps and indexes
        return pb.AttachResponse(
            session_id=info.id, epoch=self.epoch, lease_ms=info.lease_ms,
            pool=convert.pool_info(own, self.medium, self.cfg.server.handle_socket),
            tenant_id=info.tenant_id, sharing_domain_kind=convert.sharing_kind(policy),
            fetch_secret=self.handles.secret_of(info.id))

    def detach(self, principal: Principal, req: pb.DetachRequest) -> pb.DetachResponse:
        info = self.sessions.get(principal, req.session_id, revoked_ok=True)
        released = self.sessions.detach(info, "detach")
        self._journalled()
        return pb.DetachResponse(num_sequences_released=released)

    def heartbeat(self, principal: Principal, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        info = self.sessions.get(principal, req.session_id, req.epoch)
        if req.completed_fence:
            self.sessions.complete_fence(info, req.completed_fence)
            self._journalled()
        self.sessions.renew(info)
        expires = time.time() + info.lease_ms / 1000
        return pb.HeartbeatResponse(lease_expires_unix_ms=int(expires * 1000), epoch=self.epoch)

    def reap(self) -> int:
        """Close every session whose lease has expired; returns how many."""
        n = self.sessions.reap()
        if n:
            self._journalled()
        return n

    def poll_fences(self) -> bool:
        """Apply what the workers published in their fence pages; True while a session still
        has a fence announced and not completed (the poller sleeps until the next Step when
        none has: ``server.app.poll_fences``)."""
        pending = self.sessions.poll_fences()
        self._journalled()
        return pending

    # -- Step ----------------------------------------------------------------------------------

    def step(self, principal: Principal, req: pb.StepRequest,
             counts: step.Tally | None = None) -> pb.StepResponse:
        """Check, apply, journal, then zero the scrubbed blocks and answer: nothing is
        acknowledged (and no cached block zeroed) before its record is written, and new work
        is refused before anything is applied when its record may not fit
        (``Recovery.require_space``). ``counts``: the Step's ``step.tally``, when the caller
        already took it."""
        info = self.sessions.get(principal, req.session_id, req.epoch)
        m = self.manager
        recovery = self.recovery
        if recovery.failed is not None:
            recovery.require_space(0)  # UNAVAILABLE: a retry never gets an unjournalled answer
        checked = step.check(info, req, self.limits, self.spec.block_size,
                             m.session_view(info.id), counts)
        if isinstance(checked, pb.StepResponse):
            return checked  # a retry: its earlier answer
        if recovery.enabled:  # ByteSize walks the whole message (~1 ms per MiB)
            recovery.require_space(req.ByteSize() + 64 * len(req.operations))
        self.sessions.renew(info)  # a live worker, even if its Step is refused for rate
        self.budgets.charge(info.tenant_id, checked.units)
        self.sessions.poll_fence(info)
        self.ids.take_minted()  # whatever an earlier failed Step left
        resp = step.apply_step(m, self.sessions, info, req, epoch=self.epoch,
                               limits=self.limits, errors=self.op_errors, remote=self.remote)
        self.index.stepped(info.tenant_id, resp)
        partition = self.partitions.partition_of_session(info.id)
        written = recovery.record_step(info.id, req, resp, self.ids.take_minted(),
                                       self.storage.take_io_failures(partition),
                                       tenant_id=info.tenant_id)
        self.budgets.debit(info.tenant_id, journal_units(written))  # its writer pays for it
        if resp.scrubbed_blocks:  # ids of the session's partition, zeroed in its pool
            self.pools[partition].zero_blocks(list(resp.scrubbed_blocks))
        self._journalled()
        if req.fence:
            self.on_fence()
        return resp

    # -- charging ------------------------------------------------------------------------------

    def gate_key(self, principal: Principal, *, tenant_id: str = "", session_id: str = ""
                 ) -> str:
        """Whose turns a call waits for (``blockd.runtime.fair_gate``): the tenant of the
        session or tenant it names when the caller acts for it, else the caller's own queue
        (``charge_key``), so no caller can queue in another tenant's turns."""
        if session_id:
            info = self.sessions.find(session_id)
            tenant_id = info.tenant_id if info is not None else ""
        return charge_key(principal, tenant_id)

    def charge_bytes(self, principal: Principal, key: str, session_id: str, units: int,
                     need: int = 0) -> None:
        """Before a Step or Lookup is parsed, in its turn: the ``units`` of reading its bytes
        (``budgets.parse_units``, ``scan_units``) from the budget of its gate key, if it holds
        ``need`` (``budgets.reading_need``); refused for rate (nothing parsed), the caller's
        own session still counts as alive, as for a Step refused for rate after parsing."""
        try:
            self.budgets.charge(key, units, need)
        except OverBudget:
            if (info := self.sessions.find(session_id)) and info.owner == principal.name:
                self.sessions.renew(info)
            raise

    # -- events and flushes --------------------------------------------------------------------

    async def watch(self, principal: Principal, since: int
                    ) -> AsyncIterator[pb.WatchEventsResponse]:
        """The block events the caller may see from ``since`` (0: from now on) until the
        daemon drains (``blockd.runtime.events``, "who sees what"): the events of the sharing
        domains of the tenants it acts for, with their token ids (on the laptop default the
        local tenant watches its own); an admin also gets every other event, with other private
        tenants' token ids withheld. Rights are those of the tenants file when the call starts.
        """
        policies = self.manager.tenant_policies()
        domains = [policies[t].sharing_domain for t in principal.tenants if t in policies]
        if not domains and not principal.admin:
            raise PermissionDenied("this credential acts for no tenant, so it has no events "
                                   "to watch", field="authorization")
        audience = self.events.audience(domains, every_domain=principal.admin)
        B = self.spec.block_size
        async for ev in self.events.follow(since, audience, until=lambda: self.draining):
            yield convert.watch_event(ev, epoch=self.epoch, block_size=B, medium=self.medium)

    def flush(self, principal: Principal, req: pb.FlushNamespaceRequest
              ) -> pb.FlushNamespaceResponse:
        for name in ("model_id", "model_revision", "lora_id", "tenant_id"):
            convert.check_id(getattr(req, name), name, required=False)
        if not principal.admin:
            if not req.tenant_id:
                raise PermissionDenied("without an admin credential a flush must name one of "
                                       "the caller's tenants", field="tenant_id")
            principal.require_tenant(req.tenant_id)
        record = FlushRecord(model_id=req.model_id or None,
                             model_revision=req.model_revision or None,
                             lora_id=req.lora_id or None, tenant_id=req.tenant_id or None)
        n = self.manager.flush(**record.filters())
        self.recovery.record(record)
        self._journalled()
        return pb.FlushNamespaceResponse(num_blocks_flushed=n)

    # -- the pool ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release this process's handles. With ``state.dir`` the files stay: the next daemon
        carries on with the same epoch, sessions that did not detach, and the cache."""
        self.sessions.close()
        if self.remote is not None:
            self.remote.close()
        self.recovery.close()
        self.storage.close()
