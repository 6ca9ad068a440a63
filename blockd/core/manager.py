"""The BlockManager: every policy decision about which block holds which tokens.

It composes the allocator (per-block state), the prefix index (which full blocks hold which
prefix), the namespace table, tenants and sessions with their fences, and exposes the operations
of the Step protocol (design.md section 4): admit, append, fork, release, commit, plus lookup,
fence completion, flushes and introspection.

Every operation is check-then-commit: it validates everything and works out whether it fits
before it mutates anything, so a failing operation leaves the manager exactly as it was.
"Does not fit" (pool or quota) is a return value, :class:`DoesNotFit`, not an exception.

The manager is not thread-safe: the daemon calls it from one event loop.
"""

from __future__ import annotations

import secrets
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from blockd.core import preemption as _preemption
from blockd.core.allocator import (
    CACHED,
    COMMITTED,
    FREE,
    PENDING,
    STATE_NAMES,
    WRITING,
    BlockAllocator,
)
from blockd.core.errors import (
    Aborted,
    BlockdError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from blockd.core.fences import COMMIT, RELEASE, CommitBatch, Session
from blockd.core.namespace import Namespace, NamespaceFields, NamespaceTable, PrefixScope
from blockd.core.prefix_index import NO_PARENT, HashFactory, PrefixIndex
from blockd.core.sequence import Sequence, as_token_bytes
from blockd.core.spec import PoolSpec
from blockd.core.tenants import TenantPolicy, TenantTable

#: Most children one fork may create.
MAX_FORK = 64


@dataclass(frozen=True, slots=True)
class DoesNotFit:
    """An allocation that cannot be satisfied; nothing was changed.

    ``reason`` is a bounded label: ``"quota"`` (the tenant's quota, after evicting its own
    cached blocks), ``"pool"`` (free plus evictable blocks), ``"guarantee"`` (blocks kept for
    other tenants' guaranteed minimums), or ``"preempting"``: lower-priority sequences were
    just preempted to make room, and their blocks become reusable once their workers' fences
    complete (retry then). Only a ``"preempting"`` answer changed anything: the preemptions.
    """

    reason: str
    needed: int
    available: int


@dataclass(frozen=True, slots=True)
class AdmitResult:
    seq_id: str
    #: Prompt tokens whose K/V is already in the pool: a multiple of block_size, always less
    #: than the prompt length (the last token is computed so the worker has its logits).
    num_cached_tokens: int
    block_table: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy one block's K/V (all layers) before the step's kernels run."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class AppendResult:
    #: Logical index from which ``block_ids`` replace or extend the worker's table.
    start_index: int
    block_ids: list[int]
    num_tokens: int
    #: The copy-on-write copy this append needs, if the last block was shared.
    copy: CopyOp | None = None


@dataclass(slots=True)
class BatchAppend:
    """Result of ``append_batch``: per entry, in request order."""

    #: Tokens of each sequence after the append (0 for a failed entry).
    num_tokens: list[int]
    #: (entry index, result) for the entries whose block table changed.
    deltas: list[tuple[int, AppendResult]] = field(default_factory=list)
    #: (entry index, error) for the entries that failed; the others applied.
    errors: list[tuple[int, BlockdError | DoesNotFit]] = field(default_factory=list)


@dataclass(slots=True)
class Counters:
    """Monotonic counters (Prometheus ``_total`` metrics)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    scrubbed_blocks: int = 0
    allocated_blocks: int = 0
    released_blocks: int = 0
    #: Sequences a snapshot found no committed token ids for (see ``blockd.core.snapshot``).
    uncacheable_after_snapshot: int = 0
    alloc_failures: Counter[str] = field(default_factory=Counter)
    #: Sequences preempted for a higher-priority request, by the victim's tenant id.
    preemptions: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class PositionInfo:
    """The seeds' debugging step 1: where one token position lives."""

    position: int
    logical_block: int
    offset: int
    physical_block: int
    slot: int


EventSink = Callable[[str, dict[str, object]], None]


class BlockManager:
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
        on_event: EventSink | None = None,
        preemption: str = "priority",
    ) -> None:
        if preemption not in ("priority", "off"):
            raise InvalidArgument(f"preemption must be 'priority' or 'off', got {preemption!r}",
                                  field="preemption")
        self.spec = spec
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.tenants = TenantTable(list(tenants))
        #: Per-daemon secret: keys are unpredictable to clients, so collisions cannot be planned.
        self.seed = secrets.randbits(64) if seed is None else seed
        self.enable_prefix_cache = enable_prefix_cache
        self.scrub_always = scrub_always
        #: Preempt lower-priority sequences when the pool is exhausted (``blockd.core.preemption``).
        self.preempt = preemption == "priority"
        self.alloc = BlockAllocator(spec.num_blocks, max(1, len(self.tenants)))
        self.index = PrefixIndex(spec.num_blocks, spec.block_size, self.seed, hasher_factory)
        self.namespaces = NamespaceTable(self.seed)
        self.sessions: dict[str, Session] = {}
        self.sequences: dict[str, Sequence] = {}
        self.counters = Counters()
        self.on_event = on_event
        #: Blocks zeroed since the last ``take_scrubbed`` (the pool layer does the zeroing).
        self._scrub: list[int] = []
        #: Committed blocks whose content was already indexed in another block: block ->
        #: (that block, its generation). Later blocks of the prefix chain to the indexed one.
        #: Holds only such duplicates, and only while they are allocated.
        self._dup: dict[int, tuple[int, int]] = {}
        self._ns_cache: dict[tuple[PrefixScope, int], Namespace] = {}
        self._scrub_owner = [p.scrub_on_reuse for p in self.tenants.policies]
        #: When a list: sequence ids minted since the caller last took them (the daemon's
        #: journal records them). ``replay_ids``: ids to hand out instead (a journal replay).
        self.minted: list[str] | None = None
        self.replay_ids: deque[str] | None = None
        #: The last preemption question that had no answer (``blockd.core.preemption``).
        self._no_victims: tuple[object, ...] | None = None
        #: Victim scans left until the next Step (``begin_step``): bounds a Step's cost.
        self.preempt_scans_left = _preemption.SCANS_PER_STEP

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["on_event"] = None  # a callback into the server; ``snapshot.load`` sets it
        return state

    # -- tenants and sessions -----------------------------------------------------------------

    def set_tenants(self, policies: Iterable[TenantPolicy]) -> None:
        """Reload tenant policies; sessions and blocks are kept."""
        self.tenants.replace(list(policies))
        self._ns_cache.clear()  # a tenant's sharing domain may have changed
        self.alloc.ensure_tenants(len(self.tenants))
        self._scrub_owner = [p.scrub_on_reuse for p in self.tenants.policies]

    def open_session(self, tenant_id: str, session_id: str | None = None) -> Session:
        """Start a session acting for ``tenant_id``. Its id is unguessable unless given."""
        slot = self.tenants.slot(tenant_id)
        sid = session_id or secrets.token_urlsafe(18)
        if sid in self.sessions:
            raise InvalidArgument("session id already in use", field="session_id")
        session = Session(sid, slot)
        self.sessions[sid] = session
        return session

    def close_session(self, session_id: str, *, work_done: bool = True) -> int:
        """End a session: release its sequences and complete its fences.

        ``work_done`` says the worker's GPU work has finished (a clean Detach, or a lease that
        expired: a dead worker has no work in flight). Commits whose fence the worker never
        reported are dropped either way: their K/V may be half written. Returns the number of
        sequences released.
        """
        session = self._session(session_id)
        if not work_done:
            raise FailedPrecondition("cannot close a session with GPU work in flight",
                                     field="session_id")
        # A scan (closing is rare) instead of a per-session set saves ~60 bytes per sequence.
        seq_ids = [sid for sid, seq in self.sequences.items() if seq.session == session_id]
        for seq_id in seq_ids:
            self._release(session, self.sequences[seq_id], session.issued)
        self._complete(session, 2**64, drop_commits_after=session.completed)
        del self.sessions[session_id]
        return len(seq_ids)

    def complete_fence(self, session_id: str, fence: int) -> None:
        """The worker reports that all GPU work up to ``fence`` is done."""
        session = self._session(session_id)
        if fence < 0:
            raise InvalidArgument("completed_fence must be >= 0", field="completed_fence")
        if fence > session.issued:
            raise InvalidArgument(
                f"completed_fence {fence} is beyond the highest fence issued ({session.issued})",
                field="completed_fence",
            )
        if fence > session.completed:
            self._complete(session, fence)

    def begin_step(self, session_id: str, fence: int, completed_fence: int = 0) -> None:
        """Start a Step: apply the worker's fence progress, then announce the step's fence.

        Both values are validated before either is applied. The operations of the step then
        pass the same ``fence``.
        """
        session = self._session(session_id)
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
            self._complete(session, completed_fence)
        if fence:
            session.issued = fence
        self.preempt_scans_left = _preemption.SCANS_PER_STEP

    # -- the Step operations ------------------------------------------------------------------

    def admit(
        self,
        session_id: str,
        scope: PrefixScope,
        tokens: bytes | Seq[int],
        *,
        cache: bool = True,
        priority: int = 0,
    ) -> AdmitResult | DoesNotFit:
        """Start a sequence for a prompt, reusing every verified cached prefix block.

        Allocates the blocks for the uncached rest of the prompt (WRITING). The worker
        computes K/V for tokens ``num_cached_tokens..`` and later commits the full blocks.
        """
        session = self._session(session_id)
        raw = as_token_bytes(tokens, "token_ids")
        length = len(raw) // 4
        if length == 0:
            raise InvalidArgument("a prompt needs at least one token", field="token_ids")
        ns = self._namespace(scope, session.tenant)
        cache = cache and self.enable_prefix_cache
        B = self.block_size
        hits: list[int] = []
        if cache:
            # Leave at least one token to compute: the worker needs the last token's logits.
            hits = self.index.match(ns.id, ns.root_key, raw, (length - 1) // B)
        need = -(-length // B) - len(hits)
        verdict = self._fits(session.tenant, need, hits)
        held = False
        if verdict is not None and verdict.reason == "pool" and self.preempt:
            # A victim may hold the last other reference to this namespace: keep it alive.
            self.namespaces.incref(ns)
            held = True
            requester = (self.tenants.policies[session.tenant].priority, priority)
            verdict = self._make_room(session.tenant, requester, need, hits, None, verdict)
        if verdict is not None:
            if held:
                self.namespaces.decref(ns)
            else:
                self.namespaces.release_if_unused(ns)
            self.counters.alloc_failures[verdict.reason] += 1
            return verdict
        # -- commit point: nothing above changed any state (but preemptions) --
        # The sequence's namespace reference is taken before allocating: an eviction may drop
        # the last other reference to this very namespace, whose id would then be recycled.
        self.namespaces.incref(ns)
        if held:
            self.namespaces.decref(ns)  # the sequence's reference keeps it
        self._touch(hits)
        new = self._allocate(session.tenant, need)
        stream = None
        if cache:
            # Positioned after the hit blocks: later commits hash only what follows them.
            stream = self.index.new_stream(ns.root_key)
            stream.update(memoryview(raw)[: len(hits) * self.index.chunk_bytes])
        seq = Sequence(self._new_seq_id(), session.id, session.tenant, ns, stream, cache,
                       priority)
        seq.table = array("i", hits)
        seq.table.extend(new)
        seq.num_committed = len(hits)
        if cache:
            seq.chain = hits.copy()
            # The sequence keeps only what later commits need: tokens from the first
            # uncommitted block on.
            seq.tokens = bytearray(raw[len(hits) * self.index.chunk_bytes:])
        seq.num_tokens = length
        self.sequences[seq.id] = seq
        session.num_sequences += 1
        self.counters.queried_tokens += length
        self.counters.hit_tokens += len(hits) * B
        return AdmitResult(seq.id, len(hits) * B, seq.table.tolist(), length)

    def append(self, session_id: str, seq_id: str, tokens: bytes | Seq[int],
               fence: int = 0) -> AppendResult | DoesNotFit:
        """Add tokens whose K/V this step writes; allocate blocks and copy-on-write as needed.

        If the last block is partly filled and shared (after a fork), the sequence gets a new
        block and a copy op src->dst; the old block keeps its content for the others and loses
        this sequence's reference under ``fence`` (the copy reads it during this step).
        """
        session = self._session(session_id)
        seq = self._sequence(session, seq_id)
        raw = as_token_bytes(tokens, "token_ids")
        fence = self._fence(session, fence, announce=False)
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
        fence = self._fence(session, fence, announce=False)
        n = len(seq_ids)
        if counts is not None and len(counts) != n:
            raise InvalidArgument("num_tokens must be empty or have one count per sequence",
                                  field="num_tokens")
        total = n if counts is None else sum(counts)
        if total * 4 != len(token_bytes):
            raise InvalidArgument(f"expected {total} token ids, got {len(token_bytes) // 4}",
                                  field="token_ids")
        B = self.block_size
        ref = self.alloc.ref
        get = self.sequences.get
        sid = session.id
        out = BatchAppend([0] * n)
        num_tokens = out.num_tokens
        if counts is None:
            # Decode: one token each. A sequence whose last block has room and is not shared
            # writes in place: the hot path touches nothing but the sequence.
            for i, seq_id in enumerate(seq_ids):
                seq = get(seq_id)
                if seq is not None and seq.session == sid:
                    old = seq.num_tokens
                    if old % B and ref[seq.table[-1]] == 1:
                        if seq.cache:
                            seq.tokens += token_bytes[4 * i:4 * i + 4]
                        seq.num_tokens = num_tokens[i] = old + 1
                        continue
                self._append_entry(session, seq, i, token_bytes[4 * i:4 * i + 4], fence, out,
                                   seq_id)
        else:
            off = 0
            for i, seq_id in enumerate(seq_ids):
                c = counts[i]
                self._append_entry(session, get(seq_id), i, token_bytes[off:off + 4 * c],
                                   fence, out, seq_id)
                off += 4 * c
        if len(out.errors) < n:
            session.issued = max(session.issued, fence)
        return out

    def _append_entry(self, session: Session, seq: Sequence | None, i: int, raw: bytes,
                      fence: int, out: BatchAppend, seq_id: str = "") -> None:
        """One entry of ``append_batch`` through the general path."""
        if seq is None:
            out.errors.append((i, self._missing(session, seq_id)))
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
        cow = old_len % B != 0 and self.alloc.ref[table[-1]] > 1
        need = -(-(old_len + n) // B) - old_blocks + cow
        if need:
            verdict = self._fits(seq.tenant, need, ())
            if verdict is not None and verdict.reason == "pool" and self.preempt:
                verdict = self._make_room(seq.tenant, _preemption.priority_of(self, seq), need,
                                          (), seq.id, verdict)
            if verdict is not None:
                self.counters.alloc_failures[verdict.reason] += 1
                return verdict
            new = self._allocate(seq.tenant, need)
        else:
            new = []
        session.issued = max(session.issued, fence)
        copy = None
        start = old_blocks
        if cow:
            src = table[-1]
            dst = new[0]
            table[-1] = dst
            copy = CopyOp(src, dst)
            self.counters.cow_copies += 1
            start -= 1
            self._drop_refs(session, [src], fence)
            table.extend(new[1:])
        else:
            table.extend(new)
        if seq.cache:
            seq.tokens += raw
        seq.num_tokens = old_len + n
        return AppendResult(start, table[start:].tolist(), seq.num_tokens, copy)

    def fork(self, session_id: str, seq_id: str, num_children: int = 1) -> list[str]:
        """Children that share every block of ``seq_id`` (refcounts go up, nothing is copied).

        The first write into a shared, partly filled last block goes through copy-on-write.
        """
        session = self._session(session_id)
        parent = self._sequence(session, seq_id)
        if not 1 <= num_children <= MAX_FORK:
            raise InvalidArgument(f"num_children must be in 1..{MAX_FORK}", field="num_children")
        ref = self.alloc.ref
        children = []
        for _ in range(num_children):
            child = parent.fork(self._new_seq_id())
            self.sequences[child.id] = child
            children.append(child.id)
        for b in parent.table:
            ref[b] += num_children
        session.num_sequences += num_children
        self.namespaces.incref(parent.ns, num_children)
        return children

    def release(self, session_id: str, seq_id: str, fence: int = 0) -> int:
        """End a sequence. Its blocks become reusable once ``fence`` completes.

        Returns how many block references were dropped.
        """
        session = self._session(session_id)
        seq = self._sequence(session, seq_id)
        return self._release(session, seq, self._fence(session, fence))

    def commit(self, session_id: str, seq_id: str, fence: int = 0) -> int:
        """Seal the sequence's full blocks; they join the prefix index once ``fence`` completes.

        ``fence`` is the point after which their K/V is written. Returns the number of blocks
        newly committed.
        """
        session = self._session(session_id)
        seq = self._sequence(session, seq_id)
        fence = self._fence(session, fence)
        full = seq.num_tokens // self.block_size
        start = seq.num_committed
        if full <= start:
            return 0
        blocks = seq.table[start:full].tolist()
        state = self.alloc.state
        for b in blocks:
            if state[b] == WRITING:
                state[b] = COMMITTED
        seq.num_committed = full
        if seq.cache and seq.stream is not None:
            seq.chain.extend(blocks)
            # seq.tokens and seq.keys start at block ``start`` (see admit).
            count = full - start
            if len(seq.keys) < count:
                self.index.extend_keys(seq.stream, seq.tokens, len(seq.keys), count, seq.keys)
            step = self.index.chunk_bytes
            tokens = seq.tokens
            chunks = [bytes(tokens[i * step:(i + 1) * step]) for i in range(count)]
            batch = CommitBatch(seq.chain, start, blocks, seq.keys[:count], chunks, seq.ns.id)
            del seq.keys[:count]
            del tokens[:count * step]
            # The batch holds namespace references until it is applied or dropped.
            self.namespaces.incref(seq.ns)
            if session.is_complete(fence):
                self._apply_commit(batch)
            else:
                session.waiting.append((fence, COMMIT, batch))
        return len(blocks)

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, session_id: str, scope: PrefixScope, tokens: bytes | Seq[int]) -> int:
        """Tokens of a prompt whose K/V is cached and visible to this session's tenant.

        Allocates nothing and does not touch the LRU. Capped like ``admit``: a multiple of the
        block size, less than the prompt length.
        """
        session = self._session(session_id)
        raw = as_token_bytes(tokens, "token_ids")
        length = len(raw) // 4
        if length == 0 or not self.enable_prefix_cache:
            return 0
        ns = self._namespace(scope, session.tenant)
        try:
            hits = self.index.match(ns.id, ns.root_key, raw, (length - 1) // self.block_size)
            return len(hits) * self.block_size
        finally:
            self.namespaces.release_if_unused(ns)

    def block_table(self, session_id: str, seq_id: str) -> tuple[list[int], int]:
        """(block ids, number of tokens) of a sequence of this session."""
        seq = self._sequence(self._session(session_id), seq_id)
        return seq.table.tolist(), seq.num_tokens

    def inspect(self, session_id: str, seq_id: str, start: int = 0,
                count: int | None = None) -> list[PositionInfo]:
        """Every position's logical block, offset, physical block and slot (seeds' step 1).

        ``slot = block_table[p // B] * B + p % B`` — the formula the kernels use.
        """
        seq = self._sequence(self._session(session_id), seq_id)
        B = self.block_size
        end = seq.num_tokens if count is None else min(seq.num_tokens, start + count)
        out = []
        for p in range(max(0, start), end):
            lb, off = divmod(p, B)
            pb = seq.table[lb]
            out.append(PositionInfo(p, lb, off, pb, pb * B + off))
        return out

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Physical slots of positions ``start..end-1`` of a sequence."""
        seq = self.sequences[seq_id]
        B = self.block_size
        table = seq.table
        return [table[p // B] * B + p % B for p in range(start, end)]

    def block_state(self, block: int) -> str:
        return STATE_NAMES[self.alloc.state[block]]

    def state_counts(self) -> dict[str, int]:
        counts = self.alloc.count_states()
        return {name: counts[i] for i, name in enumerate(STATE_NAMES)}

    # -- flushes ------------------------------------------------------------------------------

    def flush(self, *, model_id: str | None = None, model_revision: str | None = None,
              lora_id: str | None = None, tenant_id: str | None = None) -> int:
        """Drop every indexed block matching all given filters; returns how many.

        Cached blocks become FREE; blocks still referenced (or pending) stay with their
        sequences but are never hit again. ``tenant_id`` matches blocks that tenant allocated.
        """
        if model_id is None and model_revision is None and lora_id is None and tenant_id is None:
            raise InvalidArgument("a flush needs at least one filter", field="filter")
        owner_slot = self.tenants.slot(tenant_id) if tenant_id is not None else None
        wanted = {
            ns.id
            for ns in self.namespaces
            if (model_id is None or ns.fields.model_id == model_id)
            and (model_revision is None or ns.fields.model_revision == model_revision)
            and (lora_id is None or ns.fields.lora_id == lora_id)
        }
        owner = self.alloc.owner
        ns_arr = self.index.ns
        victims = [
            b for b in self.index.map.values()
            if ns_arr[b] in wanted and (owner_slot is None or owner[b] == owner_slot)
        ]
        for b in victims:
            if self.alloc.state[b] == CACHED:
                self.alloc.uncache(b)
                self._unindex(b)
                self.alloc.give_back(b)
            else:
                self._unindex(b)
        if victims and self.on_event is not None and len(self.index) == 0:
            self.on_event("all_cleared", {})
        return len(victims)

    def take_scrubbed(self) -> list[int]:
        """Blocks that must be zeroed before the worker uses them (drained by the pool layer)."""
        out, self._scrub = self._scrub, []
        return out

    def _namespace(self, scope: PrefixScope, tenant: int) -> Namespace:
        """The interned namespace of a request, memoised per (scope, tenant): encoding and
        hashing the namespace fields costs more than the rest of a short lookup."""
        key = (scope, tenant)
        ns = self._ns_cache.get(key)
        if ns is not None and self.namespaces.is_live(ns):
            return ns
        ns = self.namespaces.intern(_fields(scope, self.tenants.policies[tenant]))
        if len(self._ns_cache) >= 4096:
            self._ns_cache.clear()
        self._ns_cache[key] = ns
        return ns

    # -- internals: fit, allocation, eviction -------------------------------------------------

    def _fits(self, tenant: int, need: int, hits: Seq[int], extra: int = 0,
              freed: Seq[int] | None = None) -> DoesNotFit | None:
        """Whether ``need`` new blocks fit for ``tenant`` once ``hits`` are revived.

        ``extra`` and ``freed`` ask a hypothetical question (preemption): ``extra`` more blocks
        reusable, ``freed[slot]`` of them released by tenant ``slot`` (no longer live).
        """
        if need <= 0:
            return None
        alloc = self.alloc
        state = alloc.state
        owner = alloc.owner
        # Cached blocks about to be hit leave the LRU: they are no longer evictable.
        hit_cached = [b for b in hits if state[b] == CACHED]
        own_hit_cached = sum(1 for b in hit_cached if owner[b] == tenant)
        available = alloc.num_free + alloc.num_cached - len(hit_cached) + extra
        if available < need:
            return DoesNotFit("pool", need, available)
        policy = self.tenants.policies[tenant]
        over = alloc.usage[tenant] + need - policy.quota_blocks
        # Blocks of its own that a preemption frees stop counting against the quota once
        # their fences complete (they are then free, or cached and evictable).
        own_evictable = alloc.cached[tenant] - own_hit_cached + (freed[tenant] if freed else 0)
        if over > own_evictable:
            return DoesNotFit("quota", need, policy.quota_blocks - alloc.usage[tenant]
                              + own_evictable)
        reserved = 0
        for slot, p in enumerate(self.tenants.policies):
            if slot != tenant and p.guaranteed_blocks:
                live = alloc.usage[slot] - alloc.cached[slot] - (freed[slot] if freed else 0)
                reserved += max(0, p.guaranteed_blocks - live)
        if reserved and available - reserved < need:
            return DoesNotFit("guarantee", need, max(0, available - reserved))
        return None

    def _allocate(self, tenant: int, n: int) -> list[int]:
        """Hand out ``n`` blocks (the caller checked ``_fits``), evicting cached ones as needed."""
        if n <= 0:
            return []
        alloc = self.alloc
        over = alloc.usage[tenant] + n - self.tenants.policies[tenant].quota_blocks
        if over > 0:
            self._evict(over, tenant)
        short = n - alloc.num_free
        if short > 0:
            self._evict(short, None)
        scrub = self._scrub
        before = len(scrub)
        ids = alloc.take(n, tenant, self._scrub_owner, self.scrub_always, scrub)
        self.counters.scrubbed_blocks += len(scrub) - before
        self.counters.allocated_blocks += n
        return ids

    def _evict(self, n: int, tenant: int | None) -> None:
        """Free ``n`` cached blocks, least recently used first (of ``tenant``, or of anyone)."""
        alloc = self.alloc
        for _ in range(n):
            b = alloc.oldest_cached(tenant)
            if b < 0:
                raise Internal("eviction found no cached block although the fit check passed")
            alloc.uncache(b)
            self._unindex(b)
            alloc.give_back(b)
            self.counters.evictions += 1

    def _unindex(self, block: int) -> None:
        key = self.index.key[block]
        ns_id = self.index.remove(block)
        self.namespaces.decref(self.namespaces.get(ns_id))
        if self.on_event is not None:
            self.on_event("removed", {"block": block, "key": key})

    def _touch(self, hits: list[int]) -> None:
        """Take a reference on each hit block; cached ones leave the LRU."""
        alloc = self.alloc
        ref = alloc.ref
        state = alloc.state
        for b in hits:
            s = state[b]
            if s == CACHED:
                alloc.uncache(b)
            ref[b] += 1
            state[b] = COMMITTED

    # -- internals: preemption ----------------------------------------------------------------

    def _make_room(self, tenant: int, requester: _preemption.Priority, need: int,
                   hits: Seq[int], exclude: str | None, verdict: DoesNotFit
                   ) -> DoesNotFit | None:
        """After a ``"pool"`` refusal: preempt lower-priority sequences if that makes ``need``
        blocks fit (``blockd.core.preemption``). None: it fits now; ``verdict`` unchanged when
        nothing was preempted; ``"preempting"`` while the victims' blocks wait for fences."""
        victims = _preemption.choose_victims(self, tenant, requester, need, hits, exclude)
        if not victims:
            return verdict
        self._preempt(victims)
        after = self._fits(tenant, need, hits)
        if after is None:
            return None
        return DoesNotFit("preempting", need, after.available)

    def _preempt(self, victims: Iterable[Sequence]) -> None:
        """Release each victim like a ReleaseOp of its own worker with fence 0 (under its
        session's latest announced fence: its kernels may still read the blocks) and leave a
        notice for that worker's next StepResponse."""
        policies = self.tenants.policies
        for seq in victims:
            session = self.sessions[seq.session]
            self._release(session, seq, session.issued)
            session.preempted.append(seq.id)
            ids = session.preempted_ids
            ids[seq.id] = None
            if len(ids) > _preemption.MAX_REMEMBERED:
                del ids[next(iter(ids))]
            self.counters.preemptions[policies[seq.tenant].tenant_id] += 1

    def take_preempted(self, session_id: str) -> list[str]:
        """Every sequence of the session preempted since the last call, oldest first."""
        session = self._session(session_id)
        out = session.preempted
        if out:
            session.preempted = []
        return out

    # -- internals: releases and fences -------------------------------------------------------

    def _release(self, session: Session, seq: Sequence, fence: int) -> int:
        table = seq.table
        self._drop_refs(session, table, fence)
        del self.sequences[seq.id]
        session.num_sequences -= 1
        self.namespaces.decref(seq.ns)
        self.counters.released_blocks += len(table)
        return len(table)

    def _drop_refs(self, session: Session, blocks: Seq[int], fence: int) -> None:
        """Drop one reference on each block under ``fence``.

        A block no sequence references any more is reused only after every fence that covered
        one of its releases has completed: ``pend`` counts those fences.
        """
        alloc = self.alloc
        ref = alloc.ref
        if session.is_complete(fence):
            idle = []
            for b in blocks:
                ref[b] -= 1
                if ref[b] == 0 and alloc.pend[b] == 0:
                    idle.append(b)
                elif ref[b] == 0:
                    alloc.state[b] = PENDING
            # Reverse order: a sequence's tail block is cached first, so it is evicted first.
            self._idle(reversed(idle))
            return
        pend = alloc.pend
        state = alloc.state
        for b in blocks:
            ref[b] -= 1
            pend[b] += 1
            if ref[b] == 0:
                state[b] = PENDING
        session.waiting.append((fence, RELEASE, array("i", blocks)))

    def _idle(self, blocks: Iterable[int]) -> None:
        """Unreferenced blocks with no pending fence: CACHED if indexed, else FREE."""
        alloc = self.alloc
        key = self.index.key
        dup = self._dup
        for b in blocks:
            if key[b] is not None:
                alloc.cache(b)
            else:
                if dup:
                    dup.pop(b, None)
                alloc.give_back(b)

    def _complete(self, session: Session, fence: int, drop_commits_after: int | None = None
                  ) -> None:
        session.completed = max(session.completed, min(fence, 2**63))
        waiting = session.waiting
        alloc = self.alloc
        ref = alloc.ref
        pend = alloc.pend
        while waiting and waiting[0][0] <= fence:
            f, kind, payload = waiting.popleft()
            if kind == COMMIT:
                assert isinstance(payload, CommitBatch)
                if drop_commits_after is None or f <= drop_commits_after:
                    self._apply_commit(payload)
                else:
                    self.namespaces.decref(self.namespaces.get(payload.ns_id))
                continue
            idle = []
            for b in payload:  # type: ignore[attr-defined]
                pend[b] -= 1
                if pend[b] == 0 and ref[b] == 0:
                    idle.append(b)
            self._idle(reversed(idle))

    def _apply_commit(self, batch: CommitBatch) -> None:
        """Index a committed batch whose K/V is now written."""
        index = self.index
        chain = batch.chain
        ns = self.namespaces.get(batch.ns_id)
        state = self.alloc.state
        emit = self.on_event
        dup = self._dup
        for j, b in enumerate(batch.blocks):
            i = batch.start + j
            parent = chain[i - 1] if i > 0 else NO_PARENT
            if parent in dup:
                # The parent turned out to duplicate an indexed block (possibly found through a
                # fork sibling's chain): chain to that one while it is the same incarnation.
                canon, gen = dup[parent]
                if index.key[canon] is not None and index.gen[canon] == gen:
                    parent = canon
            if state[b] == FREE or index.key[b] is not None:
                continue  # flushed meanwhile, or already indexed through a sibling
            key = batch.keys[j]
            chunk = batch.chunks[j]
            if index.insert(b, key, chunk, parent, batch.ns_id):
                # Indexed itself now (its twin may have been flushed): no longer a duplicate.
                dup.pop(b, None)
                self.namespaces.incref(ns)
                if emit is not None:
                    emit("stored", {"block": b, "key": key, "parent": parent,
                                    "ns": ns, "tokens": chunk})
                continue
            # Key taken: an identical block was indexed first. Chain later blocks to it, but
            # only after verifying it, so a colliding key can never become our parent.
            other = index.map[key]
            if (index.tokens[other] == chunk and index.is_child(other, parent)
                    and index.ns[other] == batch.ns_id):
                chain[i] = other
                dup[b] = (other, index.gen[other])
        self.namespaces.decref(ns)

    def _fence(self, session: Session, fence: int, announce: bool = True) -> int:
        """Validate a step's fence and return the fence its releases and commits wait for.

        Fence 0 means the step itself launches no GPU work; its releases still wait for the
        session's latest announced fence, since earlier steps' kernels may read the blocks.
        A nonzero fence is announced (fences never go backwards) unless ``announce`` is False:
        an operation that may still fail announces only once it has succeeded.
        """
        if fence == 0:
            return session.issued
        if fence < 0:
            raise InvalidArgument("fence must be >= 0", field="fence")
        if fence <= session.completed:
            raise InvalidArgument(
                f"fence {fence} is already complete (completed fence is {session.completed})",
                field="fence",
            )
        if fence < session.issued:
            raise InvalidArgument(
                f"fence {fence} is below an earlier step's fence {session.issued}", field="fence"
            )
        if announce:
            session.issued = fence
        return fence

    # -- internals: lookups of ids ------------------------------------------------------------

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound("unknown session", field="session_id")
        return session

    def _sequence(self, session: Session, seq_id: str) -> Sequence:
        seq = self.sequences.get(seq_id)
        if seq is None:
            raise self._missing(session, seq_id)
        if seq.session != session.id:
            raise PermissionDenied("the sequence belongs to another session",
                                   field="sequence_id")
        return seq

    @staticmethod
    def _missing(session: Session, seq_id: str) -> BlockdError:
        """The error for a sequence id this session does not hold (any more)."""
        if seq_id in session.preempted_ids:
            return Aborted("the sequence was preempted by a higher-priority request and must "
                           "be re-admitted", field="sequence_id")
        return NotFound("unknown sequence", field="sequence_id")

    def _new_seq_id(self) -> str:
        if self.replay_ids is not None:
            return self.replay_ids.popleft()
        seq_id = secrets.token_urlsafe(16)  # 128 random bits, as the API promises
        if self.minted is not None:
            self.minted.append(seq_id)
        return seq_id

    # -- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert every invariant of design.md section 2. O(num_blocks): for tests."""
        a = self.alloc
        n = self.num_blocks
        state = a.state
        refs: Counter[int] = Counter()
        for seq in self.sequences.values():
            assert len(seq.table) == -(-seq.num_tokens // self.block_size), seq.id
            assert len(set(seq.table)) == len(seq.table), "a table names a block twice"
            refs.update(seq.table)
        per_session = Counter(seq.session for seq in self.sequences.values())
        pends: Counter[int] = Counter()
        for session in self.sessions.values():
            assert session.num_sequences == per_session[session.id], session.id
            last = 0
            for f, kind, payload in session.waiting:
                assert f >= last, "fence queue out of order"
                assert f > session.completed, "a completed fence is still waiting"
                last = f
                if kind == RELEASE:
                    assert isinstance(payload, array)
                    pends.update(payload)
        free_list = a.free_list()
        free_set = set(free_list)
        assert len(free_set) == len(free_list) == a.num_free, "free stack is broken"
        cached_sets = [a.lru_order(t) for t in range(len(a.usage))]
        cached_all = [b for lst in cached_sets for b in lst]
        assert len(cached_all) == len(set(cached_all)) == a.num_cached
        cached_set = set(cached_all)
        usage = [0] * len(a.usage)
        for b in range(n):
            s = state[b]
            r = a.ref[b]
            p = a.pend[b]
            assert r == refs[b], f"block {b}: ref {r} but {refs[b]} tables name it"
            assert p == pends[b], f"block {b}: pend {p} but {pends[b]} waiting releases"
            assert (b in free_set) == (s == FREE), f"block {b}: free stack vs state {s}"
            assert (b in cached_set) == (s == CACHED), f"block {b}: LRU vs state {s}"
            indexed = self.index.key[b] is not None
            if s in (FREE, CACHED):
                assert r == 0 and p == 0, f"block {b} reusable with ref {r} / pend {p}"
            if s == PENDING:
                assert r == 0 and p > 0, f"block {b} pending with ref {r} / pend {p}"
            if s in (WRITING, COMMITTED):
                assert r >= 1, f"block {b} in use with ref 0"
            if s == CACHED:
                assert indexed, f"cached block {b} is not indexed"
            if indexed:
                assert s in (COMMITTED, PENDING, CACHED), f"indexed block {b} in state {s}"
                assert self.index.map[self.index.key[b]] == b  # type: ignore[index]
                assert self.index.ns[b] != 0
            if s != FREE:
                usage[a.owner[b]] += 1
        assert len(self.index.map) == sum(1 for k in self.index.key if k is not None)
        for b in self._dup:
            assert state[b] != FREE and self.index.key[b] is None, f"stale duplicate {b}"
        assert usage == a.usage, f"usage {a.usage} but blocks say {usage}"
        assert [len(x) for x in cached_sets] == a.cached
        assert sum(usage) == n - a.num_free
        counts = a.count_states()
        assert sum(counts) == n
        # Writes happen only at a sequence's last, partly filled block; a shared one must be
        # copied first (append does), and no indexed block is ever a write target.
        for seq in self.sequences.values():
            if seq.num_tokens % self.block_size:
                last = seq.table[-1]
                assert state[last] == WRITING, f"partial block {last} is {state[last]}"
                assert self.index.key[last] is None
            for b in seq.table[seq.num_committed:seq.num_tokens // self.block_size]:
                assert state[b] in (WRITING, COMMITTED)
        for slot, policy in enumerate(self.tenants.policies):
            if self.tenants.active[slot]:
                assert a.usage[slot] <= policy.quota_blocks, f"tenant {policy.tenant_id} over quota"


def _fields(scope: PrefixScope, policy: TenantPolicy) -> NamespaceFields:
    """The namespace of a request: the client's scope plus the server-side sharing domain."""
    return NamespaceFields(
        model_id=scope.model_id,
        model_revision=scope.model_revision,
        lora_id=scope.lora_id,
        tokenizer_digest=scope.tokenizer_digest,
        sharing_domain=policy.sharing_domain,
        salt=scope.salt,
    )
