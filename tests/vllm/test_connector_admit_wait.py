"""``admit_wait_s``: a new request never waits long for blockd while the engine runs others.

The daemon is frozen for real (SIGSTOP) while a request's admit is in flight. With other work
running, the request's next ask after ``admit_wait_s`` answers "no hit" at once (vLLM computes it
with the others instead of leaving it out of their batch); when the daemon runs again its admit's
answer is adopted, the prompt saved from the request's vLLM blocks and committed, so another
request hits it. A request that ends before the late answer leaks nothing; an idle engine (its
last step ran nothing) keeps waiting, so a hit is never given up when nothing else could run.
The connector is built by vLLM's own factory, the worker copies through real tensors.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from connector_driver import Blocks, ask, kv_blocks, request, run_worker, step, wait_live
from test_connector_faults import _connector
from vllm_support import connector_config, start_daemon

WAIT_S = 0.05


def both_roles(d, model_dir: Path, vblocks: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    extra = connector_config(d, "acme", "alice", rpc_timeout_s=30.0,
                             admit_wait_s=WAIT_S)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    worker.register_kv_caches(Blocks().caches)  # 16 vLLM blocks per layer
    sched.scheduler.block_ids_of = lambda rid: (vblocks[rid],)
    return sched, worker


def test_a_late_answer_never_holds_a_request_back_and_its_prompt_is_still_saved(
        tmp_path: Path, model_dir: Path) -> None:
    d = start_daemon(tmp_path / "blockd")
    vblocks = {"busy": [0, 1, 2, 3], "late": [4, 5, 6, 7], "gone": [8, 9, 10, 11],
               "again": [12, 13, 14, 15], "idle": [0, 1, 2, 3]}
    sched, worker = both_roles(d, model_dir, vblocks)
    counters = sched.scheduler.counters
    busy = request("busy", list(range(1, 101)))
    late = request("late", list(range(301, 401)))  # 3 full blocks + 4 tokens
    gone = request("gone", list(range(501, 601)))
    try:
        # Another request runs (its prefill step): the engine is busy from now on.
        assert ask(sched, busy) == (0, False)
        sched.update_state_after_alloc(busy, kv_blocks(vblocks["busy"]), 0)
        sched.update_connector_output(run_worker(worker, sched.build_connector_meta(
            step([(busy, vblocks["busy"], 0, 100)]))))
        # Two new requests asked; the Step carrying their admits meets a frozen daemon.
        assert sched.get_num_new_matched_tokens(late, 0) == (None, False)
        assert sched.get_num_new_matched_tokens(gone, 0) == (None, False)
        d.signal(signal.SIGSTOP)
        try:
            sched.update_connector_output(run_worker(worker, sched.build_connector_meta(
                step([(busy, vblocks["busy"], 100, 1)]))))  # a decode step of "busy"
            time.sleep(WAIT_S * 1.5)
            t0 = time.monotonic()
            # The next schedule(): past admit_wait_s, both are computed without the cache.
            assert sched.get_num_new_matched_tokens(late, 0) == (0, False)
            assert sched.get_num_new_matched_tokens(gone, 0) == (0, False)
            assert time.monotonic() - t0 < 1.0  # answered at once, the daemon still frozen
            assert counters["admit_wait_expired"] == 2
            sched.update_state_after_alloc(late, kv_blocks(vblocks["late"]), 0)
            # "late" is computed in this step, beside "busy": nothing to save yet (no plan).
            meta = sched.build_connector_meta(step([(late, vblocks["late"], 0, 100),
                                                    (busy, vblocks["busy"], 101, 1)]))
            assert meta.save_vllm == []
            sched.update_connector_output(run_worker(worker, meta))
            sched.request_finished(gone, [])  # ends before blockd answers its admit
        finally:
            d.signal(signal.SIGCONT)
        assert sched.scheduler.settle(40.0)
        # The late answer is adopted: a plan that loads nothing and saves the whole prompt.
        plan = sched.scheduler.plans["late"]
        assert (plan.hit_tokens, plan.saved) == (0, 0)
        assert counters["late_plans"] == 1
        meta = sched.build_connector_meta(step([(late, vblocks["late"], 100, 1)]))
        assert meta.save_vllm == vblocks["late"][:3]  # its 3 full prompt blocks
        sched.update_connector_output(run_worker(worker, meta))
        for r, vb in ((late, vblocks["late"]), (busy, vblocks["busy"])):
            sched.request_finished(r, vb)
        sched.build_connector_meta(step([]))  # commits and releases
        assert sched.scheduler.settle()
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        # What the late request computed is in blockd: another request hits all of it.
        again = request("again", list(range(301, 401)))
        assert ask(sched, again) == (96, False)
        sched.request_finished(again, [])
        # An idle engine (its last step ran nothing) keeps waiting past admit_wait_s.
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        idle = request("idle", list(range(701, 801)))
        assert sched.get_num_new_matched_tokens(idle, 0) == (None, False)
        d.signal(signal.SIGSTOP)
        try:
            sched.build_connector_meta(step([]))
            time.sleep(WAIT_S * 1.5)
            assert sched.get_num_new_matched_tokens(idle, 0) == (None, False)
        finally:
            d.signal(signal.SIGCONT)
        assert sched.scheduler.settle(40.0)
        assert sched.get_num_new_matched_tokens(idle, 0) == (0, False)  # its answer
        assert counters["admit_wait_expired"] == 2
        sched.request_finished(idle, [])
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        # Nothing leaked: "gone"'s late admit was released, every other request too.
        assert wait_live(d, 0)
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()
