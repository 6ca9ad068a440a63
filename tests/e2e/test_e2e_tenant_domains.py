"""Two tenants send the same prompt at overlapping times.

- Private domains (acme, globex): no prefix hit across them and no physical block held by both
  at any step; each still gets the reference's logits.
- A group domain (initech and umbrella, group "labs"): the second tenant's admission hits the
  first one's committed prompt blocks, both tables name the same physical blocks while both
  run, and the logits are identical (atol 1e-5; and 1e-4 against the reference).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    BLOCK_SIZE,
    assert_matches_reference,
    assert_same_outputs,
    client,
    engine,
    run_together,
    samples,
    start_daemon,
)

from blockd_apps.reference import Engine, Request

rng = random.Random(4)
PROMPT = [rng.randrange(1, 256) for _ in range(18)]  # 4 full blocks + 2 tokens
FULL_BLOCKS = len(PROMPT) // BLOCK_SIZE


def held(e: Engine) -> set[int]:
    return {b for seq in e.live for b in e.session.tables.blocks(seq)}


@pytest.mark.parametrize(("tenants", "shared"), [(("acme", "globex"), False),
                                                 (("initech", "umbrella"), True)],
                         ids=["private", "group"])
def test_the_sharing_domain_decides_what_two_tenants_share(
        tenants: tuple[str, str], shared: bool, model: Any, tmp_path: Path) -> None:
    overlaps: list[set[int]] = []
    with (start_daemon(tmp_path, 96, quota=40) as d,
          client(d, tenants[0]) as ca, client(d, tenants[1]) as cb):
        a = engine(ca, tenants[0], model)
        b = engine(cb, tenants[1], model)
        # b arrives once a's prompt blocks are committed (a: admit + prefill at step 1,
        # commit at step 2), and both are still running afterwards.
        ra = a.submit(Request(PROMPT, max_new_tokens=8, request_id="a", arrival=1))
        rb = b.submit(Request(PROMPT, max_new_tokens=8, request_id="b", arrival=4))
        run_together([a, b], on_step=lambda: overlaps.append(held(a) & held(b)))
        a.close()
        b.close()
    sa, sb = samples([ra])[0], samples([rb])[0]
    assert sa.cached_tokens == [0]
    if shared:
        assert sb.cached_tokens == [FULL_BLOCKS * BLOCK_SIZE]
        assert max(len(o) for o in overlaps) == FULL_BLOCKS  # the prompt's full blocks
    else:
        assert sb.cached_tokens == [0]
        assert not any(overlaps)
    assert_same_outputs(sa, sb)
    assert_matches_reference(model, [ra, rb])
