"""Daemon-side preemption: which live sequences give way when the pool is exhausted.

When an allocation (an admit, or an append that needs new blocks) does not fit for lack of
blocks in the pool (``DoesNotFit`` reason ``"pool"``), the BlockManager may release running
sequences of *strictly lower* effective priority, in any session of any tenant, to make room.

* Effective priority is ``(tenant policy priority, sequence priority)``, compared
  lexicographically. An admit asks with its tenant's priority and its own ``priority``; an
  append with the appending sequence's.
* Victims are taken lowest priority first, then most recently admitted first (vLLM's order:
  the latest arrival has done the least work). The manager's ``sequences`` is a dict in
  admission order, so iterating it reversed and sorting stably by priority gives that order
  without any per-sequence field.
* A victim frees only blocks that no surviving sequence references (a block shared with a
  non-victim, or one the admit itself hits, is not counted). Sequences that could free no block
  at all whatever else is preempted are never chosen.
* Blocks already PENDING (released, waiting for a fence) will become reusable without hurting
  anyone: they count as coming. Preempting on top of them would preempt a new victim on every
  retry of the same request while the first victims' fences are still pending.
* The shortest prefix of that order whose freed blocks make the request fit (pool and
  guarantees, assuming every pending fence completes) is chosen. When even all of them would not
  make it fit, nothing is preempted: a preemption that cannot help only destroys work.

Everything here is deterministic (dict and list orders only, no time, no randomness): the
daemon's journal replays Steps and must reproduce exactly the same preemptions.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from blockd.core.blocks import PENDING, BlockArrays
from blockd.core.results import Counters, DoesNotFit
from blockd.core.sequence import Sequence
from blockd.core.tenants import TenantTable

#: Preempted sequence ids a session remembers (oldest dropped first), so that a later operation
#: naming one is ABORTED (re-admit) rather than NOT_FOUND.
MAX_REMEMBERED = 4096
#: Full victim scans (O(live sequences + their blocks) each) one Step may trigger; later
#: refusals in the same Step are answered without preempting. A Step of thousands of
#: admissions or batch entries from sequences of distinct priorities would otherwise scan
#: once per refusal.
SCANS_PER_STEP = 8
#: The bounded label a preemption notice carries.
REASON = "priority"

#: (tenant policy priority, sequence priority): higher runs first and is preempted last.
Priority = tuple[int, int]


#: ``Admission.fits``: (tenant, need, hits, extra reusable, freed per tenant) -> verdict.
Fits = Callable[[int, int, Seq[int], int, Seq[int] | None], DoesNotFit | None]


class VictimChooser:
    """Chooses preemption victims; holds the memo and the per-Step scan budget.

    Owned by the manager, which calls ``begin_step`` at every Step and ``choose`` after a
    ``"pool"`` refusal, passing its fit check; it reads the block arrays, tenants and live
    sequences it was given and changes none of them.
    """

    def __init__(self, blocks: BlockArrays, tenants: TenantTable,
                 sequences: dict[str, Sequence], counters: Counters) -> None:
        self.blocks = blocks
        self.tenants = tenants
        self.sequences = sequences
        self.counters = counters
        #: The last question that had no answer: the same question on an unchanged pool is
        #: answered without a scan.
        self._no_victims: tuple[object, ...] | None = None
        #: Victim scans left until the next Step.
        self.scans_left = SCANS_PER_STEP

    def begin_step(self) -> None:
        self.scans_left = SCANS_PER_STEP

    def priority_of(self, seq: Sequence) -> Priority:
        """A live sequence's effective priority."""
        return (self.tenants.policies[seq.tenant].priority, seq.priority)

    def choose(self, fits: Fits, tenant: int, requester: Priority, need: int,
               hits: Seq[int], exclude: str | None = None) -> list[Sequence]:
        """The sequences to preempt so that ``need`` blocks fit for ``tenant`` (see the module
        docstring), in preemption order; empty when preempting cannot help or is not needed.

        ``hits`` are the blocks the request will reference (an admit's prefix hits); ``exclude``
        the requesting sequence (an append's), which is never its own victim. Changes nothing
        but the memo and the scan budget.
        """
        blocks = self.blocks
        # Blocks already on their way back (ref 0, waiting for a fence) need no victim.
        pending = blocks.state.count(PENDING)
        verdict = fits(tenant, need, hits, pending, None)
        if verdict is None or verdict.reason == "quota":
            return []  # it will fit once fences complete, or no preemption can make it fit
        # Even reclaiming every block in use would not do (O(tenants), before any sequence is
        # looked at): a request larger than the pool costs nothing however many sequences run.
        in_use = blocks.num_blocks - blocks.num_free - blocks.num_cached - pending
        if fits(tenant, need, hits, pending + in_use,
                [u - c for u, c in zip(blocks.usage, blocks.cached, strict=True)]) is not None:
            return []
        # The same question on an unchanged pool has the same answer: a Step of many admissions
        # that cannot be helped pays the scan below once, not once per admission. (``exclude``
        # is not part of the question: the requesting sequence has the requester's priority,
        # so it is never eligible anyway.)
        c = self.counters
        key = (tenant, requester, need, tuple(hits), blocks.num_free, blocks.num_cached, pending,
               len(self.sequences), c.allocated_blocks, c.released_blocks)
        if self._no_victims == key or self.scans_left <= 0:
            return []
        self.scans_left -= 1
        chosen = self._scan(fits, tenant, requester, need, hits, exclude, pending)
        if not chosen:
            self._no_victims = key
        return chosen

    def _scan(self, fits: Fits, tenant: int, requester: Priority, need: int, hits: Seq[int],
              exclude: str | None, pending: int) -> list[Sequence]:
        """The O(live sequences + their blocks) part of ``choose``."""
        policies = self.tenants.policies
        blocks = self.blocks
        # Most recently admitted first; the stable sort keeps that order within equal
        # priorities.
        eligible = [s for s in reversed(self.sequences.values())
                    if s.id != exclude and (policies[s.tenant].priority, s.priority) < requester]
        if not eligible:
            return []
        eligible.sort(key=lambda s: (policies[s.tenant].priority, s.priority))
        ref = blocks.ref
        owner = blocks.owner
        keep = set(hits)  # block ids (ints): membership only, never iterated
        # A block can be reclaimed only if every table naming it belongs to an eligible victim.
        held: dict[int, int] = {}
        for s in eligible:
            for b in s.table:
                held[b] = held.get(b, 0) + 1
        reclaimable = [0] * len(blocks.usage)
        for b, n in held.items():
            if n == ref[b] and b not in keep:
                reclaimable[owner[b]] += 1
        if fits(tenant, need, hits, pending + sum(reclaimable), reclaimable) is not None:
            return []  # not even all of them together would make it fit
        useful = [s for s in eligible
                  if any(held[b] == ref[b] and b not in keep for b in s.table)]
        dropped: dict[int, int] = {}
        freed = [0] * len(blocks.usage)
        total = 0
        chosen: list[Sequence] = []
        for s in useful:
            chosen.append(s)
            for b in s.table:
                d = dropped.get(b, 0) + 1
                dropped[b] = d
                if d == ref[b] and b not in keep:
                    total += 1
                    freed[owner[b]] += 1
            verdict = fits(tenant, need, hits, pending + total, freed)
            if verdict is None:
                return chosen
            if verdict.reason == "quota" and not freed[tenant]:
                return []  # only victims of the requester's own tenant can lift its quota
        return []
