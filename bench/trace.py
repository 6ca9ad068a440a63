"""A synthetic serving trace: shared system prompts, unique suffixes, multi-turn follow-ups.

Deterministic for a given seed. Shapes follow the foundation issue: ~1,470 prompt tokens on
average, ~137 output tokens, a few shared system prompts, and follow-up turns whose prompt is
the previous turn's prompt + output + a new user message.
"""

from __future__ import annotations

import random
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
