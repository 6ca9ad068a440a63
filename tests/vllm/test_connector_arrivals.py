"""New requests' admits sent when they reach the engine core (vLLM's ``on_new_request``), driven
as vLLM's scheduler calls the connector, with vLLM's own ``Request`` and factory-built connector
and a real daemon: requests that arrive together are answered at their first ask, in the
``schedule()`` that first sees them, from one Step; with blockd frozen the scheduler waits
once, at most ``admit_wait_s``, then goes on as without the early path."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from test_connector_faults import _connector  # vLLM's own factory builds the connector
from test_connector_protocol import request, step, wait_live
from vllm_support import connector_config, start_daemon


def prompts(n: int, salt: int) -> list[object]:
    return [request(f"a{salt}-{i}", [salt * 100 + i + 1] * 40 + list(range(1, 61)))
            for i in range(n)]


def test_requests_that_arrive_together_are_answered_at_their_first_ask(tmp_path: Path,
                                                                        model_dir: Path) -> None:
    d = start_daemon(tmp_path / "blockd")
    # admit_wait_s bounds a hang only: the wait ends when the answer is in.
    extra = connector_config(d, "acme", "alice", admit_wait_s=30.0)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    counters = sched.scheduler.counters
    try:
        rs = prompts(4, 1)
        steps = counters["blockd_steps"]
        for r in rs:  # the engine core adds them (one drain of its input queue)
            sched.on_new_request(r)
        # The schedule() that first sees them: every ask is answered (no hit yet: 0).
        assert [sched.get_num_new_matched_tokens(r, 0) for r in rs] == [(0, False)] * 4
        assert counters["admitted"] == 4 and counters["admit_wait_timeouts"] == 0
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        assert counters["blockd_steps"] - steps == 1  # the four admits went in one Step
        assert wait_live(d, 4)  # each holds its sequence until it ends
        for r in rs:
            sched.request_finished(r, [])
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        assert wait_live(d, 0)
    finally:
        sched.shutdown()
        d.stop()


def test_with_blockd_frozen_the_scheduler_waits_once_then_answers_later(
        tmp_path: Path, model_dir: Path) -> None:
    d = start_daemon(tmp_path / "blockd")
    extra = connector_config(d, "acme", "alice", rpc_timeout_s=30.0,
                             admit_wait_s=0.2)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    counters = sched.scheduler.counters
    try:
        rs = prompts(3, 2)
        answers: list[object] = []
        done = threading.Event()

        def schedules() -> None:  # two schedule() calls of vLLM's scheduler thread
            for _ in range(2):
                answers.extend(sched.get_num_new_matched_tokens(r, 0) for r in rs)
                sched.build_connector_meta(step([]))
            done.set()

        d.signal(signal.SIGSTOP)
        try:
            for r in rs:
                sched.on_new_request(r)
            threading.Thread(target=schedules, daemon=True).start()
            # One wait of admit_wait_s (0.2 s), then none for retry_interval_s: a frozen
            # blockd never holds vLLM's scheduler thread longer (its deadline is 30 s).
            assert done.wait(10.0), "the scheduler thread waited for a frozen blockd"
        finally:
            d.signal(signal.SIGCONT)
        assert answers == [(None, False)] * 6  # asked again once blockd answers
        assert counters["admit_wait_timeouts"] == 1
        assert sched.scheduler.settle(40.0)
        assert [sched.get_num_new_matched_tokens(r, 0) for r in rs] == [(0, False)] * 3
        assert counters["admitted"] == 3
        for r in rs:
            sched.request_finished(r, [])
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        assert wait_live(d, 0)
    finally:
        sched.shutdown()
        d.stop()
