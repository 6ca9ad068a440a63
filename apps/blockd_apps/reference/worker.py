"""A continuous-batching engine that runs ``TinyLlama`` against blockd through the client.

One scheduler iteration (``Engine.step``) sends ONE Step carrying, in this order:

1. commits of blocks that filled, once their K/V is written (the daemon commits every full
   block of the tokens it counts, and it counts an admitted prompt whole, so a prompt in the
   middle of its chunked prefill waits until its last full block is written);
2. releases of finished and preempted sequences (their blocks become reusable once this step's
   fence completes, i.e. after the kernels that may still read them);
3. forks for parallel sampling (n > 1): children share every block of the prompt;
4. one AppendBatchOp for the decoding sequences (their pending token's slot);
5. admissions of waiting requests: the daemon matches the longest cached prefix and the worker
   prefills only the uncached suffix, at most ``max_prefill_tokens`` tokens per step.

Appends come before admissions so running sequences get blocks first. Then the step's compute:
one ``forward_paged`` over the packed prefill chunks and decode tokens, after which the worker
calls ``session.complete_on_stream(fence)``: once the model's stream passes that point (at once
on CPU) the daemon may reuse what this step released and publish what it committed.

Pool pressure: an append refused with RESOURCE_EXHAUSTED preempts the lowest-priority, latest
admitted running sequence (maybe itself): released next step, re-admitted later with its whole
history as the prompt (mostly prefix hits), while the failed one skips the step its victim's
blocks need to pass their fence. An admission that does not fit waits in the queue.

Daemon-side preemption (the daemon's ``cache.preemption: priority``): a request of higher
(tenant priority, request priority), from this engine or another worker, may take the blocks of
a running sequence. The Step response lists it in ``preempted`` (already dropped from the block
tables); an operation naming it afterwards fails with ABORTED. Either way the sample goes back to
the waiting queue and is recomputed, exactly as after this engine's own preemption, without a
release (the daemon already released it). An append or admission refused with reason
``preempting`` waits: the daemon is reclaiming lower-priority blocks for it.

Sampling is greedy (argmax), so runs are deterministic. For n > 1 the children are made to
diverge by construction: sample k takes the k-th best token at its first position and decodes
greedily from there. The logits at every generated position are recorded in ``Sample.logits``
for the tests to compare with the contiguous reference.

On a small CPU machine run it with ``torch.set_num_threads(1)``: the tiny model's matmuls are
too small to split, and spinning intra-op threads starve the daemon's process (20x slower on
2 cores otherwise).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from blockd.api.v1 import blockd_pb2 as pb
from blockd_apps.reference.batch import StepBatch, Work
from blockd_apps.reference.model import TinyLlama
from blockd_apps.reference.request import (
    DECODE,
    DONE,
    FORKING,
    PREEMPTED,
    PREFILL,
    WAITING,
    Request,
    RequestState,
    Sample,
)
from blockd_client import requests as rq

__all__ = ["EngineConfig", "Engine", "EngineStats", "default_namespace"]

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
ABORTED = grpc.StatusCode.ABORTED.value[0]
#: The RESOURCE_EXHAUSTED reason (status field) of a request the daemon is preempting for.
PREEMPTING = "preempting"


@dataclass
class EngineConfig:
    #: Most sequences holding blocks at once (a request with n samples counts n).
    max_running: int = 16
    #: Prompt tokens computed per step (chunked prefill), across sequences.
    max_prefill_tokens: int = 64
    max_admits_per_step: int = 8
    #: Compare every sequence's local block table with the daemon's before each launch (the
    #: seeds' debugging step 1; one GetBlockTable RPC per sequence, so tests only).
    check_tables: bool = False
    #: Consecutive steps an admission may fail with nothing of this engine running before the
    #: engine gives up (the request cannot fit); other workers may hold the pool for a while.
    max_stuck_steps: int = 1000


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    #: Of ``preemptions``: sequences the daemon preempted for a higher-priority request.
    daemon_preemptions: int = 0
    admission_waits: int = 0
    forks: int = 0
    cow_copies: int = 0
    peak_running: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


StepHook = Callable[["Engine"], None]


class Engine:
    """Continuous batching over one attached ``Session`` (see the module docstring)."""

    def __init__(self, session: Any, model: TinyLlama, namespace: pb.CacheNamespace,
                 config: EngineConfig | None = None, on_step: StepHook | None = None) -> None:
        self.session = session
        self.model = model
        self.ns = namespace
        self.config = config or EngineConfig()
        self.on_step = on_step
        self.block_size = session.tables.block_size
        self.kv_caches = session.pool.kv_caches()
        self.requests: list[RequestState] = []
        self.waiting: list[Sample] = []
        #: Samples holding a daemon sequence, by sequence id.
        self.live: dict[str, Sample] = {}
        self.releasing: list[Sample] = []
        #: Parent sample -> children waiting for the fork op.
        self.forking: dict[Sample, list[Sample]] = {}
        self.stats = EngineStats()
        self.step_no = 0
        self._order = itertools.count()
        self._submitted = itertools.count()
        self._states: dict[int, RequestState] = {}
        #: Appends refused this step (pool or quota): each preempts a sequence.
        self._failed: list[Sample] = []
        #: Samples whose sequence the daemon preempted (an ABORTED operation this step).
        self._gone: list[Sample] = []
        #: Consecutive steps in which an admission failed with nothing running.
        self._stuck = 0

    @classmethod
    def attach(cls, client: Any, tenant: str, model: TinyLlama, block_size: int, *,
               config: EngineConfig | None = None, namespace: pb.CacheNamespace | None = None,
               worker_name: str = "reference-worker", on_step: StepHook | None = None
               ) -> Engine:
        """Attach a session whose layout is this model's, tables on the model's device."""
        config = config or EngineConfig()
        layout = model.cfg.kv_layout(block_size)
        session = client.attach(tenant, layout, worker_name=worker_name,
                                max_seqs=4 * config.max_running + 64, max_blocks=1024,
                                device=model.device)
        return cls(session, model, namespace or default_namespace(model), config, on_step)

    # -- public API ---------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestState:
        root = Sample(request, 0, list(request.prompt), seqno=next(self._submitted))
        state = RequestState(request, [root])
        self.requests.append(state)
        self._states[id(request)] = state
        self.waiting.append(root)
        return state

    def run(self, requests: Iterable[Request] = (), max_steps: int = 100_000,
            progress: Callable[[Engine], None] | None = None) -> list[RequestState]:
        """Submit ``requests``, step until everything is done, publish the last fence."""
        for r in requests:
            self.submit(r)
        while self.busy:
            if self.step_no >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            self.step()
            if progress is not None:
                progress(self)
        self.sync()
        return self.requests

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live or self.releasing or self.forking)

    def close(self) -> None:
        """Detach the session (the daemon releases anything still held)."""
        self.session.detach()

    def sync(self) -> None:
        """Report the completed fence over RPC now (not only through the fence page), so the
        daemon applies this session's last releases and commits before anyone's next call."""
        self.session.heartbeat()

    # -- one scheduler iteration --------------------------------------------------------------

    def step(self) -> None:
        """One iteration: one Step RPC, the step's compute, then its fence."""
        self.step_no += 1
        k = self.step_no
        appended: list[Sample] = []
        ops, handlers = self._plan(k, appended)
        if not ops and not any(s.state == PREFILL for s in self.live.values()):
            return  # idle: nothing has arrived yet
        out = self.session.step(ops)
        self.stats.steps += 1
        self.stats.cow_copies += len(out.response.copies)
        self._failed = []
        self._gone = []
        admit_failed = False
        for handler, res in zip(handlers, out.results, strict=True):
            admit_failed |= handler(res) is False
        # Daemon-side preemption: the listed sequences are gone (and out of the tables).
        gone = [self.live[q] for q in out.preempted if q in self.live]
        for s in (*self._gone, *gone):
            self._lost(s)
        self._stuck = self._stuck + 1 if admit_failed and not self.live else 0
        if self._stuck > self.config.max_stuck_steps:
            raise RuntimeError("an admission keeps failing with nothing running: the request "
                               "needs more blocks than the pool or the tenant's quota holds")
        for s in self._failed:
            self._preempt_for(s, k)
        self.stats.peak_running = max(self.stats.peak_running, len(self.live))
        self._compute([s for s in appended if s.state == DECODE])
        # The fence says the GPU is done (copies and kernels): the pool device's current stream
        # writes it when it gets there, unwaited for (on CPU tensors: published at once).
        self.session.complete_on_stream(out.fence)
        for s in self.live.values():
            s.blocks.update(self.session.tables.blocks(s.seq_id))
        if self.on_step is not None:
            self.on_step(self)

    def _plan(self, k: int, appended: list[Sample]
              ) -> tuple[list[pb.Operation], list[Callable[[pb.OperationResult], object]]]:
        """The step's operations, in the order of the module docstring, each with the handler
        of its result. ``appended`` receives the samples whose append succeeded."""
        ops: list[pb.Operation] = []
        handlers: list[Callable[[pb.OperationResult], object]] = []

        def add(op: pb.Operation, handler: Callable[[pb.OperationResult], object]) -> None:
            ops.append(op)
            handlers.append(handler)

        # 1. Commits. The daemon commits every full block of the tokens it counts, so only
        # when all of those have their K/V written (a prompt in the middle of its chunked
        # prefill, or a token appended but not computed, would publish an unwritten block).
        B = self.block_size
        for s in self.live.values():
            full = s.daemon_tokens // B
            if s.request.cache and full > s.committed and full * B <= s.computed:
                add(rq.commit(s.seq_id), self._committed(s))
                s.committed = full
        # 2. Releases.
        for s in self.releasing:
            add(rq.release(s.seq_id), self._released(s))
        self.releasing = []
        # 3. Forks (before the parent's own append: children must not see its next token).
        for parent, children in self.forking.items():
            add(rq.fork(parent.seq_id, len(children)), self._forked(parent, children))
        self.forking = {}
        # 4. Decode appends: one token each, the one sampled last step.
        decoding = [s for s in self.live.values() if s.state == DECODE and s.stall_until <= k]
        if decoding:
            add(rq.append_batch([s.seq_id for s in decoding],
                                [s.tokens[s.computed] for s in decoding]),
                self._appended(decoding, appended))
        # 5. Admissions.
        for s in self._admissible(k):
            add(rq.admit(s.tokens, self.ns, request_id=s.request.request_id,
                         cache=s.request.cache, priority=s.request.priority),
                self._admitted(s))
        return ops, handlers

    # -- op result handlers -------------------------------------------------------------------

    def _committed(self, s: Sample) -> Callable[[pb.OperationResult], None]:
        def handle(res: pb.OperationResult) -> None:
            if res.status.code == ABORTED:
                self._gone.append(s)
                return
            _expect_ok(res)
        return handle

    def _released(self, s: Sample) -> Callable[[pb.OperationResult], None]:
        def handle(res: pb.OperationResult) -> None:
            if res.status.code != ABORTED:  # ABORTED: the daemon preempted (released) it
                _expect_ok(res)
            del self.live[s.seq_id]
            s.seq_id = None
            if s.state == PREEMPTED:
                s.state = WAITING
                self.waiting.append(s)
        return handle

    def _forked(self, parent: Sample, children: list[Sample]
                ) -> Callable[[pb.OperationResult], None]:
        def handle(res: pb.OperationResult) -> None:
            if res.status.code:
                # Nothing is shared then: each child is admitted on its own (prefix hits).
                for c in children:
                    c.state = WAITING
                    self.waiting.append(c)
                return
            self.stats.forks += len(children)
            for c, seq_id in zip(children, res.fork.child_sequence_ids, strict=True):
                c.seq_id = seq_id
                c.state = DECODE
                c.computed = c.daemon_tokens = parent.daemon_tokens
                c.committed = parent.committed
                c.order = next(self._order)
                self.live[seq_id] = c
        return handle

    def _appended(self, decoding: list[Sample], appended: list[Sample]
                  ) -> Callable[[pb.OperationResult], None]:
        def handle(res: pb.OperationResult) -> None:
            _expect_ok(res)
            errors = {e.index: e.status for e in res.append_batch.errors}
            for i, s in enumerate(decoding):
                status = errors.get(i)
                if status is None:
                    s.daemon_tokens += 1
                    appended.append(s)
                elif status.code == RESOURCE_EXHAUSTED and status.field == PREEMPTING:
                    # The daemon is reclaiming lower-priority blocks for it: wait for them.
                    s.stall_until = self.step_no + 2
                elif status.code == RESOURCE_EXHAUSTED:
                    self._failed.append(s)
                elif status.code == ABORTED:
                    self._gone.append(s)
                else:
                    raise RuntimeError(f"append failed: {status.code} {status.message}")
        return handle

    def _admitted(self, s: Sample) -> Callable[[pb.OperationResult], bool]:
        def handle(res: pb.OperationResult) -> bool:
            if res.status.code == RESOURCE_EXHAUSTED:
                self.stats.admission_waits += 1
                # "preempting": room is being made for it; not a sign it can never fit.
                return res.status.field == PREEMPTING
            _expect_ok(res)
            a = res.admit
            self.waiting.remove(s)
            s.seq_id = a.sequence_id
            s.state = PREFILL
            s.computed = a.num_cached_tokens
            s.committed = a.num_cached_tokens // self.block_size
            s.daemon_tokens = a.num_tokens
            s.order = next(self._order)
            s.cached_tokens.append(a.num_cached_tokens)
            self.live[s.seq_id] = s
            self.stats.queried_tokens += a.num_tokens
            self.stats.hit_tokens += a.num_cached_tokens
            return True
        return handle

    # -- scheduling ---------------------------------------------------------------------------

    def _admissible(self, k: int) -> list[Sample]:
        """Waiting samples to try this step: arrived, by (priority, arrival, submission),
        while they fit under ``max_running`` (a request that will fork counts its n)."""
        held = (sum(self._seats(s) for s in self.live.values())
                + sum(len(c) for c in self.forking.values()))
        room = self.config.max_running - held
        ready = sorted((s for s in self.waiting if s.request.arrival <= k),
                       key=lambda s: (-s.request.priority, s.request.arrival, s.seqno, s.index))
        out: list[Sample] = []
        for s in ready:
            if len(out) == self.config.max_admits_per_step or self._seats(s) > room:
                break
            out.append(s)
            room -= self._seats(s)
        return out

    def _seats(self, s: Sample) -> int:
        """Sequences ``s`` will hold: its own, plus its children until it has forked."""
        forked = self._states[id(s.request)].forked
        return s.request.n if s.index == 0 and not forked else 1

    def _lost(self, s: Sample) -> None:
        """The daemon preempted ``s``'s sequence: it no longer exists (nothing to release).
        Recompute it later, exactly as after this engine's own preemption."""
        if s.seq_id is None or self.live.get(s.seq_id) is not s:
            return  # already handled (an ABORTED op and the notice of the same preemption)
        del self.live[s.seq_id]
        s.seq_id = None
        if s in self.releasing:
            self.releasing.remove(s)
        # Children whose fork was not sent yet: admitted on their own later.
        for c in self.forking.pop(s, []):
            c.state = WAITING
            self.waiting.append(c)
        if s.state == DONE:
            return  # finished anyway: its release was all that was left
        if s.state != PREEMPTED:  # this engine had not already chosen it as a victim
            s.preemptions += 1
            self.stats.preemptions += 1
            self.stats.daemon_preemptions += 1
        s.state = WAITING
        self.waiting.append(s)

    def _preempt_for(self, failed: Sample, k: int) -> None:
        """``failed`` could not get a block: release the lowest-priority, latest sequence."""
        if failed.state != DECODE:  # already chosen as a victim for an earlier failure
            return
        candidates = [s for s in self.live.values() if s.state in (PREFILL, DECODE)]
        victim = min(candidates, key=lambda s: (s.request.priority, -s.order))
        if victim is not failed:
            failed.stall_until = k + 2  # the victim's blocks are free once its fence passes
        victim.state = PREEMPTED
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.releasing.append(victim)
        # Children whose fork was not sent yet: admitted on their own later.
        for c in self.forking.pop(victim, []):
            c.state = WAITING
            self.waiting.append(c)

    # -- compute ------------------------------------------------------------------------------

    def _compute(self, decoding: list[Sample]) -> None:
        budget = self.config.max_prefill_tokens
        prefill: list[tuple[Sample, int]] = []
        for s in sorted((s for s in self.live.values() if s.state == PREFILL),
                        key=lambda s: s.order):
            if budget <= 0:
                break
            n = min(budget, len(s.tokens) - s.computed)
            prefill.append((s, n))
            budget -= n
        if not prefill and not decoding:
            return
        p_work = [Work(s.seq_id, s.tokens[s.computed:s.computed + n], s.computed,
                       s.computed + n == len(s.tokens)) for s, n in prefill]
        d_work = [Work(s.seq_id, [s.tokens[s.computed]], s.computed, True) for s in decoding]
        if self.config.check_tables:
            self._check_tables([w.seq_id for w in (*p_work, *d_work)])
        batch = StepBatch.build(p_work, d_work, self.session.tables, self.model.device)
        logits = self.model.forward_paged(batch, self.kv_caches).float().cpu()  # [R, V]
        rows = iter(logits)
        for s, n in prefill:
            s.computed += n
            self.stats.prefill_tokens += n
            if s.computed == len(s.tokens):
                s.state = DECODE
                self._sampled(s, next(rows))
        for s in decoding:
            s.computed += 1
            self.stats.decode_tokens += 1
            self._sampled(s, next(rows))

    def _sampled(self, s: Sample, logits: torch.Tensor) -> None:
        """Record the logits of the next position and pick its token."""
        state = self._states[id(s.request)]
        s.logits.append(logits.clone())
        if s.index == 0 and s.request.n > 1 and not state.forked:
            # Parallel sampling: child k starts from the k-th best token (so the samples
            # diverge under greedy decoding), then shares the prompt's blocks via fork.
            state.forked = True
            ranked = torch.topk(logits, s.request.n).indices.tolist()
            for child_index, token in enumerate(ranked[1:], start=1):
                child = Sample(s.request, child_index, s.tokens + [token],
                               logits=[logits.clone()], seqno=s.seqno)
                state.samples.append(child)
                if child.finished:
                    child.state = DONE
                else:
                    child.state = FORKING
                    self.forking.setdefault(s, []).append(child)
            s.tokens.append(ranked[0])
        else:
            s.tokens.append(int(torch.argmax(logits)))
        if s.finished:
            s.state = DONE
            self.releasing.append(s)

    def _check_tables(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            want = list(self.session.block_table(seq_id).block_ids)
            have = self.session.tables.blocks(seq_id)
            if want != have:
                raise AssertionError(f"block table of {seq_id}: worker has {have}, "
                                     f"daemon has {want}")


def default_namespace(model: TinyLlama) -> pb.CacheNamespace:
    """The cache namespace names the exact weights: another seed or shape never hits."""
    cfg = model.cfg
    rev = (f"seed{cfg.seed}-v{cfg.vocab_size}-d{cfg.d_model}-l{cfg.num_layers}"
           f"-h{cfg.num_heads}x{cfg.num_kv_heads}x{cfg.head_dim}-f{cfg.ffn_dim}")
    return rq.namespace("blockd-reference-tinyllama", model_revision=rev)


def _expect_ok(res: pb.OperationResult) -> None:
    if res.status.code:
        raise RuntimeError(f"operation failed: {res.status.code} {res.status.field}: "
                           f"{res.status.message}")
