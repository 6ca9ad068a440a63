"""The paged path through a real daemon equals a contiguous, no-cache forward pass.

Workload: two system prompts shared by ten requests (prefix hits), unique suffixes, staggered
arrivals, chunked prefill (at most 16 prompt tokens per step), n = 1..3 samples per request
(forks; the partly filled last prompt block is shared, so the children's first appends go
through copy-on-write). Every generated position's logits are compared with
``TinyLlama.forward`` on that sample's own token history, fp32, atol 1e-4.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from e2e_support import (
    assert_matches_reference,
    assert_same_runs,
    run_engine,
    samples,
    shared_prompt_workload,
    start_daemon,
)

from blockd_apps.reference import Request

PREFILL_CHUNK = 8


def run_workload(workdir: Any, model: Any, num_blocks: int) -> dict[str, Any]:
    with start_daemon(workdir, num_blocks) as d:
        e, states, stats = run_engine(d, "acme", model, shared_prompt_workload(),
                                      max_prefill_tokens=PREFILL_CHUNK)
    return {"engine": e, "states": states, "stats": stats}


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory, model: Any) -> dict[str, Any]:
    return run_workload(tmp_path_factory.mktemp("roomy"), model, num_blocks=128)


def test_shared_prompts_chunks_and_forks_match_the_reference(roomy: dict[str, Any],
                                                             model: Any) -> None:
    e, states = roomy["engine"], roomy["states"]
    positions = assert_matches_reference(model, states)
    assert positions == sum(r.request.max_new_tokens * r.request.n for r in states)
    # What the workload was built to exercise did happen.
    assert e.stats.hit_tokens > 0  # later requests reuse committed system-prompt blocks
    assert any(len(s.tokens) - s.cached_tokens[0] > PREFILL_CHUNK  # multi-chunk prefill
               for s in samples(states) if s.cached_tokens)
    assert e.stats.forks == sum(r.request.n - 1 for r in states)
    assert roomy["stats"].cow_copies_total > 0  # children wrote into a shared partial block
    for r in states:  # the children diverge from their first token on
        firsts = [s.generated[0] for s in r.samples]
        assert len(set(firsts)) == r.request.n
    assert e.stats.preemptions == 0


def test_preemption_and_readmission_change_no_logit(tmp_path: Any, model: Any,
                                                    roomy: dict[str, Any]) -> None:
    tight = run_workload(tmp_path, model, num_blocks=24)
    e, states = tight["engine"], tight["states"]
    assert_matches_reference(model, states)
    assert e.stats.preemptions > 0
    readmitted = [s for s in samples(states) if len(s.cached_tokens) > 1]
    assert readmitted
    # Re-admission recomputes little: the preempted sequence's committed blocks are hits.
    assert any(s.cached_tokens[-1] > 0 for s in readmitted)
    # Same tokens and (within summation-order noise) the same logits as with room to spare.
    assert_same_runs(roomy["states"], states)


def test_a_prompt_is_shared_only_once_all_its_chunks_are_written(tmp_path: Any,
                                                                 model: Any) -> None:
    """The daemon counts an admitted prompt whole, so a commit during its chunked prefill would
    publish blocks whose K/V is not written yet: a request with the same prefix arriving then
    would read garbage. The worker commits only written blocks; the late arrival hits."""
    rng = random.Random(7)
    shared = [rng.randrange(1, 256) for _ in range(40)]  # 10 blocks: 5 chunks of 8 tokens

    def req(i: int, arrival: int) -> Request:
        return Request(shared + [rng.randrange(1, 256) for _ in range(3)], max_new_tokens=3,
                       request_id=f"r{i}", arrival=arrival)

    with start_daemon(tmp_path, 64) as d:
        _, states, _ = run_engine(d, "acme", model, [req(0, 1), req(1, 3), req(2, 14)],
                                  max_prefill_tokens=PREFILL_CHUNK)
    assert_matches_reference(model, states)
    assert [s.cached_tokens for s in samples(states)] == [[0], [0], [40]]
