"""The connector's two roles driven call by call, as vLLM's scheduler and model runner call them,
with vLLM's own ``Request``, ``SchedulerOutput`` and ``KVConnectorOutput`` and a real daemon.

The engine tests (test_connector*.py) show the whole; this pins down orders of events an engine
run only hits by chance, e.g. blockd dying between the scheduler's query for one request (whose
hit was promised to vLLM) and the next one: the promised loads must still run, from the worker's
mapping, or a token would change.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from connector_driver import (
    Blocks,
    ask,
    kv_blocks,
    request,
    roles,
    run_worker,
    step,
    wait_live,
)
from test_connector_faults import _connector  # vLLM's own factory builds both roles
from vllm_support import connector_config, start_daemon, stats


def test_promised_loads_run_when_blockd_dies_mid_schedule(tmp_path: Path, model_dir: Path
                                                          ) -> None:
    d = start_daemon(tmp_path / "blockd", lease_ms=5000)
    extra = connector_config(d, "acme", "alice", rpc_timeout_s=0.5,
                             retry_interval_s=60.0)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    kv = Blocks()
    worker.register_kv_caches(kv.caches)
    try:
        prompt = list(range(1, 101))  # 3 full blocks + 4 tokens
        r0 = request("r0", prompt)
        assert ask(sched, r0) == (0, False)
        vblocks = {"r0": [0, 1, 2, 3], "r1": [4, 5, 6, 7]}
        sched.scheduler.block_ids_of = lambda rid: (vblocks[rid],)
        sched.update_state_after_alloc(r0, kv_blocks([0, 1, 2, 3]), 0)
        out = run_worker(worker, sched.build_connector_meta(step([(r0, [0, 1, 2, 3], 0, 100)])))
        sched.update_connector_output(out)
        # The worker's figures as vLLM's own stats logger reads them (aggregate, reduce, log).
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

        logged: list[str] = []
        logging_ = KVConnectorLogging(sched._kv_transfer_config)
        logging_.observe(out.kv_connector_stats.to_dict())
        logging_.log(log_fn=lambda fmt, *a: logged.append(fmt % a))
        assert logged == ["KV Transfer metrics: loaded_blocks=0, saved_blocks=3, "
                          "load_failures=0, save_failures=0, map_failures=0"]
        sched.request_finished(r0, [0, 1, 2, 3])
        sched.build_connector_meta(step([]))  # commit + release, behind this step's fence
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        r1 = request("r1", prompt[:96] + [7] * 10)
        assert ask(sched, r1) == (96, False)  # hit, pinned
        d.proc.kill()  # blockd dies between two queries of one schedule
        d.proc.wait()
        r2 = request("r2", [9] * 80)
        # Its admit is queued (or, had the heartbeat thread seen blockd die first, computed).
        assert sched.get_num_new_matched_tokens(r2, 0) in ((None, False), (0, False))
        sched.update_state_after_alloc(r1, kv_blocks(vblocks["r1"]), 96)
        meta = sched.build_connector_meta(step([(r1, vblocks["r1"], 96, 10)]))
        assert sched.scheduler.settle()  # the Step with r2's admit found blockd gone
        assert sched.scheduler.degraded
        assert meta.load_vllm == [4, 5, 6]
        assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # computed
        for t in kv.caches.values():
            t[4:7].zero_()
        out = run_worker(worker, meta)
        assert not out.invalid_block_ids
        assert kv.same(4, 0) and kv.same(5, 1) and kv.same(6, 2)  # what vLLM was promised
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_one_schedule_sends_its_admits_in_one_step_and_never_waits(tmp_path: Path,
                                                                   model_dir: Path) -> None:
    """Four new requests asked in one ``schedule()`` of a busy engine (another request runs)
    while the daemon is frozen (SIGSTOP): every ask answers None and ``build_connector_meta``
    returns at once (an RPC on the scheduler thread would wait for the 30 s deadline); once the
    daemon runs again their admits went in one Step, and the next asks get the answers. The
    connector's stats report the schedules, the Steps and the scheduler thread's time. (An
    idle engine waits for its admits instead: test_connector_admit_wait.py.)"""
    import signal
    import threading

    d = start_daemon(tmp_path / "blockd")
    extra = connector_config(d, "acme", "alice", rpc_timeout_s=30.0)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    counters = sched.scheduler.counters
    try:
        # No local block tables (blockd_client's Client.attach(tables=False)): their upkeep
        # would let go of the GIL once per operation in the outbox thread's every answer.
        assert sched.scheduler.link.session.tables is None
        rs = [request(f"r{i}", [i + 1] * 40 + list(range(1, 61))) for i in range(4)]
        other = request("other", list(range(1, 101)))  # runs: the engine is busy
        sched.build_connector_meta(step([(other, [0, 1, 2, 3], 0, 100)]))
        assert sched.scheduler.settle()
        sched.get_kv_connector_stats()  # start a fresh interval
        steps = counters["blockd_steps"]
        answers: list[object] = []
        done = threading.Event()

        def schedule() -> None:  # what vLLM's scheduler thread does in one schedule()
            answers.extend(sched.get_num_new_matched_tokens(r, 0) for r in rs)
            sched.build_connector_meta(step([(other, [0, 1, 2, 3], 100, 1)]))
            done.set()

        d.signal(signal.SIGSTOP)
        try:
            threading.Thread(target=schedule, daemon=True).start()
            assert done.wait(5.0), "the scheduler thread waited on a frozen blockd"
        finally:
            d.signal(signal.SIGCONT)
        assert answers == [(None, False)] * 4
        assert sched.scheduler.settle(40.0)
        assert counters["blockd_steps"] - steps == 1  # the four admits in one Step
        assert [sched.get_num_new_matched_tokens(r, 0) for r in rs] == [(0, False)] * 4
        assert counters["admitted"] == 4
        stats = sched.get_kv_connector_stats().reduce()
        assert stats["schedules"] == 1 and stats["blockd_steps"] == 1
        assert stats["steps_per_schedule"] == 1.0 and stats["scheduler_us_per_schedule"] > 0
        for r in rs:
            sched.request_finished(r, [])
        sched.build_connector_meta(step([]))  # their releases
        assert sched.scheduler.settle()
        assert wait_live(d, 0)
    finally:
        sched.shutdown()
        d.stop()


def test_out_of_blocks_pins_and_loads_only_the_cached_prefix(tmp_path: Path, model_dir: Path
                                                             ) -> None:
    """acme may hold 4 blocks: a 3-block prompt is saved; a 6-block prompt sharing its first 2
    full blocks does not fit, so the connector pins and loads only those (no saves), and a
    prompt with nothing cached simply computes; never an error."""
    d = start_daemon(tmp_path / "blockd", acme_quota=4)
    extra = connector_config(d, "acme", "alice")["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    kv = Blocks()
    worker.register_kv_caches(kv.caches)
    vblocks = {"r0": [0, 1, 2], "r1": [3, 4, 5, 6, 7, 8]}
    sched.scheduler.block_ids_of = lambda rid: (vblocks[rid],)
    try:
        prefix = list(range(1, 65))
        r0 = request("r0", prefix + [5] * 6)  # 2 full blocks + 6 tokens
        assert ask(sched, r0) == (0, False)
        sched.update_state_after_alloc(r0, kv_blocks(vblocks["r0"]), 0)
        out = run_worker(worker, sched.build_connector_meta(step([(r0, vblocks["r0"], 0, 70)])))
        sched.update_connector_output(out)
        sched.request_finished(r0, vblocks["r0"])
        sched.build_connector_meta(step([]))
        time.sleep(0.3)
        r1 = request("r1", prefix + [6] * 120)  # 5 full blocks + 24 tokens: over the quota
        assert ask(sched, r1) == (64, False)
        assert sched.scheduler.counters["admit_no_room"] == 1
        sched.update_state_after_alloc(r1, kv_blocks(vblocks["r1"]), 64)
        meta = sched.build_connector_meta(step([(r1, vblocks["r1"], 64, 120)]))
        assert meta.load_vllm == [3, 4] and meta.save_vllm == []
        for t in kv.caches.values():
            t[3:5].zero_()
        run_worker(worker, meta)
        assert kv.same(3, 0) and kv.same(4, 1)
        r2 = request("r2", [8] * 300)
        assert ask(sched, r2) == (0, False)
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_lora_and_salt_decide_sharing(tmp_path: Path, model_dir: Path) -> None:
    """A prefix computed under LoRA adapter "a" is hit only under "a" with the same adapter
    files: not by the base model, not by "a" retrained (same name, other weights), not by
    another salt (vLLM's own LoRARequest and Request.cache_salt)."""
    from vllm.lora.request import LoRARequest

    adapter = tmp_path / "lora-a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-v1")
    d = start_daemon(tmp_path / "blockd")
    sched, worker = roles(d, model_dir)
    prompt = list(range(1, 101))
    n = iter(range(100))

    def hit(**kw: object) -> int:
        r = request(f"r{next(n)}", prompt, **kw)
        got, _ = ask(sched, r)
        sched.update_state_after_alloc(r, kv_blocks([0, 1, 2, 3]), got)
        out = run_worker(worker, sched.build_connector_meta(step([(r, [0, 1, 2, 3], got,
                                                                  100 - got)])))
        sched.update_connector_output(out)
        sched.request_finished(r, [0, 1, 2, 3])
        sched.build_connector_meta(step([]))
        time.sleep(0.3)
        return got

    lora_a = LoRARequest("a", 1, str(adapter))
    try:
        assert hit(lora_request=lora_a) == 0  # computed and saved under "a"
        assert hit(lora_request=lora_a) == 96
        assert hit() == 0  # the base model: saved now under no adapter
        assert hit() == 96
        assert hit(lora_request=lora_a, cache_salt="s1") == 0
        (adapter / "adapter_model.safetensors").write_bytes(b"weights-v2-retrained")
        retrained = LoRARequest("a", 2, str(adapter))  # same name, new weights, new vLLM id
        assert hit(lora_request=retrained) == 0
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_a_failed_save_is_never_committed_and_the_other_steps_are(tmp_path: Path,
                                                                  model_dir: Path) -> None:
    """Two requests saved in two steps; the worker's save of the second fails for real (a vLLM
    block id past its cache, refused before any copy). The failed step's plan is released
    uncommitted, the other one's is committed: the report reaches exactly the plans of its own
    steps."""
    d = start_daemon(tmp_path / "blockd")
    extra = connector_config(d, "acme", "alice")["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    worker.register_kv_caches(Blocks().caches)  # 16 vLLM blocks per layer
    vblocks = {"good": [0, 1, 2, 3], "bad": [4, 5, 99, 6]}  # 99: past the cache
    sched.scheduler.block_ids_of = lambda rid: (vblocks[rid],)
    good, bad = list(range(1, 101)), list(range(201, 301))  # 3 full blocks + 4 tokens each
    try:
        outs = {}
        for rid, prompt in (("good", good), ("bad", bad)):
            r = request(rid, prompt)
            assert ask(sched, r) == (0, False)
            sched.update_state_after_alloc(r, kv_blocks(vblocks[rid]), 0)
            outs[rid] = run_worker(worker, sched.build_connector_meta(
                step([(r, vblocks[rid], 0, 100)])))
            sched.update_connector_output(outs[rid])
            sched.request_finished(r, vblocks[rid])
        assert outs["good"].kv_connector_worker_meta.ok
        assert outs["bad"].kv_connector_worker_meta.failed
        assert not outs["bad"].kv_connector_worker_meta.ok
        assert sched.scheduler.counters["save_failures"] == 1
        assert not sched.scheduler.copies.saving  # every reported step left the index
        sched.build_connector_meta(step([]))  # commit "good", release both
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        assert ask(sched, request("g2", good)) == (96, False)
        assert ask(sched, request("b2", bad)) == (0, False)
        assert sched.scheduler.counters["committed_blocks"] == 3
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_a_reaped_session_reattaches_and_the_admits_that_found_out_go_again(
        tmp_path: Path, model_dir: Path) -> None:
    """The engine stalls past its lease (its heartbeat thread stopped here): blockd reaps the
    session. The next Step, carrying a new request's admit, is refused (unknown session); the
    link re-attaches, and that admit goes again on the new session instead of being computed:
    it hits the prefix committed before the stall. The stats say so."""
    d = start_daemon(tmp_path / "blockd", lease_ms=1500)
    sched, worker = roles(d, model_dir)
    prompt = list(range(1, 101))
    try:
        r0 = request("r0", prompt)
        assert ask(sched, r0) == (0, False)
        sched.update_state_after_alloc(r0, kv_blocks([0, 1, 2, 3]), 0)
        out = run_worker(worker, sched.build_connector_meta(step([(r0, [0, 1, 2, 3], 0, 100)])))
        sched.update_connector_output(out)
        sched.request_finished(r0, [0, 1, 2, 3])
        sched.build_connector_meta(step([]))  # commit + release
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        link = sched.scheduler.link
        link._stop.set()  # the stall: no heartbeat from here on
        link._beat.join()
        deadline = time.monotonic() + 30
        while "lease expired" not in d.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "lease expired" in d.log_text()
        sched.get_kv_connector_stats()  # a fresh interval
        r1 = request("r1", prompt[:96] + [7] * 10)
        # Its Step finds the session gone; the link re-attaches and queues the admit again,
        # and the idle engine's next ask sends it on the new session and waits: a hit.
        assert ask(sched, r1) == (96, False)
        counters = sched.scheduler.counters
        assert counters["epoch_changes"] == 1 and counters["admits_resent"] == 1
        stats = sched.get_kv_connector_stats().reduce()
        assert stats["epoch_changes"] == 1 and stats["admits_resent"] == 1
        assert stats["degraded_episodes"] == 0
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_a_clean_worker_shutdown_applies_the_last_commit_before_detaching(
        tmp_path: Path, model_dir: Path) -> None:
    """The engine stops right after its last request: the commit Step went after the worker's
    last step, so no worker fence covers it, and the scheduler side never reports it (its
    heartbeat thread stopped here, as when vLLM tears the engine down). The worker's shutdown
    reports every issued fence done before it detaches: the commit applies, and another
    engine's session hits the prompt (before: dropped with the session, a miss)."""
    d = start_daemon(tmp_path / "blockd")
    sched, worker = roles(d, model_dir)
    other = None
    prompt = list(range(1, 101))
    try:
        r0 = request("r0", prompt)
        assert ask(sched, r0) == (0, False)
        sched.update_state_after_alloc(r0, kv_blocks([0, 1, 2, 3]), 0)
        out = run_worker(worker, sched.build_connector_meta(step([(r0, [0, 1, 2, 3], 0, 100)])))
        link = sched.scheduler.link
        link._stop.set()  # no heartbeat: nothing reports the commit's fence
        link._beat.join()
        sched.update_connector_output(out)
        sched.request_finished(r0, [0, 1, 2, 3])
        sched.build_connector_meta(step([]))  # commit + release, behind a fence no step covers
        assert sched.scheduler.settle()
        other = _connector(model_dir, connector_config(d, "acme", "alice2")[
            "kv_connector_extra_config"], "SCHEDULER")
        assert ask(other, request("r1", prompt[:96] + [5] * 8)) == (0, False)  # deferred
        worker.shutdown()  # the engine stops: the worker detaches the session
        assert ask(other, request("r2", prompt[:96] + [6] * 8)) == (96, False)
    finally:
        for c in (other, sched):
            if c is not None:
                c.shutdown()
        d.stop()


def test_the_scheduler_side_never_reattaches_a_session_its_worker_detached(
        tmp_path: Path, model_dir: Path) -> None:
    """vLLM shuts the workers down first: the worker detaches the engine's session while the
    scheduler side still runs (its heartbeat, its last Steps). blockd answers those "detached",
    so the scheduler side stops using blockd instead of re-attaching a session nobody would
    detach (it stayed until its lease ran out: the clean-exit engine test's 1 session)."""
    d = start_daemon(tmp_path / "blockd")
    sched, worker = roles(d, model_dir)
    try:
        r0 = request("r0", list(range(1, 101)))
        assert ask(sched, r0) == (0, False)
        sched.update_state_after_alloc(r0, kv_blocks([0, 1, 2, 3]), 0)
        run_worker(worker, sched.build_connector_meta(step([(r0, [0, 1, 2, 3], 0, 100)])))
        assert stats(d).num_sessions == 1
        worker.shutdown()  # the worker detaches the session
        assert stats(d).num_sessions == 0
        link = sched.scheduler.link
        for _ in range(100):  # the heartbeat thread (or the next Step) hears of it
            if link.ended:
                break
            sched.build_connector_meta(step([]))
            sched.scheduler.settle()
            time.sleep(0.05)
        assert "detached" in link.ended
        assert link.degraded and not link._beat.is_alive()
        assert ask(sched, request("r1", list(range(1, 101)))) == (0, False)  # computed
        assert stats(d).num_sessions == 0  # nobody re-attached
        stats_now = sched.get_kv_connector_stats().reduce()
        assert stats_now["epoch_changes"] == 0
    finally:
        sched.shutdown()
        d.stop()
    assert stats_now["degraded_episodes"] == 0


@pytest.fixture(autouse=True)
def _vllm(model_dir: Path) -> None:
    """(model_dir skips the module when vLLM is not importable)"""
