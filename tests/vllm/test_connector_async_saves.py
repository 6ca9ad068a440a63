"""Saves on the worker's copy thread (CPU tensors), driven call by call as vLLM calls the hooks,
with vLLM's own classes and a real daemon: the copy of a step's saves may still run while vLLM
takes the step's output and schedules the next, so whatever could overwrite its source waits
for it. A request that ends with a save in flight keeps its vLLM blocks (``request_finished``
True) until the worker reports it sent, which it does only once the copy ran, and its blocks
are committed (hittable) only then; a step after a preemption starts by waiting for the copies
in flight (``BlockdMetadata.drain``, vLLM's ``handle_preemptions``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from connector_driver import ask, kv_blocks, request, roles, run_worker, step
from vllm_support import start_daemon, stats

PROMPT = list(range(1, 101))  # 3 full blocks + 4 tokens


def _saving(sched, worker):  # type: ignore[no-untyped-def]
    """r0 admitted and scheduled, its step run with its copies held back on the copy thread
    (returns the gate that lets them run)."""
    r0 = request("r0", PROMPT)
    assert ask(sched, r0) == (0, False)
    sched.update_state_after_alloc(r0, kv_blocks([0, 1, 2, 3]), 0)
    meta = sched.build_connector_meta(step([(r0, [0, 1, 2, 3], 0, 100)]))
    assert meta.save_vllm == [0, 1, 2] and not meta.drain
    gate = threading.Event()
    worker.worker.copier.submit(lambda: gate.wait(10))  # the thread is still busy
    out = run_worker(worker, meta, copied=False)
    assert out.kv_connector_worker_meta is None  # nothing reported before the copy ran
    sched.update_connector_output(out)
    return r0, gate


def test_a_request_ending_with_a_save_in_flight_keeps_its_blocks_until_it_ran(
        tmp_path: Path, model_dir: Path) -> None:
    d = start_daemon(tmp_path / "blockd")
    sched, worker = roles(d, model_dir)
    try:
        assert sched.scheduler.async_saves  # vLLM's CPU build
        r0, gate = _saving(sched, worker)
        assert sched.request_finished(r0, [0, 1, 2, 3]) == (True, None)  # held
        meta = sched.build_connector_meta(step([]))
        assert meta.sent == ["r0"]
        out = run_worker(worker, meta, copied=False)
        assert not out.finished_sending  # vLLM keeps r0's blocks: the copy has not run
        sched.update_connector_output(out)
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        assert stats(d).blocks_committed == 0 and stats(d).blocks_cached == 0
        gate.set()
        worker.worker.drain()
        out = run_worker(worker, sched.build_connector_meta(step([])))
        assert out.finished_sending == {"r0"}  # vLLM frees r0's blocks now
        sched.update_connector_output(out)
        sched.build_connector_meta(step([]))  # the commit and the release
        assert sched.scheduler.settle()
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        assert ask(sched, request("r1", PROMPT[:96] + [7] * 10)) == (96, False)
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_a_step_after_a_preemption_first_waits_for_the_saves_in_flight(
        tmp_path: Path, model_dir: Path) -> None:
    d = start_daemon(tmp_path / "blockd")
    sched, worker = roles(d, model_dir)
    try:
        _, gate = _saving(sched, worker)
        calm = sched.build_connector_meta(step([]))
        assert not calm.drain  # copies in flight, but no preemption
        so = step([])
        so.preempted_req_ids = {"r0"}  # vLLM freed r0's blocks: they may be written next
        meta = sched.build_connector_meta(so)
        assert meta.drain
        threading.Timer(0.3, gate.set).start()
        t0 = time.monotonic()
        worker.handle_preemptions(meta)
        assert time.monotonic() - t0 >= 0.25  # returned only once the copy ran
        assert not worker.worker.copier.busy
        out = run_worker(worker, meta)
        assert out.kv_connector_worker_meta is not None
        assert out.kv_connector_worker_meta.ok == {1}
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()
