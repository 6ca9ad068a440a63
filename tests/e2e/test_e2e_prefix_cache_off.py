"""The seeds' debugging step 4: with prefix caching disabled the outputs are identical, only
slower (every prompt token is computed again).

Two ways to disable it: per request (``AdmitOp.disable_prefix_cache``) and for the whole
daemon (``cache.enable_prefix_cache: false``). The workload is the shared-system-prompt one of
test_e2e_reference_logits (forks included). Same generated tokens; logits within atol 1e-5 of
the cached run (only the batching of prompt chunks differs) and within 1e-4 of the reference.
"Slower" is measured as work, not wall time (which is noisy on a shared machine): more prompt
tokens computed and no prefix hit at all; wall times are printed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    assert_matches_reference,
    assert_same_runs,
    run_engine,
    shared_prompt_workload,
    start_daemon,
)


def timed_run(d: Any, model: Any, requests: list[Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    e, states, stats = run_engine(d, "acme", model, requests)
    return {"engine": e, "states": states, "stats": stats, "seconds": time.perf_counter() - t0}


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory, model: Any) -> dict[str, Any]:
    with start_daemon(tmp_path_factory.mktemp("cache-on"), 128) as d:
        return timed_run(d, model, shared_prompt_workload())


@pytest.mark.parametrize("how", ["per request", "daemon config"])
def test_disabling_the_prefix_cache_changes_nothing_but_the_work(
        how: str, cached: dict[str, Any], model: Any, tmp_path: Path) -> None:
    extra: dict[str, dict[str, Any]] = {}
    if how == "per request":
        requests = [dataclasses.replace(r, cache=False) for r in shared_prompt_workload()]
    else:
        extra = {"cache": {"enable_prefix_cache": False}}
        requests = shared_prompt_workload()
    with start_daemon(tmp_path, 128, extra=extra) as d:
        off = timed_run(d, model, requests)
    on_stats, off_stats = cached["engine"].stats, off["engine"].stats
    print(f"\n{how}: cache on {cached['seconds']:.2f} s, {on_stats.prefill_tokens} prompt "
          f"tokens computed; off {off['seconds']:.2f} s, {off_stats.prefill_tokens}")
    assert_same_runs(cached["states"], off["states"])
    assert_matches_reference(model, off["states"])
    # Only slower: no hit, so every prompt token of every admission is computed.
    assert on_stats.hit_tokens > 0 and cached["stats"].prefix_hit_tokens_total > 0
    assert off_stats.hit_tokens == 0 and off["stats"].prefix_hit_tokens_total == 0
    assert off_stats.prefill_tokens == on_stats.prefill_tokens + on_stats.hit_tokens
    assert off_stats.decode_tokens == on_stats.decode_tokens
