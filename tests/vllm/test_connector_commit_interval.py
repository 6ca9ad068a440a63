"""When the scheduler side's commits and releases go to blockd (``commit_interval_s``): a busy
engine's wait for a Step that carries them, and none is lost. The connector's roles driven call
by call with vLLM's own ``Request`` and ``SchedulerOutput`` on a real daemon, as in
test_connector_protocol.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from connector_driver import Blocks, ask, kv_blocks, request, run_worker, step
from test_connector_faults import _connector
from vllm_support import connector_config, start_daemon


def test_a_busy_engines_commits_wait_for_a_step_that_carries_them_and_none_is_lost(
        tmp_path: Path, model_dir: Path) -> None:
    """``commit_interval_s``: while the engine runs work, commits and releases alone make no
    Step of their own before the interval; the next admit takes them along (commits first, so
    they are in the index before the admits look), and a step that runs nothing (the engine
    may be ending) sends what waits at once."""
    d = start_daemon(tmp_path / "blockd")
    extra = connector_config(d, "acme", "alice",
                             commit_interval_s=3600.0)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    worker.register_kv_caches(Blocks().caches)
    vblocks = {"r0": [0, 1, 2, 3], "short": [4], "r1": [5, 6, 7, 8], "r2": [9, 10, 11, 12]}
    sched.scheduler.block_ids_of = lambda rid: (vblocks[rid],)
    counters = sched.scheduler.counters
    prompt = list(range(1, 101))  # 3 full blocks + 4 tokens
    link = sched.scheduler.link
    link._stop.set()  # no heartbeat thread: only the steps send (the worker publishes fences)
    link._beat.join()
    short = request("short", [7, 8, 9])  # too short to share: keeps the engine busy
    assert ask(sched, short) == (0, False)
    busy = (short, vblocks["short"], 0, 3)
    try:
        r0 = request("r0", prompt)
        assert ask(sched, r0) == (0, False)
        sched.update_state_after_alloc(r0, kv_blocks(vblocks["r0"]), 0)
        sched.update_connector_output(run_worker(worker, sched.build_connector_meta(
            step([(r0, vblocks["r0"], 0, 100), busy]))))  # r0's prompt saved and reported
        sched.request_finished(r0, vblocks["r0"])  # to commit, then release
        assert sched.scheduler.settle()
        sent = counters["blockd_steps"]
        for _ in range(3):  # busy steps: the commit and release wait
            run_worker(worker, sched.build_connector_meta(step([busy])))
        assert sched.scheduler.settle()
        assert counters["blockd_steps"] == sent
        assert counters["committed_blocks"] == 0
        # A new request's admit carries them out. No copy is in flight (a decode step copies
        # nothing), so every fence announced is done: the commit goes first, in a Step of its
        # own, and the admit in the next, which reports the first one's fence done, so the
        # new request already hits r0's prompt.
        r1 = request("r1", prompt[:96] + [5] * 8)
        assert sched.get_num_new_matched_tokens(r1, 0) == (None, False)
        run_worker(worker, sched.build_connector_meta(step([busy])))
        assert sched.scheduler.settle()
        assert counters["blockd_steps"] == sent + 2
        assert counters["committed_blocks"] == 3
        assert sched.get_num_new_matched_tokens(r1, 0) == (96, False)
        # The commit joins the index once its fence is done (the worker's next step).
        run_worker(worker, sched.build_connector_meta(step([busy])))
        time.sleep(0.3)  # blockd's poller reads the fence page
        r2 = request("r2", prompt[:96] + [6] * 8)
        assert ask(sched, r2) == (96, False)  # the empty step of ``ask`` sent the rest too
        assert not sched.scheduler.plans.keys() - {"r1", "r2"}  # r0 released
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


@pytest.fixture(autouse=True)
def _vllm(model_dir: Path) -> None:
    """(model_dir skips the module when vLLM is not importable)"""
