"""The connector and a Step that blockd applied but whose answer never came back in time (a
loaded node, a lost answer): the request computes without the cache as designed, and once
blockd answers again the connector gets that Step's answer (``Session.settle``) and releases the
sequence its admit created, which nothing else names. The answer is held in a real relay
between vLLM's connector (built by vLLM's own factory) and a real daemon.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from connector_driver import request, step
from test_connector_faults import _connector
from vllm_support import HERE, connector_config, start_daemon, stats

sys.path.insert(0, str(HERE.parent / "server"))
from answer_relay import AnswerRelay  # noqa: E402


def held_sequences(d, want: int, timeout: float = 15.0) -> int:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (n := stats(d).num_sequences) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_an_admit_answered_too_late_is_released_once_blockd_answers(tmp_path: Path,
                                                                     model_dir: Path) -> None:
    d = start_daemon(tmp_path / "blockd", lease_ms=5000)
    relay = AnswerRelay(d.endpoints["unix"], tmp_path / "relay.sock")
    extra = connector_config(d, "acme", "alice", rpc_timeout_s=0.5,
                             retry_interval_s=0.3)["kv_connector_extra_config"]
    extra["target"] = relay.target
    sched = _connector(model_dir, extra, "SCHEDULER")
    try:
        r0 = request("r0", list(range(1, 101)))  # 3 full blocks + 4 tokens
        assert sched.get_num_new_matched_tokens(r0, 0) == (None, False)  # its admit is queued
        relay.hold()
        sched.build_connector_meta(step([]))  # the Step with r0's admit: applied, unanswered
        assert sched.scheduler.settle()
        assert sched.scheduler.degraded
        assert held_sequences(d, 1) == 1  # blockd admitted it; only the lost answer names it
        assert sched.get_num_new_matched_tokens(r0, 0) == (0, False)  # computed, no cache
        relay.let_go()
        # blockd answers again: the lost Step's answer is fetched (same step_id, not applied
        # twice) and the sequence nobody takes is released; with the session still alive
        # (heartbeats), nothing else would ever free it.
        assert held_sequences(d, 0) == 0
        assert not sched.scheduler.degraded
        counters = sched.scheduler.counters
        assert (counters["late_answers"], counters["late_admits_released"]) == (1, 1)
        assert counters["degraded_episodes"] == 1
        # The connector goes on: the next request is admitted and answered as usual.
        r1 = request("r1", list(range(1, 101)))
        assert sched.get_num_new_matched_tokens(r1, 0) == (None, False)
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)  # admitted, nothing cached
        assert held_sequences(d, 1) == 1
    finally:
        sched.shutdown()
        relay.close()
        d.stop()
