"""Daemon-side preemption: which live sequences give way when the pool is exhausted.

When an allocation (an admit, or an append that needs new blocks) does not fit for lack of
blocks in the pool (``DoesNotFit`` reason ``"pool"``), the BlockManager may release running
sequences of *strictly lower* effective priority, in any session of any tenant, to make room.

* Effective priority is ``(tenant policy priority, sequence priority)``, compared
  lexicographically. An admit asks with its tenant's priority and its own ``priority``; an
  append with the appending sequence's. The sequence priority is the client's choice, so
  against *another* tenant it counts at most as that tenant's ``max_request_priority``
  (default 0): above its cap it orders only the tenant's own requests.
* A victim of another tenant is never chosen when preempting it would bring a tenant's live
  blocks below its ``guaranteed_blocks``: a guarantee is never preempted away.
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
from blockd.core.errors import InvalidArgument
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
#: Preemption settings ``BlockManager(preemption=...)`` accepts.
PREEMPTION_MODES = ("priority", "off")


def preemption_on(mode: str) -> bool:
    """Whether ``mode`` (a ``PREEMPTION_MODES`` name) turns preemption on."""
    if mode not in PREEMPTION_MODES:
        raise InvalidArgument(f"preemption must be 'priority' or 'off', got {mode!r}",
                              field="preemption")
    return mode == "priority"


#: The bounded label a preemption notice carries.
REASON = "priority"

#: (tenant policy priority, request priority capped at the tenant's max_request_priority,
#: request priority): higher runs first and is preempted last; see ``VictimChooser.below``.
Priority = tuple[int, int, int]


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
        return self.requester(seq.tenant, seq.priority)

    def requester(self, tenant: int, priority: int) -> Priority:
        """The effective priority of ``tenant``'s request of (client-chosen) ``priority``."""
        p = self.tenants.policies[tenant]
        return (p.priority, min(priority, p.max_request_priority), priority)

    def below(self, seq: Sequence, tenant: int, requester: Priority) -> bool:
        """Whether ``seq`` may give way to ``tenant``'s request: strictly lower raw request
        priority within a tenant, strictly lower (tenant priority, capped priority) across."""
        mine = self.priority_of(seq)
        if seq.tenant == tenant:
            return mine[2] < requester[2]
        return mine[:2] < requester[:2]

    def make_room(self, fits: Fits, release: Callable[[Sequence], None], tenant: int,
                  requester: Priority, need: int, hits: Seq[int], exclude: str | None,
                  verdict: DoesNotFit) -> DoesNotFit | None:
        """After a ``"pool"`` refusal: preempt (``release``) the victims ``choose`` finds if
        that makes ``need`` blocks fit. None: it fits now; ``verdict`` unchanged when nothing
        was preempted; ``"preempting"`` while the victims' blocks wait for fences."""
        victims = self.choose(fits, tenant, requester, need, hits, exclude)
        if not victims:
            return verdict
        for seq in victims:
            release(seq)
        after = fits(tenant, need, hits, 0, None)
        return None if after is None else DoesNotFit("preempting", need, after.available)

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
        blocks = self.blocks
        # Most recently admitted first; the stable sort keeps that order within equal
        # priorities.
        eligible = [s for s in reversed(self.sequences.values())
                    if s.id != exclude and self.below(s, tenant, requester)]
        if not eligible:
            return []
        eligible.sort(key=self.priority_of)
        ref = blocks.ref
        charged = blocks.charged
        keep = set(hits)  # block ids (ints): membership only, never iterated
        # A block can be reclaimed only if every table naming it belongs to an eligible victim.
        held: dict[int, int] = {}
        for s in eligible:
            for b in s.table:
                held[b] = held.get(b, 0) + 1
        # Per tenant: the charges that end, or become evictable, once they are all released
        # (a block's every holder is among them; ``blockd.core.blocks``, the charging rule).
        reclaimable = [0] * len(blocks.usage)
        count = 0
        for b, n in held.items():
            if n == ref[b] and b not in keep:
                count += 1
                for t in charged(b):
                    reclaimable[t] += 1
        if fits(tenant, need, hits, pending + count, reclaimable) is not None:
            return []  # not even all of them together would make it fit
        useful = [s for s in eligible
                  if any(held[b] == ref[b] and b not in keep for b in s.table)]
        dropped: dict[int, int] = {}
        freed = [0] * len(blocks.usage)
        total = 0
        chosen: list[Sequence] = []
        for s in useful:
            gain = [b for b in s.table if dropped.get(b, 0) + 1 == ref[b] and b not in keep]
            if s.tenant != tenant and self._breaks_guarantee(tenant, gain, freed):
                continue
            chosen.append(s)
            for b in s.table:
                dropped[b] = dropped.get(b, 0) + 1
            for b in gain:
                total += 1
                for t in charged(b):
                    freed[t] += 1
            verdict = fits(tenant, need, hits, pending + total, freed)
            if verdict is None:
                return chosen
            if verdict.reason == "quota" and not freed[tenant]:
                return []  # only victims of the requester's own tenant can lift its quota
        return []

    def _breaks_guarantee(self, tenant: int, gain: list[int], freed: list[int]) -> bool:
        """Whether freeing ``gain`` too (``freed`` per tenant so far) takes a tenant other than
        the requester below its guaranteed live blocks."""
        blocks = self.blocks
        policies = self.tenants.policies
        more: dict[int, int] = {}
        for b in gain:
            for o in blocks.charged(b):
                more[o] = more.get(o, 0) + 1
        for o, n in more.items():
            live = blocks.usage[o] - blocks.cached[o] - freed[o] - n
            if o != tenant and live < policies[o].guaranteed_blocks:
                return True
        return False
