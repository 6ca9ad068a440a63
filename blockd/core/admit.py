"""Admission of a prompt: a new sequence whose verified cached prefix is reused, from any tier.

``admit`` is the body of ``BlockManager.admit`` (which validates the caller's ids and tokens
first). In order, check before commit:

1. Match the prompt's longest verified prefix: in the pool (``PrefixIndex.match``, with the
   session's own pending commits), then on the lower tiers after it (``Tiering.match``). At
   least one token is left to compute: the worker needs the last token's logits.
2. Check that the rest fits (``Admission.limits`` and ``fits``; lower hits need fresh blocks
   like misses do), preempting lower-priority sequences if the pool is exhausted. A refusal
   changes nothing (but preemptions).
3. Commit: take the pool hits' references, allocate the new blocks (which may evict, and so
   spill, pool prefixes; the lower hits are pinned so that this cannot evict them), then load
   the lower hits into the first new blocks, in order, each checked; the first that fails and
   everything after it are computed by the worker instead. Loaded blocks join the pool's index
   (their lower copies stay) and need no scrub (every byte was overwritten).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from blockd.core.fences import Session
from blockd.core.namespace import Namespace
from blockd.core.prefix_index import NO_PARENT
from blockd.core.results import AdmitResult, DoesNotFit
from blockd.core.sequence import Sequence

if TYPE_CHECKING:
    from blockd.core.manager import BlockManager


def admit(m: BlockManager, session: Session, ns: Namespace, raw: bytes, cache: bool,
          priority: int) -> AdmitResult | DoesNotFit:
    """Start a sequence of ``session`` for prompt ``raw`` (uint32 LE, at least one token)."""
    B = m.block_size
    index = m.index
    tiers = m.tiers
    length = len(raw) // 4
    hits: list[int] = []
    lower: list[int] = []
    if cache:
        hits, lower = tiers.match_prefix(ns.id, ns.root_key, raw, (length - 1) // B,
                                         session.pending, in_step=True)
    need = -(-length // B) - len(hits)
    admission = m.admission
    verdict = (admission.limits(session.tenant, 1, need + len(hits), B)
               or admission.fits(session.tenant, need, hits))
    held = False
    if verdict is not None and verdict.reason == "pool" and m.preempt:
        # A victim may hold the last other reference to this namespace: keep it alive.
        m.namespaces.incref(ns)
        held = True
        requester = m.victims.requester(session.tenant, priority)
        verdict = m.victims.make_room(admission.fits, m.on_preempted, session.tenant, requester,
                                      need, hits, None, verdict)
    if verdict is not None:
        if held:
            m.namespaces.decref(ns)
        else:
            m.namespaces.release_if_unused(ns)
        m.counters.alloc_failures[verdict.reason] += 1
        return verdict
    # -- commit point: nothing above changed any state (but preemptions) --
    # The sequence's namespace reference is taken before allocating: an eviction may drop
    # the last other reference to this very namespace, whose id would then be recycled.
    m.namespaces.incref(ns)
    if held:
        m.namespaces.decref(ns)  # the sequence's reference keeps it
    m.cache.touch(hits, session.tenant)
    tiers.pin(lower, True)
    try:
        new = admission.allocate(session.tenant, need)
        loaded = tiers.load(lower, new[:len(lower)]) if lower else 0
        if loaded:
            entries = [tiers.entry(s) for s in lower[:loaded]]
            m.cache.load_into(new[:loaded], entries, hits[-1] if hits else NO_PARENT)
            admission.unscrub(new[:loaded])
            for name in tiers.tier_names(lower[:loaded]):
                m.counters.tier_hit_tokens[name] += B
    finally:
        tiers.pin(lower, False)
    cached = len(hits) + loaded
    if loaded < len(lower):  # a load failed its check: it and the hits after it are computed
        m.counters.tier_loads_skipped["after_failure"] += len(lower) - loaded - 1
    stream = None
    step = index.chunk_bytes
    if cache:
        # Positioned after the cached blocks: later commits hash only what follows them.
        stream = index.new_stream(ns.root_key)
        stream.update(memoryview(raw)[:cached * step])
    seq = Sequence(m.ids.new(), session.id, session.tenant, ns, stream, cache, priority)
    seq.table = array("i", hits)
    seq.table.extend(new)
    seq.num_committed = cached
    if cache:
        seq.chain = hits + new[:loaded]
        # The sequence keeps only what later commits need: tokens from the first
        # uncommitted block on.
        seq.tokens = bytearray(raw[cached * step:])
    seq.num_tokens = length
    m.tail.tokens += len(seq.table) * B - length
    m.sequences[seq.id] = seq
    session.num_sequences += 1
    admission.charge(seq.tenant, 1, len(seq.table), B)
    m.counters.queried_tokens += length
    m.counters.hit_tokens += cached * B
    return AdmitResult(seq.id, cached * B, seq.table.tolist(), length)
