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
import torch
from test_connector_faults import _connector  # vLLM's own factory builds both roles
from vllm_support import connector_config, start_daemon

B = 32


def request(rid: str, tokens: list[int], **kw: object):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=4), None, **kw)


def step(scheduled: list[tuple[object, list[int], int, int]]):  # type: ignore[no-untyped-def]
    """A SchedulerOutput of new requests: (request, its vLLM blocks, computed, scheduled)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [NewRequestData(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                          mm_features=[], sampling_params=None, pooling_params=None,
                          block_ids=(blocks,), num_computed_tokens=c, lora_request=None)
           for r, blocks, c, _ in scheduled]
    cached = CachedRequestData(req_ids=[], resumed_req_ids=set(), new_token_ids=[],
                               all_token_ids={}, new_block_ids=[], num_computed_tokens=[],
                               num_output_tokens=[])
    n = {r.request_id: s for r, _, _, s in scheduled}
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=n, total_num_scheduled_tokens=sum(n.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


class Blocks:
    """vLLM's KV cache of the tiny model on the CPU backend: per layer [blocks, H, B, 2D]."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.caches = {f"model.layers.{i}.self_attn.attn": torch.randn(16, 2, B, 64, generator=g)
                       for i in range(2)}

    def same(self, a: int, b: int) -> bool:
        return all(torch.equal(t[a], t[b]) for t in self.caches.values())


def run_worker(worker, meta) -> object:  # type: ignore[no-untyped-def]
    """What the model runner does with a step's metadata; returns the KVConnectorOutput."""
    from vllm.v1.outputs import KVConnectorOutput

    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in worker.worker.views:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    out = KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta(),
                            invalid_block_ids=worker.get_block_ids_with_load_errors(),
                            kv_connector_stats=worker.get_kv_connector_stats())
    worker.clear_connector_metadata()
    return out


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
        assert sched.get_num_new_matched_tokens(r0, 0) == (0, False)
        vblocks = {"r0": [0, 1, 2, 3], "r1": [4, 5, 6, 7]}
        sched.scheduler.block_ids_of = lambda rid: (vblocks[rid],)
        sched.update_state_after_alloc(r0, _blocks([0, 1, 2, 3]), 0)
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
        assert sched.get_num_new_matched_tokens(r1, 0) == (96, False)  # hit, pinned
        d.proc.kill()  # blockd dies between two queries of one schedule
        d.proc.wait()
        r2 = request("r2", [9] * 80)
        assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # degraded
        assert sched.scheduler.degraded
        sched.update_state_after_alloc(r1, _blocks(vblocks["r1"]), 96)
        meta = sched.build_connector_meta(step([(r1, vblocks["r1"], 96, 10)]))
        assert meta.load_vllm == [4, 5, 6] and not meta.save_vllm
        for t in kv.caches.values():
            t[4:7].zero_()
        out = run_worker(worker, meta)
        assert not out.invalid_block_ids
        assert kv.same(4, 0) and kv.same(5, 1) and kv.same(6, 2)  # what vLLM was promised
    finally:
        worker.shutdown()
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
        assert sched.get_num_new_matched_tokens(r0, 0) == (0, False)
        sched.update_state_after_alloc(r0, _blocks(vblocks["r0"]), 0)
        out = run_worker(worker, sched.build_connector_meta(step([(r0, vblocks["r0"], 0, 70)])))
        sched.update_connector_output(out)
        sched.request_finished(r0, vblocks["r0"])
        sched.build_connector_meta(step([]))
        time.sleep(0.3)
        r1 = request("r1", prefix + [6] * 120)  # 5 full blocks + 24 tokens: over the quota
        assert sched.get_num_new_matched_tokens(r1, 0) == (64, False)
        assert sched.scheduler.counters["admit_no_room"] == 1
        sched.update_state_after_alloc(r1, _blocks(vblocks["r1"]), 64)
        meta = sched.build_connector_meta(step([(r1, vblocks["r1"], 64, 120)]))
        assert meta.load_vllm == [3, 4] and meta.save_vllm == []
        for t in kv.caches.values():
            t[3:5].zero_()
        run_worker(worker, meta)
        assert kv.same(3, 0) and kv.same(4, 1)
        r2 = request("r2", [8] * 300)
        assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)
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
    extra = connector_config(d, "acme", "alice")["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    worker.register_kv_caches(Blocks().caches)
    sched.scheduler.block_ids_of = lambda rid: ([0, 1, 2, 3],)
    prompt = list(range(1, 101))
    n = iter(range(100))

    def hit(**kw: object) -> int:
        r = request(f"r{next(n)}", prompt, **kw)
        got, _ = sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, _blocks([0, 1, 2, 3]), got)
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
            assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
            sched.update_state_after_alloc(r, _blocks(vblocks[rid]), 0)
            outs[rid] = run_worker(worker, sched.build_connector_meta(
                step([(r, vblocks[rid], 0, 100)])))
            sched.update_connector_output(outs[rid])
            sched.request_finished(r, vblocks[rid])
        assert outs["good"].kv_connector_worker_meta.ok
        assert outs["bad"].kv_connector_worker_meta.failed
        assert not outs["bad"].kv_connector_worker_meta.ok
        assert sched.scheduler.counters["save_failures"] == 1
        assert not sched.scheduler.saving  # every reported step left the index
        sched.build_connector_meta(step([]))  # commit "good", release both
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        assert sched.get_num_new_matched_tokens(request("g2", good), 0) == (96, False)
        assert sched.get_num_new_matched_tokens(request("b2", bad), 0) == (0, False)
        assert sched.scheduler.counters["committed_blocks"] == 3
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def _blocks(ids: list[int]):  # type: ignore[no-untyped-def]
    """vLLM's KVCacheBlocks of one group, from its own classes."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


@pytest.fixture(autouse=True)
def _vllm(model_dir: Path) -> None:
    """(model_dir skips the module when vLLM is not importable)"""
