"""What the reference engine schedules: a generation request, its samples and their states.

A ``Request`` asks for ``n`` samples; each ``Sample`` is one output stream that holds at most one
daemon sequence at a time and moves through the states below (``worker.Engine`` moves it; see
that module's docstring for when). ``RequestState`` groups a request's samples: the root sample
first, then the children its fork creates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Sample states.
WAITING = "waiting"  # needs (re-)admission
PREFILL = "prefill"  # admitted; K/V of tokens[computed:] still to be computed in chunks
DECODE = "decode"  # all but the last token computed; the last one is appended next
FORKING = "forking"  # a child whose fork is in the next step
PREEMPTED = "preempted"  # released in the next step, then WAITING
DONE = "done"


@dataclass(frozen=True)
class Request:
    """A generation request: ``n`` samples of up to ``max_new_tokens`` tokens each."""

    prompt: list[int]
    max_new_tokens: int
    n: int = 1
    request_id: str = ""
    #: Higher is more important (admission order, last to be preempted).
    priority: int = 0
    #: Use the prefix cache (read and contribute); False = ``disable_prefix_cache``.
    cache: bool = True
    #: First scheduler step at which the request may be admitted.
    arrival: int = 0

    def __post_init__(self) -> None:
        if not self.prompt or self.max_new_tokens < 1 or not 1 <= self.n <= 64:
            raise ValueError("a request needs a prompt, max_new_tokens >= 1 and 1 <= n <= 64")


@dataclass(eq=False)
class Sample:
    """One output stream of a request; holds at most one daemon sequence at a time."""

    request: Request
    index: int
    #: Prompt plus generated tokens (the last one may not have its K/V yet).
    tokens: list[int]
    #: Logits ``[V]`` that produced each generated token, in order.
    logits: list[torch.Tensor] = field(default_factory=list)
    state: str = WAITING
    seq_id: str | None = None
    #: Tokens whose K/V is in the pool (positions 0..computed-1).
    computed: int = 0
    #: Tokens the daemon counts in the sequence (runs ahead of ``computed`` while prefilling).
    daemon_tokens: int = 0
    #: Leading full blocks already committed (or hit in the prefix cache).
    committed: int = 0
    #: Admission order; the latest is preempted first.
    order: int = -1
    #: Submission order of the request (the waiting queue's tie-break).
    seqno: int = 0
    stall_until: int = 0
    preemptions: int = 0
    #: ``num_cached_tokens`` of each admission.
    cached_tokens: list[int] = field(default_factory=list)
    #: Every physical block any of this sample's sequences held (tests: block reuse).
    blocks: set[int] = field(default_factory=set)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.prompt):]

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.request.max_new_tokens


@dataclass(eq=False)
class RequestState:
    request: Request
    samples: list[Sample]
    forked: bool = False

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.request.n and all(s.state == DONE
                                                          for s in self.samples)
