"""The seeds' debugging step 3: force block reuse, and a request's logits do not move.

Short requests with different prompt lengths finish in a staggered pattern in a 16-block pool,
so the probe request is placed in blocks that just held other requests' K/V (stale rows past
its own length included). The probe runs three times on one daemon: alone, in one crowd and in
a different crowd (requests added and removed, arriving before and after it, finishing while it
decodes). Prefix caching is off for every request, so a block is never shared: any block the
probe and a filler both held was reused, one after the other.

Checks: the probe's logits are the same in all three runs (atol 1e-5: only what else was
batched with it differs) and equal the contiguous reference (atol 1e-4); the crowded runs
really did put it in reused blocks.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from e2e_support import (
    assert_matches_reference,
    assert_same_outputs,
    run_engine,
    samples,
    start_daemon,
)

from blockd_apps.reference import Engine, Request

POOL_BLOCKS = 16
rng = random.Random(3)
PROBE = Request([rng.randrange(1, 256) for _ in range(9)], max_new_tokens=8,
                request_id="probe", cache=False, arrival=4)


def fillers(seed: int, pattern: list[tuple[int, int, int]]) -> list[Request]:
    """(arrival step, prompt length, new tokens) per filler; random tokens, cache off."""
    r = random.Random(seed)
    return [Request([r.randrange(1, 256) for _ in range(n)], max_new_tokens=m,
                    request_id=f"filler{seed}-{i}", cache=False, arrival=a)
            for i, (a, n, m) in enumerate(pattern)]


CROWDS = {
    "alone": [],
    # Six arrive together (more than the pool holds: some wait), finish after 1..5 tokens;
    # three more arrive while the probe decodes.
    "crowd": fillers(1, [(1, 13, 1), (1, 6, 3), (1, 11, 2), (1, 15, 5), (1, 7, 1), (1, 10, 4),
                         (5, 12, 2), (6, 5, 6), (8, 14, 1)]),
    # Some removed, others added with other lengths, tokens and timings.
    "other crowd": fillers(2, [(1, 15, 2), (2, 9, 1), (3, 14, 3), (5, 7, 9), (7, 3, 2)]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, model: Any) -> dict[str, Any]:
    out = {}
    with start_daemon(tmp_path_factory.mktemp("reuse"), POOL_BLOCKS) as d:
        for name, crowd in CROWDS.items():
            timeline: list[dict[str, set[int]]] = []  # per step: request id -> blocks held

            def record(e: Engine, timeline: list[dict[str, set[int]]] = timeline) -> None:
                timeline.append({s.request.request_id: set(e.session.tables.blocks(seq))
                                 for seq, s in e.live.items()})

            _, states, _ = run_engine(d, "acme", model, [PROBE, *crowd], on_step=record)
            probe = next(s for s in samples(states) if s.request is PROBE)
            out[name] = {"states": states, "probe": probe, "timeline": timeline}
    return out


def test_the_probe_was_placed_in_blocks_that_held_other_requests_kv(
        runs: dict[str, Any]) -> None:
    for name in ("crowd", "other crowd"):
        timeline = runs[name]["timeline"]
        first = next(i for i, held in enumerate(timeline) if "probe" in held)
        before = set().union(*(blocks for held in timeline[:first]
                               for rid, blocks in held.items() if rid != "probe"))
        assert timeline[first]["probe"] & before, f"{name}: the probe's blocks were all fresh"
    # Different physical placement across runs, the same logical history.
    assert len({frozenset(r["probe"].blocks) for r in runs.values()}) > 1


def test_the_probes_logits_do_not_change_with_the_crowd(runs: dict[str, Any],
                                                        model: Any) -> None:
    alone = runs["alone"]["probe"]
    for name in ("crowd", "other crowd"):
        assert_same_outputs(alone, runs[name]["probe"])
    for r in runs.values():
        assert_matches_reference(model, r["states"])  # the fillers too
