"""The scheduler side: which prompt blocks blockd holds, pins them, and plans loads and saves.

One blockd session per engine (attached at engine start with the KV shape vLLM's config implies,
so a block-size or layout mismatch refuses to start). vLLM's scheduler thread never waits on
blockd: every call goes through the ``Outbox`` (``blockd_vllm.outbox``), whose thread makes it
and applies its answer under this side's lock; the hooks only read and write plans. Per request:

1. ``on_new_request`` (``new_request``): on an idle engine, owing blockd nothing, the admit
   leaves at once. ``get_num_new_matched_tokens``: the first ask of a request whose admit is not
   in flight queues it and answers None (vLLM skips the request this step and asks again next
   step); the admits of one ``schedule()`` go out in one Step after it (``blockd_vllm.admits``).
   The next ask returns the answer (None again while the Step is in flight; an idle engine's
   ask waits up to ``IDLE_WAIT_S`` for it first, so it does not spin through empty steps, and
   a request whose admit left on arrival runs in the first step; ``blockd_vllm.asking``, the
   asks): blockd's verified
   cached prefix (``num_cached_tokens``, full blocks only, never the last prompt token), *whose
   blocks it holds references to*, so nothing can evict them between this answer and the load;
   the rest of the prompt gets fresh blocks to save into. The external hit is what blockd holds
   beyond vLLM's own local hit. With a remote tier on the daemon, the admit may be answered
   "pending" (blockd is fetching the prefix from the cluster): the answer is ``(n, True)``, vLLM's
   async-load path (``blockd_vllm.remote_loads``): the request waits in
   ``WAITING_FOR_REMOTE_KVS`` while the admit is asked again each step (at most
   ``remote_wait_s``), the step after its answer loads what arrived and reports the request
   in ``finished_recving``, and every promised block that did not arrive is a load error,
   which vLLM computes.
2. ``update_state_after_alloc``: the loads, blockd block -> vLLM block for the external tokens.
3. ``build_connector_meta`` (every step): the saves of prompt blocks this step completes, and
   one Step for the bookkeeping, sent asynchronously (its answer is applied when it arrives;
   the fence a step's metadata names is the latest one blockd answered, so a Step's commits and
   releases complete after the step following its answer, never earlier than its copies).
   Once the workers *reported* every full prompt block saved (``update_connector_output``, a
   step later), Commit (they join blockd's index when that Step's fence completes). Generated
   tokens go the same way (``blockd_vllm.plan``): in the step that computes the K/V of a
   block's last token, the Step appends the block's tokens to the sequence, and the first step
   after its answer saves it; when the request ends, one more Commit publishes them, then
   Release (deferred by the same fence, which the worker publishes after the step's copies).
   A request that ends with a block appended and not saved yet keeps its vLLM blocks
   (``request_finished`` answers True) until the step that saves them, whose worker reports it
   in ``finished_sending``. A request that finishes before its prompt is saved, or whose save
   failed, is released without a (further) commit: only bytes a worker reported written are
   ever hittable.

Faults never change a token and never fail a request: when blockd is unreachable the connector
is *degraded* (every request computes everything; logged once, counted), and it tries again
every ``retry_interval_s``; a new epoch drops every plan of the old one (their blocks are gone)
and carries on with the re-attached session. The scheduler thread's cost is counted:
``schedules``, ``blockd_steps`` (Steps sent) and ``scheduler_ns`` (time spent in this side's
hooks, lock waits included, an idle engine's waits for an answer apart: ``idle_wait_ns``),
reported in vLLM's connector stats (``blockd_vllm.stats``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import requests as rq
from blockd_vllm.admits import Admits
from blockd_vllm.asking import Asks, hook
from blockd_vllm.copies import Copies, Growth
from blockd_vllm.layout import KvShape
from blockd_vllm.link import Link
from blockd_vllm.link_events import LinkEvents, under_lock
from blockd_vllm.metadata import BlockdMetadata, PoolRef
from blockd_vllm.namespace import EngineNamespace
from blockd_vllm.outbox import Steps
from blockd_vllm.placement import bound, engine_side_cpus
from blockd_vllm.plan import Plan
from blockd_vllm.remote_loads import RemoteLoads
from blockd_vllm.resolution import finishing, resolution_ops
from blockd_vllm.settings import Settings
from blockd_vllm.stats import BlockdConnectorStats, SchedulerFigures

log = logging.getLogger("blockd_vllm")


def _cpu_workers() -> bool:
    """Whether this engine's workers hold their KV cache in host memory (vLLM's CPU build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class SchedulerSide(Asks, LinkEvents):
    def __init__(self, vllm_config: Any, settings: Settings, shape: KvShape,
                 block_ids_of: Any = None) -> None:
        self.settings = settings
        self.shape = shape
        self.B = shape.block_size
        self.namespace = EngineNamespace(vllm_config, settings.model_revision)
        #: ``request_id -> vLLM block ids`` (the bound KVCacheManager's ``get_block_ids``).
        self.block_ids_of = block_ids_of
        self.plans: dict[str, Plan] = {}
        #: Sequences to release in the next Step (finished requests, dropped plans).
        self.to_release: list[str] = []
        #: Requests whose plan may be resolvable at the next step.
        self.dirty: set[str] = set()
        self.counters: Counter[str] = Counter()
        self.copies = Copies(self.B, self.counters)
        #: The completed fence the heartbeat thread last reported.
        self._told = 0
        #: Guards everything above; never held while blockd is called (``blockd_vllm.outbox``).
        self._lock = threading.RLock()
        self.admits = Admits(settings, self.namespace, self.B, self.counters,
                             self._release_unused, self._adopt)
        self.remote = RemoteLoads(self.B, self.counters)
        #: The CPUs this side's threads (and gRPC's) run on: off the CPU workers' cores
        #: (``blockd_vllm.placement``; None: wherever the engine core runs).
        self.cpus = engine_side_cpus(vllm_config)
        with bound(self.cpus):
            self.link = Link(settings, shape, self.counters)
            #: The Steps, off the scheduler thread; ``steps.announced``: the fence of the last
            #: one blockd answered (the worker publishes no other).
            self.steps = Steps(self.link, self._lock, self.counters, self._report_done)
        self.figures = SchedulerFigures()
        #: When the last Step was queued (``_bookkeeping_due``); ``schedules`` at the last tick.
        self._last_step = 0.0
        self._ticked = 0
        #: The last step ran a batch.
        self._ran = False
        #: The requests the last step ran, less those finished since: none, and the engine is
        #: idle (a new request's ask then waits for its admit's answer; otherwise it may stop
        #: waiting, ``admit_wait_s``).
        self._running: set[str] = set()
        #: The workers copy saves on a thread of their own (CPU tensors, ``blockd_vllm.copier``)
        #: and report them a step or more later: a request that ends with one in flight keeps
        #: its blocks until it is reported (on CUDA the stream orders them before any reuse).
        self.async_saves = _cpu_workers()
        with bound(self.cpus):
            self.link.start(self)

    @property
    def session(self) -> Any:
        return self.link.session

    @property
    def degraded(self) -> bool:
        return self.link.degraded

    @under_lock
    def tick(self) -> bool:
        """On the heartbeat thread: finish what an idle engine left (one that ran no step
        since the last tick, or whose ``commit_interval_s`` is due); True when the completed
        fence moved (the heartbeat then reports it at once)."""
        stepping = self.counters["schedules"] != self._ticked
        self._ticked = self.counters["schedules"]
        if (self._idle() and not self.steps.outbox.busy and (self.dirty or self.to_release)
                and (not stepping or self._bookkeeping_due())):
            ops, releases = self._resolution_ops()
            if ops:
                self._send(ops, releases, [], [], 0)
        self._report_done()
        done = self.session.state.counter.completed
        moved, self._told = done > self._told, done
        return bool(moved)

    # -- fences the scheduler side may report itself ---------------------------------------------

    def _idle(self) -> bool:
        return self.copies.idle()

    def _report_done(self) -> None:
        """With no copy in flight, every fence announced so far is done: report it with the
        next call (``completed_fence``), so commits and releases of an idle engine complete."""
        if self._idle():
            counter = self.session.state.counter
            counter.completed = max(counter.completed, self.steps.announced)

    # -- the scheduler interface ---------------------------------------------------------------

    @hook
    def after_alloc(self, request: Any, vllm_blocks: list[int], num_external: int) -> None:
        if self.remote.allocated(request.request_id, vllm_blocks):
            return  # loaded once blockd has the blocks
        plan = self.plans.get(request.request_id)
        if plan is None or num_external <= 0:
            return
        first = plan.local_tokens // self.B
        count = num_external // self.B
        plan.loads = [(vllm_blocks[first + i], plan.table[first + i]) for i in range(count)]
        self.counters["load_blocks"] += count

    @hook
    def build_meta(self, so: Any) -> BlockdMetadata:
        """This step's metadata (vLLM keeps stepping while it keeps a finished request's
        blocks, so a held request's append answered late is saved by a later empty step)."""
        self.counters["schedules"] += 1
        self._ran = bool(so.total_num_scheduled_tokens)
        self._running = set(so.num_scheduled_tokens)
        if not self._ran and self.steps.outbox.busy:
            # Nothing runs until blockd answers (an admit, the append of a finished request's
            # last block, a remote fetch): wait for an answer rather than spin.
            answers = self.steps.outbox.answers
            self._idle_wait(lambda: self.steps.outbox.answers != answers)
        meta = BlockdMetadata()
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        grow: list[Growth] = []
        plans, block_ids_of = self.plans, self.block_ids_of
        saving = block_ids_of is not None and not self.degraded
        B = self.B
        for rid, n in so.num_scheduled_tokens.items():
            plan = plans.get(rid)
            if plan is None:
                continue
            done = computed.get(rid, 0)
            if plan.quiet(done + n, B):
                continue  # most decode steps: not even a call
            saves = (lambda rid=rid: block_ids_of(rid)[0]) if saving else None
            if self.copies.plan(meta, rid, plan, done, n, saves, grow):
                self.dirty.add(rid)
        self.dirty.update(self.copies.settle_held(meta, self.plans, self.degraded, grow))
        appends = [rq.append_batch([g.plan.seq_id for g in grow],
                                   [t for g in grow for t in g.tokens],
                                   [len(g.tokens) for g in grow])] if grow else []
        for g in grow:
            g.plan.appending = len(g.tokens)
        self.remote.poll(meta, self.admits, self.plans, self.degraded)
        if meta.load_vllm:
            self.copies.number(meta)  # (a save numbered it already)
        # vLLM freed a running request's blocks: saves still in flight may read them.
        meta.drain = bool(getattr(so, "preempted_req_ids", None)) and not self.copies.idle()
        rids, admits = [], []
        if so.total_num_scheduled_tokens or not finishing(self.plans):
            rids, admits = self.admits.take()
        # else: an otherwise idle engine whose requests just ended (a conversation's next
        # turn arriving at once) asks after their last saves are reported and committed.
        # A busy engine's commits and releases may wait in ``dirty`` for a later Step.
        carry = appends or admits or not so.total_num_scheduled_tokens or self._bookkeeping_due()
        ops, releases = self._resolution_ops() if carry else ([], [])
        if admits and ops and self._idle() and any(o.HasField("commit") for o in ops):
            # An idle engine's own finished commits become hittable before its new admits:
            # the admits go in the next Step, which reports this one's fence done.
            self._send(appends + ops, releases, grow, [], 0)
            ops, releases, grow, appends = [], [], [], []
        if appends or ops or admits:
            self._send(appends + ops + admits, releases, grow, rids, len(admits))
        if self.degraded:
            # Saving into blocks blockd may have lost is pointless (and never committed);
            # loads of blocks the worker maps stay safe (its mapping holds the bytes).
            meta.save_vllm.clear()
            meta.save_blockd.clear()
        state = self.session.state
        meta.pool = PoolRef(state.session_id, state.epoch,
                            state.attach.pool.handle_socket_path, self.link.generation,
                            fetch_secret=state.fetch_secret)
        meta.fence = self.steps.announced
        return meta

    def _bookkeeping_due(self) -> bool:
        """Whether a step that runs work may send a Step of commits and releases alone now
        (``commit_interval_s``; a step that runs none sends them at once: the engine may be
        ending)."""
        every = self.settings.commit_interval_s
        return every == 0 or (not self.steps.outbox.busy
                              and time.monotonic() - self._last_step >= every)

    def _resolution_ops(self) -> tuple[list[pb.Operation], list[str]]:
        """Commits and releases of every plan that is done, and pending releases
        (``blockd_vllm.resolution``)."""
        return resolution_ops(self.plans, self.dirty, self.to_release, self.session.epoch,
                              self.B, self.counters)

    # -- Steps, off the scheduler thread --------------------------------------------------------

    def _send(self, ops: list[pb.Operation], releases: list[str], grow: list[Growth],
              rids: list[str], num_admits: int) -> None:
        """Queue one Step; its answer is applied in order when it arrives."""
        self._last_step = time.monotonic()
        def then(outcome: Any, new_epoch: bool) -> None:
            if outcome is None and not new_epoch:
                self.to_release.extend(releases)  # not applied: again once blockd answers
            results = outcome.results if outcome is not None else None
            if grow:
                self.dirty |= self.copies.grown(grow, results[0] if results is not None else None)
            if rids:
                asked = self.admits.resend(rids) if outcome is None and new_epoch else rids
                tail = results[len(results) - num_admits:] if results is not None else None
                no_room, pending = self.admits.answered(asked, tail, self.session)
                for request in no_room:
                    self._hit_only(request)
                for request, blocks in pending:
                    self._promise(request, blocks)
        self.steps.send(ops, then)

    @hook
    def saves_reported(self, report: Any) -> None:
        """A step's save report from the workers (``update_connector_output``)."""
        if report is not None:
            self.dirty |= self.copies.reported(report, self.plans)

    @hook
    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """The request ended: its plan is released (after a commit, when its saves were all
        handed out and are reported done) in a later Step. True: vLLM keeps the request's
        blocks (``block_ids``) until steps appended and saved every full block of it whose
        K/V was computed, or a save of it still on a worker's copy thread is reported
        (``Copies.hold``, ``Copies.settle_held``)."""
        rid = request.request_id
        self._running.discard(rid)
        self.admits.finished(rid)  # aborted while its admit was asked or in flight
        if self.remote.finished(rid):
            return False  # aborted while it waited for a remote fetch
        plan = self.plans.get(rid)
        if plan is None:
            return False
        plan.finished = True
        self.dirty.add(rid)
        in_flight = self.async_saves and bool(plan.pending)
        return self.copies.hold(plan, int(request.num_computed_tokens), block_ids,
                                gone=self.degraded, in_flight=in_flight)

    @under_lock
    def take_stats(self) -> BlockdConnectorStats:
        """The scheduler thread's figures since the last call (``blockd_vllm.stats``)."""
        return self.figures.take(self.counters)

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until every call queued so far is answered and applied (tests, shutdown)."""
        return self.steps.outbox.wait_idle(timeout)

    def close(self) -> None:
        self.steps.outbox.close(timeout=self.settings.rpc_timeout_s * 2)
        self.link.close()
