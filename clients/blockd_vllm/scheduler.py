"""The scheduler side: which prompt blocks blockd holds, pins them, and plans loads and saves.

One blockd session per engine (attached at engine start with the KV shape vLLM's config implies,
so a block-size or layout mismatch refuses to start). Per request:

1. ``get_num_new_matched_tokens``: admit the prompt into blockd (one Step). blockd answers with
   the verified cached prefix (``num_cached_tokens``, full blocks only, never the last prompt
   token) *and holds references to those blocks*, so nothing can evict them between this lookup
   and the load; the rest of the prompt gets fresh blocks to save into. The external hit is
   what blockd holds beyond vLLM's own local hit. With a remote tier on the daemon, the admit
   may instead be answered "pending" (blockd is fetching the prefix from the cluster): the
   answer is None, vLLM's scheduler skips the request this step and asks again next step, for
   at most ``remote_wait_s``; the fetched blocks are then an ordinary hit.
2. ``update_state_after_alloc``: the loads, blockd block -> vLLM block for the external tokens.
3. ``build_connector_meta`` (every step): the saves of prompt blocks this step completes, and
   one Step RPC for the bookkeeping. Once the workers *reported* every full prompt block saved
   (``update_connector_output``, a step later), Commit (they join blockd's index when that
   Step's fence completes). Generated tokens go the same way (``blockd_vllm.plan``): in the
   step that computes the K/V of a block's last token, the Step appends the block's tokens to
   the sequence and the step saves it; when the request ends, one more Commit publishes them,
   then Release (deferred by the same fence, which the worker publishes after the step's
   copies). A request that finishes before its prompt is saved, or whose save failed, is
   released without a (further) commit: only bytes a worker reported written are ever hittable.

Faults never change a token and never fail a request: when blockd is unreachable the connector
is *degraded* (every request computes everything; logged once, counted), and it tries again
every ``retry_interval_s``; a new epoch drops every plan of the old one (their blocks are gone)
and carries on with the re-attached session.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import EpochChanged
from blockd_client import requests as rq
from blockd_vllm.layout import KvShape
from blockd_vllm.link import Link
from blockd_vllm.metadata import BlockdMetadata, PoolRef
from blockd_vllm.namespace import EngineNamespace
from blockd_vllm.plan import Plan
from blockd_vllm.settings import Settings

log = logging.getLogger("blockd_vllm")

class Pending:
    """``_admit``'s answer while blockd fetches the prompt's prefix from its remote tier."""


PENDING = Pending()


@dataclass
class Growth:
    """Generated tokens of one request to append in this step's Step, then save."""

    rid: str
    plan: Plan
    tokens: list[int]
    #: The step saves prompt blocks of the request too (then the workers report it anyway).
    saves: bool


def locked(method: Any) -> Any:
    """Run ``method`` under the side's lock (the heartbeat thread shares the plans)."""
    def run(self: SchedulerSide, *args: Any) -> Any:
        with self._lock:
            return method(self, *args)
    run.__doc__ = method.__doc__
    return run


class SchedulerSide:
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
        #: ``step -> requests`` with saves handed out in that step and not reported yet, so
        #: a save report touches only its own plans.
        self.saving: dict[int, set[str]] = {}
        self.step_no = 0
        #: The last numbered step the workers reported back.
        self.worker_step = 0
        self.counters: Counter[str] = Counter()
        #: Requests answered "pending" (a remote fetch), by when they first were.
        self._waiting: dict[str, float] = {}
        #: The fence of the last Step blockd answered (the worker publishes no other).
        self.announced = 0
        self.link = Link(settings, shape, self.counters)
        self._lock = self.link.lock
        self.link.start(self)

    @property
    def session(self) -> Any:
        return self.link.session

    @property
    def degraded(self) -> bool:
        return self.link.degraded

    # -- what the link tells ------------------------------------------------------------------

    def lost(self) -> None:
        """blockd stopped answering. A plan may still owe vLLM its loads (the tokens were
        promised in this very schedule): it is kept, so they run from the worker's mapping
        (which holds the bytes); it saves and commits nothing more, and is released once
        blockd answers (same epoch) or dropped (new epoch)."""
        for rid, plan in self.plans.items():
            plan.abandoned = True
            self.dirty.add(rid)

    def epoch_changed(self, err: EpochChanged) -> None:
        log.warning("blockd_vllm: blockd's pool epoch changed (%d -> %d): %d plans abandoned, "
                    "their requests compute what they did not load yet", err.old, err.new,
                    len(self.plans))
        self.lost()  # loads still run from the old mapping when the worker has it
        self.to_release.clear()  # sequences of the old epoch no longer exist
        # The new session's fences start again; copies in flight concern the old pool only.
        self.announced = 0
        self.worker_step = self.step_no

    def tick(self) -> bool:
        """On the heartbeat thread: finish what an idle engine left; True when a Step went."""
        flushed = self._flush_if_idle()
        self._report_done()
        return flushed

    # -- fences the scheduler side may report itself ---------------------------------------------

    def _idle(self) -> bool:
        """Every step handed to the workers has been reported back: no copy is in flight."""
        return self.worker_step >= self.step_no

    def _report_done(self) -> None:
        """With no copy in flight, every fence announced so far is done: report it with the
        next call (``completed_fence``), so commits and releases of an idle engine complete."""
        if self._idle():
            counter = self.session.state.counter
            counter.completed = max(counter.completed, self.announced)

    def _flush_if_idle(self) -> bool:
        """Resolve finished plans now when the engine is idle (else the next step does)."""
        if not self._idle() or not (self.dirty or self.to_release):
            return False
        ops, releases = self._resolution_ops()
        if ops:
            self._send(ops, releases)
        return bool(ops)

    # -- the scheduler interface ---------------------------------------------------------------

    def eligible(self, request: Any) -> bool:
        """Whether a request's K/V is fully determined by its token ids (no images, no prompt
        embeddings) and it has a full block to share."""
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None or getattr(request, "prompt_embeds", None) is not None:
            return False
        if getattr(request, "mm_features", None):
            return False
        return len(tokens) > self.B

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> int | None:
        """The external hit, or None: blockd is fetching the prompt's prefix from its remote
        tier, so vLLM's scheduler skips the request this step and asks again."""
        with self._lock:
            self._flush_if_idle()  # this engine's own finished commits become hittable
            return self._matched(request, num_computed)

    def _matched(self, request: Any, num_computed: int) -> int | None:
        rid = request.request_id
        plan = self.plans.get(rid)
        if plan is not None and plan.abandoned:
            # Asked again, so not scheduled since: nothing was loaded; start over.
            self.plans.pop(rid)
            if plan.epoch == self.session.epoch:
                self.to_release.append(plan.seq_id)
            plan = None
        if plan is None:
            if not self.eligible(request):
                return 0
            admitted = self._admit(request)
            if admitted is PENDING:
                return None
            if not isinstance(admitted, Plan):
                return 0
            plan = self.plans[rid] = admitted
        plan.local_tokens = num_computed
        return max(0, plan.hit_tokens - num_computed)

    def _admit(self, request: Any) -> Plan | Pending | None:
        tokens = list(request.prompt_token_ids)
        ns = self.namespace.for_request(request)
        rid = request.request_id
        wait = self._may_wait(rid)
        resp = self._step([rq.admit(tokens, ns, rid, wait_for_remote=wait)])
        if resp is None:
            return None
        res = resp.results[0]
        if not res.status.code and res.admit.pending_remote_blocks:
            self.counters["remote_pending"] += 1
            return PENDING
        self._waiting.pop(rid, None)
        if res.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
            # No room for the whole prompt: pin just the cached prefix (loads, no saves).
            self.counters["admit_no_room"] += 1
            return self._admit_hit_only(tokens, ns, request.request_id)
        if res.status.code:
            self.counters["admit_refused"] += 1
            log.warning("blockd_vllm: blockd refused request %s: %s (%s); it is computed "
                        "without the cache", request.request_id, res.status.message,
                        res.status.field)
            return None
        a = res.admit
        self.counters["admitted"] += 1
        self.counters["hit_tokens"] += a.num_cached_tokens
        return Plan(a.sequence_id, self.session.epoch, len(tokens), a.num_cached_tokens,
                    list(a.block_table), saved=a.num_cached_tokens // self.B,
                    committed=a.num_cached_tokens // self.B,
                    session_id=self.session.session_id,
                    request=request if self.settings.save_generated else None)

    def _may_wait(self, rid: str) -> bool:
        """Whether request ``rid`` may still wait for a remote fetch (``remote_wait_s`` from
        its first "pending" answer)."""
        budget = self.settings.remote_wait_s
        if budget <= 0:
            return False
        first = self._waiting.setdefault(rid, time.monotonic())
        if time.monotonic() - first < budget:
            return True
        self.counters["remote_wait_expired"] += 1
        return False

    def _admit_hit_only(self, tokens: list[int], ns: pb.CacheNamespace, rid: str
                        ) -> Plan | None:
        hit = self.link.call(self.session.lookup, ns, tokens)
        if not hit:
            return None
        resp = self._step([rq.admit(tokens[:hit + 1], ns, rid)])
        if resp is None or resp.results[0].status.code:
            return None
        a = resp.results[0].admit
        self.counters["hit_tokens"] += a.num_cached_tokens
        # Nothing past the hit is saved: num_prompt is the admitted length.
        return Plan(a.sequence_id, self.session.epoch, a.num_cached_tokens, a.num_cached_tokens,
                    list(a.block_table), saved=a.num_cached_tokens // self.B,
                    committed=a.num_cached_tokens // self.B,
                    session_id=self.session.session_id)

    @locked
    def after_alloc(self, request: Any, vllm_blocks: list[int], num_external: int) -> None:
        plan = self.plans.get(request.request_id)
        if plan is None or num_external <= 0:
            return
        first = plan.local_tokens // self.B
        count = num_external // self.B
        plan.loads = [(vllm_blocks[first + i], plan.table[first + i]) for i in range(count)]
        self.counters["load_blocks"] += count

    @locked
    def build_meta(self, so: Any) -> BlockdMetadata:
        meta = BlockdMetadata()
        if so.total_num_scheduled_tokens:
            # Numbered: the workers report it back (an empty step may never reach them).
            self.step_no += 1
            meta.step = self.step_no
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        grow: list[Growth] = []
        for rid, n in so.num_scheduled_tokens.items():
            plan = self.plans.get(rid)
            if plan is None:
                continue
            self._plan_copies(meta, rid, plan, computed.get(rid, 0) + n, grow)
            self.dirty.add(rid)
        ops, releases = self._resolution_ops()
        appends = [rq.append_batch([g.plan.seq_id for g in grow],
                                   [t for g in grow for t in g.tokens],
                                   [len(g.tokens) for g in grow])] if grow else []
        if appends or ops:
            outcome = self._send(appends + ops, releases)
            if grow:
                self._grown(meta, grow, outcome)
        if self.degraded:
            # Saving into blocks blockd may have lost is pointless (and never committed);
            # loads of blocks the worker maps stay safe (its mapping holds the bytes).
            meta.save_vllm.clear()
            meta.save_blockd.clear()
        meta.pool = PoolRef(self.session.session_id, self.session.epoch,
                            self.session.state.attach.pool.handle_socket_path, self.link.generation)
        meta.fence = self.announced
        return meta

    def _resolution_ops(self) -> tuple[list[pb.Operation], list[str]]:
        """Commits and releases of every plan that is done, and pending releases."""
        ops: list[pb.Operation] = []
        releases: list[str] = []
        for rid in self.dirty:
            plan = self.plans.get(rid)
            if plan is not None and self._resolve(plan, ops):
                if plan.epoch == self.session.epoch:
                    releases.append(plan.seq_id)
                del self.plans[rid]
        self.dirty.clear()
        releases += self.to_release
        ops += [rq.release(seq_id) for seq_id in self.to_release]
        self.to_release = []
        return ops, releases

    def _send(self, ops: list[pb.Operation], releases: list[str]) -> Any:
        epochs = self.counters["epoch_changes"]
        outcome = self._step(ops)
        if outcome is None and self.counters["epoch_changes"] == epochs:
            self.to_release.extend(releases)  # not applied: again once blockd answers
        return outcome

    def _plan_copies(self, meta: BlockdMetadata, rid: str, plan: Plan, end: int,
                     grow: list[Growth]) -> None:
        """This step's loads of ``plan``, the saves of the prompt blocks it completes (``end``:
        the tokens computed once this step ran) and, in ``grow``, the generated tokens whose
        blocks it completes (blockd's blocks for them come with the Step that appends them)."""
        for v, b in plan.loads:
            meta.load_vllm.append(v)
            meta.load_blockd.append(b)
            meta.load_session.append(plan.session_id)
        plan.loads = []
        plan.scheduled = True
        if self.block_ids_of is None or self.degraded or plan.abandoned:
            return
        blocks = plan.prompt_saves(end, self.B)
        if blocks:
            self._save_blocks(meta, rid, plan, blocks)
            plan.saved = blocks.stop
        tokens = plan.generated(end, self.B)
        if tokens:
            grow.append(Growth(rid, plan, tokens, saves=bool(blocks)))
            self._pending(meta, rid, plan)

    def _save_blocks(self, meta: BlockdMetadata, rid: str, plan: Plan, blocks: range) -> None:
        vblocks = self.block_ids_of(rid)[0]
        for j in blocks:
            meta.save_vllm.append(vblocks[j])
            meta.save_blockd.append(plan.table[j])
        self.counters["save_blocks"] += len(blocks)
        self._pending(meta, rid, plan)

    def _pending(self, meta: BlockdMetadata, rid: str, plan: Plan) -> None:
        plan.pending.add(meta.step)
        self.saving.setdefault(meta.step, set()).add(rid)

    def _grown(self, meta: BlockdMetadata, grow: list[Growth], outcome: Any) -> None:
        """The appends of generated tokens answered: save the blocks they completed. An
        append blockd refused (or a Step that did not apply) ends that request's growth."""
        ok = outcome is not None and not outcome.results[0].status.code
        res = outcome.results[0].append_batch if ok else pb.AppendBatchResult()
        errors = {e.index for e in res.errors}
        deltas = {d.index: d.delta for d in res.deltas}
        for i, g in enumerate(grow):
            plan = g.plan
            if not ok or i in errors or plan.abandoned:
                self.counters["generated_refused"] += 1
                plan.request = None  # its sequence holds what it held; nothing more grows
                if not g.saves:  # the step saves nothing of it: no report will come
                    plan.pending.discard(meta.step)
                    self.saving.get(meta.step, set()).discard(g.rid)
                continue
            d = deltas.get(i)
            blocks = plan.grew(len(g.tokens), d.start_index if d is not None else None,
                               list(d.block_ids) if d is not None else [], self.B)
            self._save_blocks(meta, g.rid, plan, blocks)
            self.counters["generated_blocks"] += len(blocks)

    def _resolve(self, plan: Plan, ops: list[pb.Operation]) -> bool:
        """Commit and/or release ``plan`` when it is done; True when it is."""
        if plan.abandoned:
            if not (plan.scheduled or plan.finished):
                return False  # vLLM may have been promised its blocks: load them first
            if plan.epoch == self.session.epoch:
                ops.append(rq.release(plan.seq_id))
            return True
        commit, done = plan.decide(self.B)
        if commit:
            ops.append(rq.commit(plan.seq_id))
            self.counters["committed_blocks"] += plan.saved - plan.committed
            plan.committed = plan.saved
        if done:
            ops.append(rq.release(plan.seq_id))
        return done

    @locked
    def saves_reported(self, report: Any) -> None:
        """A step's save report from the workers (``update_connector_output``)."""
        if report is None:
            return
        self.worker_step = max(self.worker_step, report.done)
        failed: set[str] = set()
        for step_no in report.ok | report.failed:
            for rid in self.saving.pop(step_no, ()):
                plan = self.plans.get(rid)
                if plan is None or step_no not in plan.pending:
                    continue  # dropped, or a later plan of the same request
                plan.pending.discard(step_no)
                if step_no in report.failed:
                    failed.add(rid)
                self.dirty.add(rid)
        for rid in failed:
            self.plans[rid].failed = True
            self.counters["save_failures"] += 1

    def _step(self, ops: list[pb.Operation]) -> Any:
        """A Step; its per-operation refusals are counted (the Step itself applied)."""
        self._report_done()
        outcome = self.link.call(self.session.step, ops)
        if outcome is not None:
            self.announced = outcome.fence
            for r in outcome.results:
                if r.status.code:
                    self.counters["op_refused"] += 1
        return outcome

    @locked
    def finished(self, request: Any) -> None:
        """The request ended: its plan is released (after a commit, when its saves were all
        handed out and are reported done) in the next Step."""
        self._waiting.pop(request.request_id, None)  # aborted while it waited
        plan = self.plans.get(request.request_id)
        if plan is not None:
            plan.finished = True
            self.dirty.add(request.request_id)

    def close(self) -> None:
        self.link.close()
