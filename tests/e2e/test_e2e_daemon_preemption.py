"""Daemon-side preemption between two reference engines changes no logit.

Engine ``low`` (requests of priority 0) fills a tight pool; engine ``high`` (priority 5, same
tenant, another session) arrives later. The daemon preempts ``low``'s latest sequences for
``high``'s admissions and appends; ``low`` learns it from its Step responses (or an ABORTED
operation), recomputes those samples, and every generated position of both engines still
equals a contiguous, no-cache forward pass.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from e2e_support import assert_matches_reference, client, engine, run_together, start_daemon

from blockd_apps.reference import Request


def test_daemon_preemption_for_higher_priority_changes_no_logit(model: Any,
                                                                  tmp_path: Path) -> None:
    rng = random.Random(3)
    with (start_daemon(tmp_path, 24) as d,
          client(d, "acme") as cl, client(d, "acme") as ch):
        low = engine(cl, "acme", model)
        high = engine(ch, "acme", model)
        lows = [low.submit(Request([rng.randrange(1, 256) for _ in range(18)],
                                   max_new_tokens=10, request_id=f"low{i}", arrival=1,
                                   priority=0)) for i in range(4)]
        highs = [high.submit(Request([rng.randrange(1, 256) for _ in range(12)],
                                     max_new_tokens=10, request_id=f"high{i}",
                                     arrival=3 + 2 * i, priority=5)) for i in range(3)]
        run_together([low, high])
        stats = cl.stats()
        low.close()
        high.close()
    assert low.stats.daemon_preemptions > 0, "the workload was built to preempt"
    assert high.stats.daemon_preemptions == 0  # nothing outranks it
    assert stats.num_sequences == 0
    assert_matches_reference(model, lows + highs)
