"""A synthetic serving trace: shared system prompts, unique suffixes, multi-turn follow-ups.

Deterministic for a given seed. Shapes follow the foundation issue: ~1,470 prompt tokens on
average, ~137 output tokens, a few shared system prompts, and follow-up turns whose prompt is
the previous turn's prompt + output + a new user message.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    arrival_step: int
    prompt: list[int]
    output: list[int]
    #: Index of the request this one follows up on (-1 for a first turn).
    follows: int


def make_trace(num_requests: int = 2000, seed: int = 0, num_system_prompts: int = 6,
               system_len: tuple[int, int] = (870, 1270), user_len: tuple[int, int] = (90, 540),
               followup_share: float = 0.33, followup_user_len: tuple[int, int] = (20, 120),
               output_mean: int = 137, arrivals_per_step: float = 1.0,
               vocab: int = 128_000) -> list[Request]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(*system_len))]
               for _ in range(num_system_prompts)]
    out: list[Request] = []
    step = 0.0
    for i in range(num_requests):
        step += rng.expovariate(arrivals_per_step)
        output = [rng.randrange(vocab) for _ in range(max(1, int(rng.gauss(output_mean, 40))))]
        if out and rng.random() < followup_share:
            j = rng.randrange(max(0, i - 200), i)
            prev = out[j]
            user = [rng.randrange(vocab) for _ in range(rng.randint(*followup_user_len))]
            out.append(Request(int(step), prev.prompt + prev.output + user, output, j))
        else:
            system = systems[min(int(rng.paretovariate(1.2)) - 1, num_system_prompts - 1)]
            user = [rng.randrange(vocab) for _ in range(rng.randint(*user_len))]
            out.append(Request(int(step), system + user, output, -1))
    # A follow-up can only arrive after the turn it continues has finished.
    return out


def summary(trace: list[Request]) -> dict[str, float]:
    n = len(trace)
    return {
        "requests": n,
        "mean_prompt_tokens": sum(len(r.prompt) for r in trace) / n,
        "mean_output_tokens": sum(len(r.output) for r in trace) / n,
        "followups": sum(r.follows >= 0 for r in trace),
    }


class Arrivals:
    """The trace as a scheduler sees it: requests arrive at their step and are admitted first
    come, first served while they fit; a follow-up turn waits, without holding back the others,
    until the turn it continues has finished. The one admission rule of every replay here."""

    def __init__(self, trace: list[Request]) -> None:
        self.trace = trace
        self.next = 0
        self.waiting: deque[int] = deque()
        #: ``finished[i]``: request i's output is done (its follow-up may be admitted).
        self.finished = [False] * len(trace)

    def pending(self) -> bool:
        """Requests that have not arrived yet, or are waiting."""
        return self.next < len(self.trace) or bool(self.waiting)

    def arrive(self, step: int) -> None:
        while self.next < len(self.trace) and self.trace[self.next].arrival_step <= step:
            self.waiting.append(self.next)
            self.next += 1

    def admit(self, room: int, admit: Callable[[int], bool]) -> int:
        """Offer waiting requests in order to ``admit`` (True: it fit) until ``room`` were
        admitted or one did not fit; returns how many were."""
        n = blocked = 0
        waiting = self.waiting
        while waiting and n < room and blocked < len(waiting):
            i = waiting[0]
            dep = self.trace[i].follows
            if dep >= 0 and not self.finished[dep]:
                waiting.rotate(-1)
                blocked += 1
                continue
            if not admit(i):
                break
            waiting.popleft()
            blocked = 0
            n += 1
        return n
