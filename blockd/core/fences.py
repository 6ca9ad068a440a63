"""Sessions and their fences: work that waits until the worker's GPU is done with a block.

A fence is a per-session monotonic counter. A Step that releases or commits blocks names the
fence value the worker will report once that step's GPU work is done. Until then:

* a released block keeps ``pend > 0`` and cannot be reallocated or scrubbed (a kernel may still
  read it);
* a committed block is immutable but not yet in the prefix index (its K/V may not be written).

The one fence rule (stated here, enforced by :class:`FenceLedger`):

* A Step's fence 0 means the step itself launches no GPU work. Its releases still wait for the
  session's latest *announced* fence, since earlier steps' kernels may read the blocks; only
  when nothing is outstanding (announced == completed) do they complete at once.
* A nonzero fence must exceed both the completed fence and every earlier step's fence.
* A fence reported over RPC (a Heartbeat, a Step's ``completed_fence``) beyond the highest fence
  announced is refused (INVALID_ARGUMENT): the worker contradicts itself.
* A fence read from the worker's fence page is *clamped* to the highest fence announced: the page
  is written asynchronously (possibly by the GPU stream) and can run ahead of the Steps the
  daemon has seen; completing a fence no Step named would retire blocks on the worker's word.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from blockd.core.blocks import PENDING, BlockArrays
from blockd.core.caching import CommitBatch, PrefixCache
from blockd.core.errors import (
    Aborted,
    BlockdError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from blockd.core.prefix_index import NO_PARENT, PINNED

RELEASE = 0
COMMIT = 1


@dataclass(slots=True)
class Session:
    """A worker's attachment. Sequences and fences are scoped to it."""

    id: str
    tenant: int
    #: Highest fence value whose GPU work the worker reported done.
    completed: int = 0
    #: Highest fence value named by any step so far.
    issued: int = 0
    #: (fence, kind, payload) in issue order; payload is a list of block ids (RELEASE) or a
    #: CommitBatch (COMMIT).
    waiting: deque[tuple[int, int, array[int] | CommitBatch]] = field(default_factory=deque)
    #: Live sequences of this session (bounds the preemption notices one answer can carry).
    num_sequences: int = 0
    #: Sequences of this session preempted for a higher-priority request that the worker has
    #: not been told about yet, oldest first (drained into its next StepResponse).
    preempted: list[str] = field(default_factory=list)
    #: Recently preempted sequence ids (an insertion-ordered set, at most
    #: ``blockd.core.preemption.MAX_REMEMBERED``, oldest dropped first): an operation naming one
    #: is ABORTED rather than NOT_FOUND.
    preempted_ids: dict[str, None] = field(default_factory=dict)
    #: The session's own commits still waiting for their fence, by key: (block, parent,
    #: parent serial or ``PINNED``, token ids, namespace id). Only this session's later
    #: admissions hit them (its worker orders its own kernels, so they run after the K/V is
    #: written); every other session sees them once the fence completes. Written by the
    #: ledger only (``commit`` adds, completion and drops remove); read by
    #: ``PrefixIndex.match``.
    pending: dict[bytes, tuple[int, int, int, bytes, int]] = field(default_factory=dict)

    def is_complete(self, fence: int) -> bool:
        return fence <= self.completed

    def take_preempted(self) -> list[str]:
        """The preemption notices not yet told to the worker, oldest first; now told."""
        out = self.preempted
        if out:
            self.preempted = []
        return out

    def unknown_sequence(self, seq_id: str) -> BlockdError:
        """The error for a sequence id this session does not hold (any more)."""
        if seq_id in self.preempted_ids:
            return Aborted("the sequence was preempted by a higher-priority request and must "
                           "be re-admitted", field="sequence_id")
        return NotFound("unknown sequence", field="sequence_id")

    def note_preempted(self, seq_id: str, remember: int) -> None:
        """A sequence of this session was preempted: tell the worker in its next answer, and
        remember the id (at most ``remember``, oldest forgotten first) so that a later
        operation naming it is ABORTED."""
        self.preempted.append(seq_id)
        ids = self.preempted_ids
        ids[seq_id] = None
        if len(ids) > remember:
            del ids[next(iter(ids))]


#: Completing "every fence" (a session that ends): above any fence a worker can name.
ALL_FENCES = 2**64


class FenceLedger:
    """Every session's fence bookkeeping: announce, validate, drop references, complete.

    Owns ``BlockArrays.pend``: the number of releases of each block whose fence has not
    completed. A block is reused (reallocated or scrubbed) only when ``ref == 0`` and
    ``pend == 0``; this class is the only writer of ``pend`` and of the sessions' ``waiting``
    queues.
    """

    def __init__(self, blocks: BlockArrays, cache: PrefixCache) -> None:
        self.blocks = blocks
        self.cache = cache

    # -- validation and announcement ----------------------------------------------------------

    def begin_step(self, session: Session, fence: int, completed_fence: int) -> None:
        """Apply a Step's reported progress, then announce its fence; both checked first."""
        if completed_fence < 0 or completed_fence > max(session.issued, session.completed):
            raise InvalidArgument(
                f"completed_fence {completed_fence} is beyond the highest fence issued "
                f"({session.issued})", field="completed_fence")
        done = max(session.completed, completed_fence)
        if fence < 0 or (fence and (fence <= done or fence < session.issued)):
            raise InvalidArgument(
                f"fence {fence} must be 0 or above both the completed fence ({done}) and "
                f"every earlier step's fence ({session.issued})", field="fence")
        if completed_fence > session.completed:
            self.complete(session, completed_fence)
        if fence:
            session.issued = fence

    def validate(self, session: Session, fence: int, announce: bool = True,
                 room: int | None = None) -> int:
        """Validate an operation's fence and return the fence its releases and commits wait
        for (the module docstring's rule). A nonzero fence is announced unless ``announce``
        is False: an operation that may still fail announces only once it has succeeded.
        ``room``: the operation adds a waiting entry, refused (RESOURCE_EXHAUSTED
        ``max_pending_fences``, nothing announced) when the session already holds ``room``."""
        if fence == 0:
            self._check_room(session, session.issued, room)
            return session.issued
        if fence < 0:
            raise InvalidArgument("fence must be >= 0", field="fence")
        if fence <= session.completed:
            raise InvalidArgument(
                f"fence {fence} is already complete (completed fence is {session.completed})",
                field="fence")
        if fence < session.issued:
            raise InvalidArgument(
                f"fence {fence} is below an earlier step's fence {session.issued}", field="fence")
        self._check_room(session, fence, room)
        if announce:
            session.issued = fence
        return fence

    def _check_room(self, session: Session, fence: int, room: int | None) -> None:
        if room is not None and not self.has_room(session, fence, room):
            raise ResourceExhausted(
                f"the session has max_pending_fences ({room}) releases and commits waiting "
                "for fences: report completed fences first", reason="max_pending_fences",
                field="fence")

    @staticmethod
    def has_room(session: Session, fence: int, limit: int) -> bool:
        """Whether a release or commit under ``fence`` fits the session's ``limit`` of waiting
        entries (one that completes at once adds none)."""
        return session.is_complete(fence) or len(session.waiting) < limit

    @staticmethod
    def announce(session: Session, fence: int) -> None:
        """A validated fence is now in use (fences never go backwards)."""
        if fence > session.issued:
            session.issued = fence

    # -- releases and commits -----------------------------------------------------------------

    def drop_refs(self, session: Session, blocks: Seq[int], fence: int) -> None:
        """Drop one reference on each block under ``fence``.

        A block no sequence references any more is reused only after every fence that covered
        one of its releases has completed: ``pend`` counts those fences. The session's tenant
        holds (is charged for) a block until its release's fence completes
        (``BlockArrays.drop_holds``).
        """
        arrays = self.blocks
        ref = arrays.ref
        if session.is_complete(fence):
            arrays.drop_holds(blocks, session.tenant)
            idle = []
            for b in blocks:
                ref[b] -= 1
                if ref[b] == 0 and arrays.pend[b] == 0:
                    idle.append(b)
                elif ref[b] == 0:
                    arrays.state[b] = PENDING
            if idle:
                # Reverse order: a sequence's tail block is cached first, so it is evicted first.
                idle.reverse()
                self.cache.idle(idle)
            return
        pend = arrays.pend
        state = arrays.state
        for b in blocks:
            ref[b] -= 1
            pend[b] += 1
            if ref[b] == 0:
                state[b] = PENDING
        session.waiting.append((fence, RELEASE, array("i", blocks)))

    def commit(self, session: Session, fence: int, batch: CommitBatch) -> None:
        """Index ``batch`` once ``fence`` completes (at once if it already has); until then
        its blocks are hittable by this session only (``Session.pending``)."""
        if session.is_complete(fence):
            self.cache.apply_commit(batch)
            return
        session.waiting.append((fence, COMMIT, batch))
        pending = session.pending
        parent = batch.chain[batch.start - 1] if batch.start else NO_PARENT
        parent_serial = batch.parent_serial
        ns_id = batch.ns_id
        for key, b, chunk in zip(batch.keys, batch.blocks, batch.chunks, strict=True):
            if key not in pending:  # a twin committed earlier by this session keeps the key
                pending[key] = (b, parent, parent_serial, chunk, ns_id)
            parent = b
            parent_serial = PINNED  # the block before it in the same table

    @staticmethod
    def _unpend(session: Session, batch: CommitBatch) -> None:
        """A batch left the waiting queue (applied or dropped): no longer a pending hit."""
        pending = session.pending
        for key, b in zip(batch.keys, batch.blocks, strict=True):
            entry = pending.get(key)
            if entry is not None and entry[0] == b:
                del pending[key]

    # -- completion ---------------------------------------------------------------------------

    def report(self, session: Session, fence: int, *, clamp_to_issued: bool = False) -> int:
        """The worker says its GPU work up to ``fence`` is done; returns the fence completed
        now, or 0 when nothing advanced. ``clamp_to_issued``: a fence-page value (see the
        module docstring); otherwise a value beyond what was issued is refused."""
        if fence < 0:
            raise InvalidArgument("completed_fence must be >= 0", field="completed_fence")
        if fence > session.issued:
            if not clamp_to_issued:
                raise InvalidArgument(
                    f"completed_fence {fence} is beyond the highest fence issued "
                    f"({session.issued})", field="completed_fence")
            fence = session.issued
        if fence <= session.completed:
            return 0
        self.complete(session, fence)
        return fence

    def complete(self, session: Session, fence: int, drop_commits_after: int | None = None
                 ) -> None:
        """Retire everything waiting for fences up to ``fence``. Commits waiting for a fence
        above ``drop_commits_after`` are dropped instead of applied (a session that ends)."""
        session.completed = max(session.completed, min(fence, 2**63))
        waiting = session.waiting
        arrays = self.blocks
        ref = arrays.ref
        pend = arrays.pend
        cache = self.cache
        while waiting and waiting[0][0] <= fence:
            f, _, payload = waiting.popleft()
            if isinstance(payload, CommitBatch):
                if session.pending:
                    self._unpend(session, payload)
                if drop_commits_after is None or f <= drop_commits_after:
                    cache.apply_commit(payload)
                else:
                    cache.drop_commit(payload)
                continue
            arrays.drop_holds(payload, session.tenant)
            idle = []
            for b in payload:
                pend[b] -= 1
                if pend[b] == 0 and ref[b] == 0:
                    idle.append(b)
            if idle:
                idle.reverse()  # see ``drop_refs``
                cache.idle(idle)

    def drop_commits(self, session: Session) -> None:
        """Drop the session's unconfirmed commits (its releases keep waiting for their fences):
        a revoked session's blocks must not enter the index after its tenant's flush."""
        keep = [w for w in session.waiting if w[1] != COMMIT]
        for w in session.waiting:
            if w[1] == COMMIT:
                self.cache.drop_commit(w[2])  # type: ignore[arg-type]
        session.waiting = deque(keep)
        session.pending.clear()

    def end(self, session: Session) -> None:
        """A session that ends: its releases complete, its unconfirmed commits are dropped."""
        self.complete(session, ALL_FENCES, drop_commits_after=session.completed)
