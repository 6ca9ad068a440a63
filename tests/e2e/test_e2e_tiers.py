"""The reference engine on a daemon whose pool is too small for its prompts: prefixes evicted
to the host tier (and from it to disk) come back, and every generated logit still equals a
contiguous, no-cache forward pass (fp32, atol 1e-4).

Three rounds on one daemon: round 1 computes prompts on two system prompts, round 2 prompts on
two others (which push round 1's blocks out of the 24-block pool), round 3 round 1's prompts
again: their system prompts must be loaded from the lower tiers, and the logits must not move.
"""

from __future__ import annotations

import random
from typing import Any

from e2e_support import BLOCK_SIZE, MODEL_CONFIG, assert_matches_reference, run_engine, start_daemon

from blockd_apps.reference import Request


def workload(seed: int, first_id: int) -> list[Request]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 256) for _ in range(n)] for n in (22, 27)]
    return [Request(systems[i % 2] + [rng.randrange(1, 256) for _ in range(rng.randint(2, 6))],
                    max_new_tokens=4, request_id=f"req{first_id + i}", arrival=1 + i)
            for i in range(6)]


def test_prefixes_evicted_to_lower_tiers_come_back_with_the_same_logits(tmp_path: Any,
                                                                        model: Any) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    c = MODEL_CONFIG
    slot = 2 * BLOCK_SIZE * c.num_layers * c.num_kv_heads * c.head_dim * 4  # K,V ... fp32
    tiers = {"host_bytes": 6 * slot, "disk_path": str(disk), "disk_bytes": 64 * slot}
    first = workload(1, 0)
    with start_daemon(tmp_path / "blockd", 24, extra={"tiers": tiers}) as d:
        _, states1, _ = run_engine(d, "acme", model, first)
        run_engine(d, "acme", model, workload(2, 100))
        _, states3, stats = run_engine(d, "acme", model,
                                       [Request(r.prompt, r.max_new_tokens, request_id=f"again{i}",
                                                arrival=r.arrival)
                                        for i, r in enumerate(first)])
    for states in (states1, states3):
        assert_matches_reference(model, states)
    tiers_seen = {t.tier: t for t in stats.tiers}
    assert sum(t.hit_tokens_total for t in stats.tiers) > 0
    assert tiers_seen["disk"].stored_blocks_total > 0  # the host tier overflowed onto disk
    # Round 3's system prompts came back, from whichever tier held them.
    cached = sum(s.cached_tokens[0] for st in states3 for s in st.samples if s.cached_tokens)
    assert cached >= 2 * 20, cached
