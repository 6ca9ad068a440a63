"""The BlockManager: the facade over the core's rooms, and the operations of the Step protocol.

It composes the rooms below it and is all that callers above the core talk to:

* ``blocks`` (``BlockArrays``): per-block refcount, state, owner, free stack, LRUs;
* ``index`` / ``namespaces``: which full blocks hold which prefix, under which namespace;
* ``cache`` (``PrefixCache``): commit batches, hits, idling, eviction, flushes, events;
* ``admission`` (``Admission``): the fit check and the allocation of new blocks;
* ``fences`` (``FenceLedger``): sessions' fences and the releases and commits waiting on them;
* ``victims`` (``VictimChooser``): who gives way when the pool is exhausted;
* ``tiers`` (``Tiering``): where evicted prefixes go below the pool, and loads back;
* ``ids`` (``SequenceIds``): the injected sequence-id minter.

Every operation is check-then-commit: it validates everything and works out whether it fits
before it mutates anything, so a failing operation leaves the manager exactly as it was.
"Does not fit" (pool or quota) is a return value, :class:`DoesNotFit`, not an exception.
Callers read state through the query methods (``blockd.core.queries`` builds their records),
never through the rooms' arrays.

The manager is not thread-safe: the daemon calls it from one event loop.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from blockd.core.admission import Admission
from blockd.core.admit import admit
from blockd.core.blocks import COMMITTED, WRITING, BlockArrays
from blockd.core.caching import PrefixCache
from blockd.core.errors import InvalidArgument, PermissionDenied
from blockd.core.events import EventSink
from blockd.core.fences import FenceLedger, Session
from blockd.core.ids import SequenceIds, opaque_id
from blockd.core.namespace import NamespaceTable, PrefixScope
from blockd.core.preemption import MAX_REMEMBERED, VictimChooser, preemption_on
from blockd.core.prefix_index import HashFactory, PrefixIndex
from blockd.core.queries import CoreQueries
from blockd.core.results import AdmitResult, AppendResult, BatchAppend, CopyOp, Counters, DoesNotFit
from blockd.core.sequence import Sequence, TailWaste, as_token_bytes
from blockd.core.spec import PoolSpec
from blockd.core.tenants import TenantPolicy, TenantTable
from blockd.core.tier_io import TierIO
from blockd.core.tiering import Tiering, TierLimits

#: Most children one fork may create.
MAX_FORK = 64
#: ``AppendResult(...)`` minus the named tuple's Python-level ``__new__`` (a frame per token).
_new_tuple = tuple.__new__


class BlockManager(CoreQueries):
    """Owns the pool's block metadata and all policy. See the module docstring."""

    def __init__(
        self,
        spec: PoolSpec,
        tenants: Iterable[TenantPolicy],
        *,
        seed: int | None = None,
        enable_prefix_cache: bool = True,
        scrub_always: bool = False,
        hasher_factory: HashFactory | None = None,
        events: EventSink | None = None,
        ids: SequenceIds | None = None,
        preemption: str = "priority",
        tiers: TierLimits | None = None,
    ) -> None:
        self.preempt = preemption_on(preemption)
        self.spec = spec
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.tenants = TenantTable(list(tenants))
        #: Per-daemon secret: keys are unpredictable to clients, so collisions cannot be planned.
        self.seed = secrets.randbits(64) if seed is None else seed
        self.enable_prefix_cache = enable_prefix_cache
        self.counters = Counters()
        self.blocks = BlockArrays(spec.num_blocks, max(1, len(self.tenants)))
        self.index = PrefixIndex(spec.num_blocks, spec.block_size, self.seed, hasher_factory)
        self.namespaces = NamespaceTable(self.seed)
        self.cache = PrefixCache(self.blocks, self.index, self.namespaces, self.counters, events)
        #: The lower tiers evicted prefixes spill into (none without ``tiers``); their bytes
        #: move through the ``TierIO`` the runtime injects (``set_tier_io``).
        self.tiers = Tiering(tiers or TierLimits(), self.index, self.blocks, self.namespaces,
                             self.tenants, self.counters, spec.slot_bytes)
        self.tiers.events = events
        self.cache.tiers = self.tiers
        self.admission = Admission(self.blocks, self.tenants, self.cache, self.counters,
                                   scrub_always)
        self.fences = FenceLedger(self.blocks, self.cache)
        self.sessions: dict[str, Session] = {}
        #: Live sequences in admission order (preemption relies on that order).
        self.sequences: dict[str, Sequence] = {}
        self.tail = TailWaste()
        self.victims = VictimChooser(self.blocks, self.tenants, self.sequences, self.counters)
        self.ids = ids if ids is not None else SequenceIds()

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["ids"] = None  # injected by whoever restores a snapshot (``snapshot.load``)
        return state

    # -- configuration ------------------------------------------------------------------------

    def set_event_sink(self, events: EventSink | None) -> None:
        """Where index changes are reported from now on (None: nowhere)."""
        self.cache.events = events
        self.tiers.events = events

    def set_tier_io(self, io: TierIO | None) -> None:
        """What moves the lower tiers' bytes from now on (None: evicted prefixes are dropped
        and lower entries are not hit; a snapshot never carries it)."""
        self.tiers.io = io

    def set_ids(self, ids: SequenceIds) -> None:
        self.ids = ids

    def reconfigure(self, *, enable_prefix_cache: bool, scrub_always: bool,
                    preemption: str) -> None:
        """Apply the settings of a (re)started daemon; blocks, sequences and sessions stay."""
        self.preempt = preemption_on(preemption)
        self.enable_prefix_cache = enable_prefix_cache
        self.admission.scrub_always = scrub_always

    def set_tenants(self, policies: Iterable[TenantPolicy]) -> int:
        """Reload tenant policies; blocks are kept but a removed tenant's private prefixes are
        flushed (a tenant later configured under its id must not hit them): returns how many."""
        before = self.tenant_policies()
        self.tenants.replace(list(policies))
        self.namespaces.forget_requests()
        self.blocks.ensure_tenants(len(self.tenants))
        self.admission.tenants_changed()
        self.tiers.tenants_changed()
        gone = {f"private:{t}" for t in before if t not in self.tenants}
        return self.cache.flush(self.namespaces.matching(None, None, None, gone), None)

    # -- sessions and fences ------------------------------------------------------------------

    def open_session(self, tenant_id: str, session_id: str | None = None) -> str:
        """Start a session acting for ``tenant_id``; returns its id, unguessable unless given."""
        slot = self.tenants.slot(tenant_id)
        sid = session_id or opaque_id(18)
        if sid in self.sessions:
            raise InvalidArgument("session id already in use", field="session_id")
        self.tenants.add_session(slot)  # refused at the tenant's max_sessions
        self.sessions[sid] = Session(sid, slot)
        return sid

    def close_session(self, session_id: str) -> int:
        """End a session once the worker's GPU work has finished (a Detach, or an expired
        lease: a dead worker has no work in flight): release its sequences, complete its
        fences, drop unreported commits (half-written K/V). Returns the sequences released."""
        released = self.revoke_session(session_id)
        session = self.sessions.pop(session_id)
        self.fences.end(session)
        self.tenants.sessions[session.tenant] -= 1
        return released

    def revoke_session(self, session_id: str) -> int:
        """Release the session's sequences under its latest fence (kernels may still read them)
        and drop its unconfirmed commits; it stays for its fences. Returns the sequences."""
        session = self._session(session_id)
        seqs = [seq for seq in self.sequences.values() if seq.session == session_id]
        for seq in seqs:
            self._release(session, seq, session.issued)
        self.fences.drop_commits(session)
        return len(seqs)

    def complete_fence(self, session_id: str, fence: int, *, clamp_to_issued: bool = False
                       ) -> int:
        """The worker reports that all GPU work up to ``fence`` is done (see
        ``blockd.core.fences`` for the one rule: a fence-page value is clamped, an RPC value
        beyond the issued fence refused). Returns the fence completed now, 0 if none."""
        return self.fences.report(self._session(session_id), fence,
                                  clamp_to_issued=clamp_to_issued)

    def begin_step(self, session_id: str, fence: int, completed_fence: int = 0) -> None:
        """Start a Step: apply the worker's fence progress, then announce the step's fence.

        Both values are validated before either is applied. The operations of the step then
        pass the same ``fence``.
        """
        self.fences.begin_step(self._session(session_id), fence, completed_fence)
        self.victims.begin_step()
        self.tiers.begin_step()

    # -- the Step operations ------------------------------------------------------------------

    def admit(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int], *,
              cache: bool = True, priority: int = 0) -> AdmitResult | DoesNotFit:
        """Start a sequence for a prompt, reusing every verified cached prefix block, from the
        pool or loaded from a lower tier (``blockd.core.admit``).

        Allocates the blocks for the uncached rest of the prompt (WRITING). The worker
        computes K/V for tokens ``num_cached_tokens..`` and later commits the full blocks.
        """
        session = self._session(session_id)
        raw = as_token_bytes(tokens, "token_ids")
        if not raw:
            raise InvalidArgument("a prompt needs at least one token", field="token_ids")
        ns = self._namespace(scope, session.tenant)
        return admit(self, session, ns, raw, cache and self.enable_prefix_cache, priority)

    def append(self, session_id: str, seq_id: str, tokens: bytes | Seq[int],
               fence: int = 0) -> AppendResult | DoesNotFit:
        """Add tokens whose K/V this step writes; allocate blocks and copy-on-write as needed.

        If the last block is partly filled and shared (after a fork), the sequence gets a new
        block and a copy op src->dst; the old block keeps its content for the others and loses
        this sequence's reference under ``fence`` (the copy reads it during this step).
        """
        seq = self.sequences.get(seq_id)
        session = self.sessions.get(session_id)
        if seq is not None and session is not None and seq.session == session_id:
            # The per-token path: tokens that fit in the sequence's own last, partly filled,
            # unshared block change nothing but the sequence and its fence. Anything else (a new
            # block, copy-on-write, invalid input) goes on below, nothing changed yet.
            raw = tokens if type(tokens) is bytes else as_token_bytes(tokens, "token_ids")
            size = len(raw)
            old = seq.num_tokens
            used = old % self.block_size
            n = size >> 2
            table = seq.table
            if (used and n and used + n <= self.block_size and not size & 3
                    and self.blocks.ref[table[-1]] == 1
                    # ``FenceLedger.validate``'s rule for a nonzero fence (then ``announce``).
                    and (not fence or (fence > session.completed and fence >= session.issued))):
                if fence:
                    session.issued = fence
                if seq.cache:
                    seq.tokens += raw
                seq.num_tokens = old + n
                self.tail.tokens -= n
                return _new_tuple(AppendResult, (len(table), [], old + n, None))
        session = self._session(session_id)
        seq = self._sequence(session, seq_id)
        raw = as_token_bytes(tokens, "token_ids")
        fence = self.fences.validate(session, fence, announce=False)
        return self._append(session, seq, raw, fence)

    def append_batch(self, session_id: str, seq_ids: Seq[str], token_bytes: bytes,
                     counts: Seq[int] | None = None, fence: int = 0) -> BatchAppend:
        """Append to many sequences at once: a decode step's compact form.

        ``token_bytes`` holds every new token id (uint32 LE) in ``seq_ids`` order; ``counts``
        says how many belong to each sequence (None: one each). Each entry is all-or-nothing
        and independent: failures are reported per entry, the others apply. The common case,
        a token that fits in the sequence's own last block, takes a short path that touches
        nothing but the sequence.
        """
        session = self._session(session_id)
        fence = self.fences.validate(session, fence, announce=False)
        n = len(seq_ids)
        if counts is not None and len(counts) != n:
            raise InvalidArgument("num_tokens must be empty or have one count per sequence",
                                  field="num_tokens")
        total = n if counts is None else sum(counts)
        if total * 4 != len(token_bytes):
            raise InvalidArgument(f"expected {total} token ids, got {len(token_bytes) // 4}",
                                  field="token_ids")
        B = self.block_size
        ref = self.blocks.ref
        get = self.sequences.get
        sid = session.id
        out = BatchAppend([0] * n)
        num_tokens = out.num_tokens
        if counts is None:
            # Decode: one token each. A sequence whose last block has room and is not shared
            # writes in place: the hot path touches nothing but the sequence.
            slow = 0
            for i, seq_id in enumerate(seq_ids):
                seq = get(seq_id)
                if seq is not None and seq.session == sid:
                    old = seq.num_tokens
                    if old % B and ref[seq.table[-1]] == 1:
                        if seq.cache:
                            seq.tokens += token_bytes[4 * i:4 * i + 4]
                        seq.num_tokens = num_tokens[i] = old + 1
                        continue
                slow += 1
                self._append_entry(session, seq, i, token_bytes[4 * i:4 * i + 4], fence, out,
                                   seq_id)
            self.tail.tokens -= n - slow  # the in-place ones (``_append`` counts the others)
        else:
            off = 0
            for i, seq_id in enumerate(seq_ids):
                c = counts[i]
                self._append_entry(session, get(seq_id), i, token_bytes[off:off + 4 * c],
                                   fence, out, seq_id)
                off += 4 * c
        if len(out.errors) < n:
            self.fences.announce(session, fence)
        return out

    def _append_entry(self, session: Session, seq: Sequence | None, i: int, raw: bytes,
                      fence: int, out: BatchAppend, seq_id: str = "") -> None:
        """One entry of ``append_batch`` through the general path."""
        if seq is None:
            out.errors.append((i, session.unknown_sequence(seq_id)))
            return
        if seq.session != session.id:
            out.errors.append((i, PermissionDenied("the sequence belongs to another session",
                                                   field="sequence_id")))
            return
        res = self._append(session, seq, raw, fence)
        if isinstance(res, DoesNotFit):
            out.errors.append((i, res))
            return
        out.num_tokens[i] = res.num_tokens
        if res.block_ids or res.copy is not None:
            out.deltas.append((i, res))

    def _append(self, session: Session, seq: Sequence, raw: bytes, fence: int
                ) -> AppendResult | DoesNotFit:
        n = len(raw) // 4
        B = self.block_size
        old_len = seq.num_tokens
        table = seq.table
        old_blocks = len(table)
        if n == 0:
            return AppendResult(old_blocks, [], old_len)
        cow = old_len % B != 0 and self.blocks.ref[table[-1]] > 1
        need = -(-(old_len + n) // B) - old_blocks + cow
        if cow and not self.fences.has_room(session, fence, self._room(session) or 0):
            return DoesNotFit("max_pending_fences", 1, 0)
        if need:
            verdict = (self.admission.limits(seq.tenant, 0, need - cow, B)
                       or self.admission.fits(seq.tenant, need, ()))
            if verdict is not None and verdict.reason == "pool" and self.preempt:
                verdict = self.victims.make_room(self.admission.fits, self.on_preempted, seq.tenant,
                                                 self.victims.priority_of(seq), need, (), seq.id,
                                                 verdict)
            if verdict is not None:
                self.counters.alloc_failures[verdict.reason] += 1
                return verdict
            new = self.admission.allocate(seq.tenant, need)
            self.admission.charge(seq.tenant, 0, need - cow, B)
        else:
            new = []
        self.fences.announce(session, fence)
        copy = None
        start = old_blocks
        if cow:
            src = table[-1]
            dst = new[0]
            table[-1] = dst
            copy = CopyOp(src, dst)
            self.counters.cow_copies += 1
            start -= 1
            self.fences.drop_refs(session, [src], fence)
            table.extend(new[1:])
        else:
            table.extend(new)
        if seq.cache:
            seq.tokens += raw
        seq.num_tokens = old_len + n
        self.tail.tokens += (len(table) - old_blocks) * B - n
        return AppendResult(start, table[start:].tolist(), seq.num_tokens, copy)

    def fork(self, session_id: str, seq_id: str, num_children: int = 1) -> list[str]:
        """Children that share every block of ``seq_id`` (refcounts go up, nothing is copied).

        The first write into a shared, partly filled last block goes through copy-on-write.
        """
        session = self._session(session_id)
        parent = self._sequence(session, seq_id)
        if not 1 <= num_children <= MAX_FORK:
            raise InvalidArgument(f"num_children must be in 1..{MAX_FORK}", field="num_children")
        blocks = len(parent.table)
        verdict = self.admission.limits(session.tenant, num_children, blocks, self.block_size)
        if verdict is not None:
            raise self.admission.refusal(verdict, "num_children")
        children = []
        for _ in range(num_children):
            child = parent.fork(self.ids.new())
            self.sequences[child.id] = child
            children.append(child.id)
        self.blocks.hold(parent.table, session.tenant, num_children)
        session.num_sequences += num_children
        self.tail.tokens += num_children * (blocks * self.block_size - parent.num_tokens)
        self.admission.charge(session.tenant, num_children, blocks, self.block_size)
        self.namespaces.incref(parent.ns, num_children)
        return children

    def release(self, session_id: str, seq_id: str, fence: int = 0) -> int:
        """End a sequence. Its blocks become reusable once ``fence`` completes.

        Returns how many block references were dropped.
        """
        session = self._session(session_id)
        seq = self._sequence(session, seq_id)
        return self._release(session, seq, self.fences.validate(session, fence,
                                                                room=self._room(session)))

    def commit(self, session_id: str, seq_id: str, fence: int = 0) -> int:
        """Seal the sequence's full blocks; they join the prefix index once ``fence`` completes.

        ``fence`` is the point after which their K/V is written. Returns the number of blocks
        newly committed.
        """
        session = self._session(session_id)
        seq = self._sequence(session, seq_id)
        full = seq.num_tokens // self.block_size
        start = seq.num_committed
        waits = full > start and seq.cache and seq.stream is not None  # a waiting entry
        fence = self.fences.validate(session, fence, room=self._room(session, waits))
        if full <= start:
            return 0
        blocks = seq.table[start:full].tolist()
        state = self.blocks.state
        for b in blocks:
            if state[b] == WRITING:
                state[b] = COMMITTED
        seq.num_committed = full
        if seq.cache and seq.stream is not None:
            self.fences.commit(session, fence, self.cache.commit_batch(seq, start, blocks))
        return len(blocks)

    # -- flushes, scrubbing, preemption notices -----------------------------------------------

    def flush(self, *, model_id: str | None = None, model_revision: str | None = None,
              lora_id: str | None = None, tenant_id: str | None = None) -> int:
        """Drop every indexed block matching all given filters; returns how many.

        Cached blocks become FREE; blocks still referenced (or pending) stay with their
        sequences but are never hit again. ``tenant_id`` matches blocks that tenant allocated.
        """
        if model_id is None and model_revision is None and lora_id is None and tenant_id is None:
            raise InvalidArgument("a flush needs at least one filter", field="filter")
        owner_slot = self.tenants.slot(tenant_id) if tenant_id is not None else None
        return self.cache.flush(self.namespaces.matching(model_id, model_revision, lora_id),
                                owner_slot)

    def adopt_remote(self, tenant_id: str, scope: PrefixScope, tokens: bytes, start: int,
                     count: int) -> int:
        """Blocks ``start..start+count-1`` of prompt ``tokens`` (uint32 LE), fetched from the
        remote tier and checked by the runtime, join the lower tiers as the tenant's entries
        after the prompt's verified prefix (``Tiering.adopt``); returns how many."""
        slot = self.tenants.slot(tenant_id)
        if not self.enable_prefix_cache:
            return 0
        ns = self._namespace(scope, slot)
        try:
            return self.tiers.adopt(ns.id, ns.root_key, tokens, slot, start, count)
        finally:
            self.namespaces.release_if_unused(ns)

    def take_scrubbed(self) -> list[int]:
        """Blocks that must be zeroed before the worker uses them (drained by the runtime)."""
        return self.admission.take_scrubbed()

    def take_preempted(self, session_id: str) -> list[str]:
        """Every sequence of the session preempted since the last call, oldest first."""
        return self._session(session_id).take_preempted()

    # -- internals ----------------------------------------------------------------------------

    def on_preempted(self, seq: Sequence) -> None:
        """A preemption victim: released like its own worker's fence-0 ReleaseOp, noticed."""
        session = self.sessions[seq.session]
        self._release(session, seq, session.issued)
        session.note_preempted(seq.id, MAX_REMEMBERED)
        self.counters.preemptions[self.tenants.policies[seq.tenant].tenant_id] += 1

    def _release(self, session: Session, seq: Sequence, fence: int) -> int:
        table = seq.table
        self.fences.drop_refs(session, table, fence)
        del self.sequences[seq.id]
        self.tail.tokens -= len(table) * self.block_size - seq.num_tokens
        session.num_sequences -= 1
        self.admission.charge(seq.tenant, -1, len(table), self.block_size)
        self.namespaces.decref(seq.ns)
        self.counters.released_blocks += len(table)
        return len(table)
