"""Driving the connector's two roles call by call, as vLLM's scheduler and model runner call
them, with vLLM's own ``Request``, ``SchedulerOutput``, ``KVCacheBlocks`` and
``KVConnectorOutput`` (test_connector_protocol.py and the other call-by-call tests)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from test_connector_faults import _connector  # vLLM's own factory builds both roles
from vllm_support import connector_config, stats

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


def roles(d, model_dir: Path):  # type: ignore[no-untyped-def]
    """Both roles as acme's "alice" on ``d``; every request's vLLM blocks are 0-3."""
    extra = connector_config(d, "acme", "alice")["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    worker.register_kv_caches(Blocks().caches)
    sched.scheduler.block_ids_of = lambda rid: ([0, 1, 2, 3],)
    return sched, worker


def ask(sched, r, computed: int = 0) -> tuple[int | None, bool]:  # type: ignore[no-untyped-def]
    """``get_num_new_matched_tokens`` as vLLM's scheduler asks it: the first ask of an eligible
    request answers None (its admit is queued); the admit leaves with that ``schedule()``'s
    metadata (an empty step here), off the scheduler thread; the next ask returns the answer."""
    first = sched.get_num_new_matched_tokens(r, computed)
    if first[0] is not None:
        return first  # not eligible, or degraded: answered at once
    sched.build_connector_meta(step([]))
    assert sched.scheduler.settle()
    return sched.get_num_new_matched_tokens(r, computed)


def run_worker(worker, meta, copied: bool = True) -> object:  # type: ignore[no-untyped-def]
    """What the model runner does with a step's metadata; returns the KVConnectorOutput.
    ``copied``: wait for the step's saves on the worker's copy thread before the step ends."""
    from vllm.v1.outputs import KVConnectorOutput

    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in worker.worker.views:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    if copied:
        # The saves run on the worker's copy thread (CPU tensors) and are reported once they
        # ran: in vLLM a step or two later; the driver waits, so each step reports its own.
        worker.worker.drain()
    sending, recving = worker.get_finished(set())
    out = KVConnectorOutput(finished_sending=sending or set(), finished_recving=recving or set(),
                            kv_connector_worker_meta=worker.build_connector_worker_meta(),
                            invalid_block_ids=worker.get_block_ids_with_load_errors(),
                            kv_connector_stats=worker.get_kv_connector_stats())
    worker.clear_connector_metadata()
    return out


def wait_live(d, n: int) -> bool:  # type: ignore[no-untyped-def]
    """Whether the daemon holds ``n`` live sequences within a few seconds."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if stats(d).num_sequences == n:
            return True
        time.sleep(0.1)
    return False


def kv_blocks(ids: list[int]):  # type: ignore[no-untyped-def]
    """vLLM's KVCacheBlocks of one group, from its own classes."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))
