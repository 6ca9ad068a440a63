"""``Plan.quiet`` (the scheduler side's skip of most decode steps) against ``Copies.plan``, which
the skipped plans never reach: on random plans, wherever ``quiet`` says a step has nothing to
do, ``Copies.plan`` hands out no load or save, grows nothing, changes no field of the plan and
reports no change; and the check is not vacuous (both answers occur, and a step that completes
a block past the sequence is never quiet)."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

from blockd_vllm.copies import Copies, Growth
from blockd_vllm.metadata import BlockdMetadata
from blockd_vllm.plan import Plan

B = 16


def _plan(rng: random.Random) -> Plan:
    prompt = rng.randrange(B + 1, 8 * B)
    generated = rng.randrange(0, 4 * B)
    tokens = list(range(prompt + generated))
    blocks = -(-len(tokens) // B) + 2
    num_tokens = prompt + rng.choice([0, 0, B, 2 * B]) * (generated >= 2 * B)
    plan = Plan("q", 1, prompt, rng.choice([0, B]), list(range(100, 100 + blocks)),
                loads=[(1, 101)] if rng.random() < 0.1 else [],
                saved=rng.choice([prompt // B, prompt // B, rng.randrange(0, prompt // B + 1)]),
                scheduled=rng.random() < 0.9, abandoned=rng.random() < 0.05,
                request=SimpleNamespace(all_token_ids=tokens) if rng.random() < 0.9 else None,
                num_tokens=num_tokens, committed=prompt // B if rng.random() < 0.8 else 0,
                appending=rng.choice([0, 0, 0, B]),
                to_save=[prompt // B] if rng.random() < 0.1 else [])
    return plan


def test_a_quiet_step_is_one_copies_plan_would_leave_alone() -> None:
    rng = random.Random(7)
    seen = Counter()
    for _ in range(20_000):
        plan = _plan(rng)
        computed = rng.randrange(0, len(plan.request.all_token_ids) if plan.request else
                                 plan.num_prompt)
        n = rng.choice([1, 1, 1, B, 3 * B])
        quiet = plan.quiet(computed + n, B)
        seen[quiet] += 1
        if computed + n >= (plan.num_tokens // B + 1) * B:
            assert not quiet  # a block completes past blockd's sequence
        if not quiet:
            continue
        before = copy.deepcopy(dataclasses.asdict(plan))
        meta, grow = BlockdMetadata(), list[Growth]()
        copies = Copies(B, Counter())
        vblocks = list(range(len(plan.table)))
        assert copies.plan(meta, "r", plan, computed, n, lambda v=vblocks: v, grow) is False
        assert meta == BlockdMetadata() and grow == [] and not copies.saving
        assert dataclasses.asdict(plan) == before
    assert seen[True] > 1000 and seen[False] > 1000, seen
