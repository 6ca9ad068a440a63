"""vLLM's GPU prefix cache with its CPU offloading tier, called as vLLM's scheduler calls them.

GPU tier: vLLM's v1 ``KVCacheManager``, built and driven as in bench/peers/vllm_driver.py.
CPU tier: the scheduler side of vLLM's ``OffloadingConnector``, i.e.
``OffloadingConnectorScheduler`` (``distributed/kv_transfer/kv_connector/v1/offloading/``),
over the ``CPUOffloadingManager`` (``v1/kv_offload/cpu/manager.py``) that
``CPUOffloadingSpec.get_manager()`` builds: LRU (the spec's default ``eviction_policy``),
``store_threshold`` 0 (every offered block may be stored), one offloaded chunk per GPU block,
``offload_prompt_only`` True (the spec's default: prompt blocks are offloaded, blocks filled by
decoding are not). The CPU pool holds ``host_blocks`` chunks: the spec sizes it from
``cpu_bytes_to_use`` and the block's byte size, and the constructor checks the count.

The driver never calls the manager itself: the connector's scheduler side does, with vLLM's
own code: ``lookup`` (in ``get_num_new_matched_tokens``), ``prepare_load`` (in
``update_state_after_alloc``), ``prepare_store`` (in ``build_connector_meta``),
``complete_load`` / ``complete_store`` (in ``update_connector_output``) and
``on_request_finished`` (the LRU's recency update, in ``build_connector_meta`` after a
request ended). The driver plays the parts of vLLM's ``Scheduler`` and of the worker:

* ``begin_step`` (the end of the previous engine step, ``update_from_output``):
  ``new_step_starts()``; then the worker's report, ``update_connector_output`` with the jobs
  that finished: the loads planned in the previous step (a worker submits them before that
  step's forward, which waits on them) and the stores planned the step before that (a worker
  defers a store to the start of the next step, ``wait_for_save`` ->
  ``prepare_store_kv``, so it completes during the step after it was planned). Until then its
  chunks are not loadable (``HIT_PENDING``).
* ``admit`` (a waiting request in ``Scheduler.schedule``): ``get_computed_blocks`` (GPU hit),
  then ``get_num_new_matched_tokens(request, gpu_hit)`` (CPU hit beyond it; ``None``, the
  connector asking for time, makes the request wait: the replay loop then admits nothing
  more this step, where vLLM would go on with the next waiting request). With no CPU hit:
  ``allocate_slots`` as in vllm_driver.py, then ``update_state_after_alloc(..., 0)``. With a
  CPU hit: the async-load path of ``Scheduler.schedule``: ``allocate_slots(request, 0,
  gpu_hit, blocks, num_external_computed_tokens=cpu_hit, delay_cache_blocks=True,
  full_sequence_must_fit=True, reserved_blocks=...)`` (vLLM's default
  ``scheduler_reserve_full_isl``; the blocks the other loading requests still need are
  reserved, as ``_inflight_prefill_reserved_blocks`` computes them),
  ``update_state_after_alloc(request, blocks, cpu_hit)`` (``prepare_load``); the request then
  waits for its KV (``WAITING_FOR_REMOTE_KVS``).
* ``decode`` (``schedule`` for running requests, then the end of ``schedule``): a request
  whose load finished is promoted as ``_update_waiting_for_remote_kv`` does
  (``cache_blocks``; a whole-prompt hit recomputes its last token) and scheduled for the rest
  of its prompt (``allocate_slots``): that is its prefill, so it makes no decode progress in
  that step (counted in ``stalls``), as in vLLM, where such a request starts a step late.
  Every other running request gets ``allocate_slots(request, 1)``. Then the step's
  ``SchedulerOutput`` (vLLM's own dataclasses: new requests with all their block ids, running
  ones with their new block ids, the scheduled token counts, the requests finished since the
  last step) goes to ``build_connector_meta``, which plans the stores; after it, as
  ``_update_after_schedule`` and ``update_from_output`` do, computed counts advance and the
  sampled tokens are appended (their blocks hashed).
* ``release``: status ``FINISHED_LENGTH_CAPPED``, ``request_finished`` (the connector), then
  ``KVCacheManager.free``; the id goes into the next ``SchedulerOutput.finished_req_ids``.

``OffloadingConnector`` itself (the class the engine instantiates) is a thin wrapper that needs
a model config to build its ``OffloadingConfig``; the driver builds that config directly for
the one full-attention group and uses the scheduler-side class the wrapper delegates to (its
``get_num_new_matched_tokens`` passes ``max_num_new_tokens=None`` with a single group).

Nothing is stood in for on the CPU: the scheduler side runs no device code. The worker (which
would copy blocks on CUDA streams) is replaced by its report, each job finishing at the step
it would finish on a GPU whose copies keep up, as above.

Reproducibility: ``build_connector_meta`` walks ``finished_req_ids``, a set of request-id
strings, to plan the finished requests' last stores and refresh their chunks in the LRU; that
order follows Python's string hashing, so two processes with different ``PYTHONHASHSEED`` can
evict slightly different chunks (vLLM's engine too). bench/tiers_replay.py pins the seed.

Counting (bench/peers/tier_tally.py): the GPU hit is ``hit_tokens_device``; the CPU hit
returned by the connector is ``hit_tokens_host`` and ``loaded_blocks``; ``stored_blocks`` are
the chunks of the store jobs the connector planned (``prepare_store``'s new keys).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.config.cache import CacheConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.utils.math_utils import round_up
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import (
    CachedRequestData,
    KVConnectorBlockState,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from .tier_tally import TierTally
from .vllm_driver import HASH_ALGO

LAYER = "layer.0"


def _offloading_spec(kv_spec: FullAttentionSpec, host_blocks: int) -> CPUOffloadingSpec:
    """The CPU spec as ``build_offloading_config`` would describe this one-group cache."""
    per_block = kv_spec.page_size_bytes
    chunk_bytes = round_up(per_block, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=kv_spec.block_size,
                                      layer_names=(LAYER,), group_id=0),),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": host_blocks * chunk_bytes},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=kv_spec.block_size, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, CPUOffloadingSpec)
    if spec.num_chunks != host_blocks:
        raise AssertionError(f"vLLM sized its CPU pool to {spec.num_chunks} chunks, "
                             f"asked for {host_blocks}")
    return spec


class VllmOffloadDriver:
    def __init__(self, trace: list, block_size: int, num_blocks: int, host_blocks: int) -> None:
        import vllm

        self.name = "vLLM + CPU offload" if host_blocks else "vLLM (offload driver, no CPU)"
        self.version = vllm.__version__
        self.B = block_size
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        max_len = max(len(r.prompt) + len(r.output) for r in trace) + block_size
        kv_spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                    dtype=torch.bfloat16)
        # vLLM keeps block 0 as its null block: one more so both pools hold num_blocks usable.
        cfg = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec([LAYER], kv_spec)])
        self.kv = KVCacheManager(cfg, max_model_len=max_len, scheduler_block_size=block_size,
                                 hash_block_size=block_size, enable_caching=True)
        self.empty = self.kv.empty_kv_cache_blocks
        self.conn: OffloadingConnectorScheduler | None = None
        if host_blocks:
            vllm_config = VllmConfig(cache_config=CacheConfig(block_size=block_size,
                                                              enable_prefix_caching=True))
            spec = _offloading_spec(kv_spec, host_blocks)
            self.conn = OffloadingConnectorScheduler(spec, vllm_config, cfg)
            self.eviction_policy = spec.eviction_policy
        self.reqs = [Request(f"r{i}", list(r.prompt), SamplingParams(max_tokens=len(r.output)),
                             None, arrival_time=0.0) for i, r in enumerate(trace)]
        self.outputs = [r.output for r in trace]
        self.held: dict[int, int] = {}
        self.seen: set[int] = set()
        #: Admissions the connector asked to retry (a hit chunk still storing or loading).
        self.deferred = 0
        #: Requests whose CPU blocks are loading (WAITING_FOR_REMOTE_KVS); promoted ones.
        self.loading: set[int] = set()
        self.promoted: set[int] = set()
        #: This step's scheduled work: new requests (prefill) and running ones (decode).
        self.step_new: dict[int, int] = {}
        self.step_running: dict[int, tuple[list[int], ...] | None] = {}
        self.finished_ids: set[str] = set()
        #: Jobs the worker will report: loads planned last step, stores planned 1 and 2 ago.
        self.loads_planned: list[int] = []
        self.stores_planned: list[int] = []
        self.stores_running: list[int] = []
        self.t = TierTally()

    # -- the worker's part -------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.kv.new_step_starts()
        if self.conn is None:
            return
        done = self.loads_planned + self.stores_running
        self.stores_running = self.stores_planned
        self.loads_planned, self.stores_planned = [], []
        if done:
            self.conn.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=OffloadingWorkerMetadata(
                    completed_jobs=dict.fromkeys(done, 1))))

    # -- the scheduler's part ----------------------------------------------------------------

    def admit(self, i: int) -> bool:
        req, kv, conn, B = self.reqs[i], self.kv, self.conn, self.B
        if i not in self.seen:
            self.seen.add(i)
            req._block_hasher = self.hasher  # what Request.__init__ stores (vllm_driver.py)
            req.update_block_hashes()
            if conn is not None:
                conn.on_new_request(req)
        blocks, hit, _ = kv.get_computed_blocks(req)
        ext = 0
        if conn is not None:
            ext, _load_async = conn.get_num_new_matched_tokens(req, hit)
            if ext is None:
                self.deferred += 1
                return False
        if ext:
            new = kv.allocate_slots(req, 0, hit, blocks, num_external_computed_tokens=ext,
                                    delay_cache_blocks=True, full_sequence_must_fit=True,
                                    reserved_blocks=self._inflight_reserved_blocks())
            if new is None:
                return False
            conn.update_state_after_alloc(req, kv.get_blocks(req.request_id), ext)
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.num_computed_tokens = hit + ext
            self.loading.add(i)
            n_new = 0  # the blocks allocated for the load are hit blocks (loaded)
        else:
            new = kv.allocate_slots(req, req.num_tokens - hit, hit, blocks)
            if new is None:
                return False
            if conn is not None:
                conn.update_state_after_alloc(req, kv.get_blocks(req.request_id), 0)
            n_new = len(new.blocks[0])
            self.step_new[i] = req.num_tokens - hit
        t = self.t
        hits = len(blocks.blocks[0]) + ext // B
        t.hit(hit, ext, B)
        t.allocated += n_new
        t.queried_tokens += req.num_prompt_tokens
        t.tokens += req.num_tokens
        t.requests += 1
        self.held[i] = hits + n_new
        return True

    def _inflight_reserved_blocks(self) -> int:
        """``Scheduler._inflight_prefill_reserved_blocks``: what the loading requests still
        need to hold their whole prompt (vLLM's own block arithmetic)."""
        coordinator, empty = self.kv.coordinator, self.empty.blocks
        total = 0
        for i in self.loading:
            req = self.reqs[i]
            total += coordinator.get_num_blocks_to_allocate(
                request_id=req.request_id, num_tokens=req.num_tokens, new_computed_blocks=empty,
                num_encoder_tokens=0, total_computed_tokens=req.num_computed_tokens,
                num_local_computed_tokens=req.num_computed_tokens,
                num_tokens_main_model=req.num_tokens, apply_admission_cap=True,
                prefill_end=max(req.num_prompt_tokens, req.num_tokens - 1))
        return total

    def prefill(self, admitted: list[int]) -> None:
        pass  # admit allocated the prompt; the step's bookkeeping ends in decode()

    def _promote(self, i: int, req: Request) -> bool:
        """``_update_waiting_for_remote_kv`` and the scheduling of the rest of the prompt."""
        kv = self.kv
        if i not in self.promoted:
            self.promoted.add(i)
            kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
            req.status = RequestStatus.WAITING
        n = req.num_tokens - req.num_computed_tokens
        new = kv.allocate_slots(req, n, full_sequence_must_fit=True)
        if new is None:
            return False
        assert self.conn is not None
        self.conn.update_state_after_alloc(req, kv.get_blocks(req.request_id), 0)
        if new is not self.empty:
            k = len(new.blocks[0])
            self.t.allocated += k
            self.held[i] += k
        self.loading.discard(i)
        self.promoted.discard(i)
        self.step_new[i] = n
        return True

    def decode(self, running: list[int], k: list[int]) -> list[bool]:
        kv, reqs, held, empty, t = self.kv, self.reqs, self.held, self.empty, self.t
        ok = [True] * len(running)
        step_running = self.step_running
        for j, i in enumerate(running):
            req = reqs[i]
            if i in self.loading:
                ok[j] = False  # its prefill runs this step (or it still waits for room)
                t.stalls += 1
                self._promote(i, req)
                continue
            new = kv.allocate_slots(req, 1)
            if new is None:
                ok[j] = False
                t.stalls += 1
                continue
            if new is not empty:
                n = len(new.blocks[0])
                t.allocated += n
                held[i] += n
                step_running[i] = new.get_block_ids()
            else:
                step_running[i] = None
        if self.conn is not None:
            self._build_connector_meta()
        # _update_after_schedule and update_from_output: computed counts, sampled tokens.
        outputs = self.outputs
        for i in self.step_new:
            req = reqs[i]
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.RUNNING
            req.append_output_token_ids(outputs[i][0])  # sampled by the prefill
        for j, i in enumerate(running):
            if ok[j]:
                req = reqs[i]
                req.num_computed_tokens += 1
                nxt = k[j] + 1
                if nxt < len(outputs[i]):
                    req.append_output_token_ids(outputs[i][nxt])
        self.step_new.clear()
        step_running.clear()
        t.tokens += sum(ok)
        return ok

    def _build_connector_meta(self) -> None:
        assert self.conn is not None
        kv, reqs = self.kv, self.reqs
        new_data = [NewRequestData.from_request(reqs[i], kv.get_block_ids(reqs[i].request_id))
                    for i in self.step_new]
        ids = [reqs[i].request_id for i in self.step_running]
        cached = CachedRequestData(
            req_ids=ids, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
            new_block_ids=list(self.step_running.values()),
            num_computed_tokens=[reqs[i].num_computed_tokens for i in self.step_running],
            num_output_tokens=[len(reqs[i].output_token_ids) for i in self.step_running])
        scheduled = {reqs[i].request_id: n for i, n in self.step_new.items()}
        scheduled.update(dict.fromkeys(ids, 1))
        out = SchedulerOutput(
            scheduled_new_reqs=new_data, scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=self.finished_ids, free_encoder_mm_hashes=[],
            kv_connector_block_state=KVConnectorBlockState(
                req_ids=set(scheduled), resolve_block_ids=kv.get_block_ids,
                boundary_state_offloads=kv.take_boundary_state_offloads()))
        meta = self.conn.build_connector_meta(out)
        self.finished_ids = set()
        self.loads_planned = list(meta.load_jobs)
        self.stores_planned = list(meta.store_jobs)
        self.t.stored_blocks += sum(len(job.src_spec.block_ids)
                                    for job in meta.store_jobs.values())

    def release(self, i: int) -> None:
        req = self.reqs[i]
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        if self.conn is not None:
            self.conn.request_finished(req)
            self.finished_ids.add(req.request_id)
        self.kv.free(req)
        self.t.released += self.held.pop(i)

    def num_free(self) -> int:
        return self.kv.block_pool.get_num_free_blocks()
