"""Sessions and their fences: work that waits until the worker's GPU is done with a block.

A fence is a per-session monotonic counter. A Step that releases or commits blocks names the
fence value the worker will report once that step's GPU work is done. Until then:

* a released block keeps ``pend > 0`` and cannot be reallocated or scrubbed (a kernel may still
  read it);
* a committed block is immutable but not yet in the prefix index (its K/V may not be written).

Fence value 0 means "no GPU work outstanding" and completes at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RELEASE = 0
COMMIT = 1


@dataclass(slots=True)
class CommitBatch:
    """Full blocks of one sequence to index, in order, once their fence completes."""

    #: The committing sequence's chain list (shared with the sequence while it lives).
    chain: list[int]
    #: Logical index of ``blocks[0]`` in the sequence.
    start: int
    blocks: list[int]
    keys: list[bytes]
    chunks: list[bytes]
    ns_id: int


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
    waiting: deque[tuple[int, int, object]] = field(default_factory=deque)
    #: Live sequences of this session (bounds the preemption notices one answer can carry).
    num_sequences: int = 0
    #: Sequences of this session preempted for a higher-priority request that the worker has
    #: not been told about yet, oldest first (drained into its next StepResponse).
    preempted: list[str] = field(default_factory=list)
    #: Recently preempted sequence ids (an insertion-ordered set, at most
    #: ``blockd.core.preemption.MAX_REMEMBERED``, oldest dropped first): an operation naming one
    #: is ABORTED rather than NOT_FOUND.
    preempted_ids: dict[str, None] = field(default_factory=dict)

    def is_complete(self, fence: int) -> bool:
        return fence <= self.completed
