"""A new request's admit on its arrival (``on_new_request``), driven call by call as vLLM's
scheduler calls the hooks, with vLLM's own ``Request`` and ``SchedulerOutput`` and a real
daemon (frozen with SIGSTOP where an order of events must be pinned down).

On an idle engine the admit leaves when vLLM adds the request, so the first ``schedule()`` that
asks about it gets the answer in that very ask (it waits, as an idle engine's ask always did)
instead of running an empty step first. When blockd is owed something (a Step in flight, a
release or a commit still to send), the admit only queues and goes with the next
``schedule()``'s Step, behind it. Requests that arrive together at an idle engine while the
first one's admit is in flight: the ``schedule()``'s first ask of one of them sends all their
queued admits in one Step and waits for it, so they all run in the engine's first step.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from connector_driver import request, roles, run_worker, step
from vllm_support import start_daemon


@contextmanager
def _roles(tmp_path: Path, model_dir: Path):  # type: ignore[no-untyped-def]
    """A daemon and both roles (``test_connector_protocol.roles``), shut down after."""
    d = start_daemon(tmp_path / "blockd")
    sched, worker = roles(d, model_dir)
    try:
        yield d, sched, worker
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def _finish(sched, requests) -> None:  # type: ignore[no-untyped-def]
    """The requests end; their releases go with the next (empty) step's Step."""
    for r in requests:
        sched.request_finished(r, [])
    sched.build_connector_meta(step([]))
    assert sched.scheduler.settle()


def test_an_idle_engines_first_ask_gets_the_answer_of_the_admit_sent_on_arrival(
        tmp_path: Path, model_dir: Path) -> None:
    """The engine ran a request before, which ended: idle again, though its last step ran a
    batch (which told the connector nothing about the engine going idle)."""
    r0, r1, r2, r3 = (request(f"n{i}", [i + 5] * 100) for i in range(4))
    with _roles(tmp_path, model_dir) as (d, sched, worker):
        side = sched.scheduler
        sched.on_new_request(r0)
        assert sched.get_num_new_matched_tokens(r0, 0) == (0, False)
        meta = sched.build_connector_meta(step([(r0, [0, 1, 2, 3], 0, 100)]))  # its last step
        sched.update_connector_output(run_worker(worker, meta))  # r0's saves reported
        sched.request_finished(r0, [])
        # The heartbeat thread sends what the idle engine still owes (r0's release).
        deadline = time.monotonic() + 5
        while side.dirty or side.to_release or side.steps.outbox.busy:
            assert time.monotonic() < deadline, "an idle engine's release was never sent"
            time.sleep(0.02)
        steps = side.counters["blockd_steps"]
        d.signal(signal.SIGSTOP)  # r1's Step stays in flight while r2 and r3 arrive
        try:
            added = threading.Event()

            def arrive() -> None:  # vLLM's add_request, on the scheduler thread
                for r in (r1, r2, r3):
                    sched.on_new_request(r)
                added.set()

            threading.Thread(target=arrive, daemon=True).start()
            assert added.wait(5.0), "on_new_request waited on a frozen blockd"
            assert list(side.admits.in_flight) == [r1.request_id]  # left at once
            # A Step is in flight: they only queue.
            assert list(side.admits.queued) == [r2.request_id, r3.request_id]
        finally:
            d.signal(signal.SIGCONT)
        # The first schedule(): the ask of r1 waits for its answer (no empty step first); the
        # ask of r2 sends the queued admits in one Step and waits for it, so r2 and r3 run in
        # this step too (not a step later, in a step of their own).
        assert [sched.get_num_new_matched_tokens(r, 0) for r in (r1, r2, r3)] == [(0, False)] * 3
        assert side.counters["blockd_steps"] - steps == 2 and not side.admits.queued
        for r in (r1, r2, r3):
            sched.update_state_after_alloc(r, None, 0)
        sched.build_connector_meta(step([(r1, [0, 1, 2, 3], 0, 100)]))
        assert side.settle()
        assert side.counters["admitted"] == 4
        # Every Step went over one StepStream (blockd_client's StepStreamer), opened once.
        assert side.link.session.streamer.opened == 1
        _finish(sched, (r1, r2, r3))


def test_an_admit_on_arrival_waits_behind_what_blockd_is_owed(tmp_path: Path,
                                                              model_dir: Path) -> None:
    """A release still to send (a request that ended before taking its answer): the next
    arrival's admit only queues; the next schedule()'s Step carries the release, then it."""
    r0, r1 = (request(f"o{i}", [i + 9] * 100) for i in range(2))
    with _roles(tmp_path, model_dir) as (_, sched, _worker):
        side = sched.scheduler
        sched.on_new_request(r0)
        assert side.settle() and r0.request_id in side.admits.answers
        sched.request_finished(r0, [])  # aborted before any schedule() took its answer
        assert side.to_release  # its sequence is released with the next Step
        sched.on_new_request(r1)
        assert r1.request_id in side.admits.queued and not side.steps.outbox.busy
        sched.build_connector_meta(step([]))
        assert side.settle()
        assert not side.to_release and r1.request_id not in side.admits.queued
        assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
        _finish(sched, (r1,))
