"""vLLM's own v1 ``KVCacheManager`` driven as vLLM's scheduler drives it (vllm/v1/core/sched).

Built as ``Scheduler.__init__`` builds it (one full-attention group, prefix caching on, the
engine's default hash, ``hash_block_size == block_size``); requests carry the block hasher
``EngineCore`` attaches (``get_request_block_hasher`` after ``init_none_hash``). Per step:
``new_step_starts()``; a waiting request gets ``get_computed_blocks`` then
``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)``;
a running one appends the token it sampled last step (``append_output_token_ids``, which
hashes newly full blocks) and gets ``allocate_slots(request, 1)``; a finished one ``free``.
vLLM has one decode path: one ``allocate_slots`` call per request per step.

``Request`` objects are built before the clock starts with no hasher, and the hasher is
attached and run at admission, so the replay times prefix hashing (cache work, as blockd's
``admit`` hashes) but not the engine's request bookkeeping.
"""

from __future__ import annotations

import torch
from vllm.config.cache import CacheConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from .tally import Tally

HASH_ALGO = CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default


class VllmDriver:
    name = "vLLM"

    def __init__(self, trace: list, block_size: int, num_blocks: int) -> None:
        import vllm

        self.version = vllm.__version__
        self.B = block_size
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        max_len = max(len(r.prompt) + len(r.output) for r in trace) + block_size
        # vLLM keeps block 0 as its null block: one more so both pools hold num_blocks usable.
        cfg = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
                block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16))])
        self.kv = KVCacheManager(cfg, max_model_len=max_len, scheduler_block_size=block_size,
                                 hash_block_size=block_size, enable_caching=True)
        self.empty = self.kv.empty_kv_cache_blocks
        self.reqs = [Request(f"r{i}", list(r.prompt), SamplingParams(max_tokens=len(r.output)),
                             None, arrival_time=0.0) for i, r in enumerate(trace)]
        self.outputs = [r.output for r in trace]
        self.held: dict[int, int] = {}
        self.t = Tally()

    def begin_step(self, step: int) -> None:
        self.kv.new_step_starts()

    def admit(self, i: int) -> bool:
        req = self.reqs[i]
        if not req.block_hashes:
            req._block_hasher = self.hasher  # what Request.__init__ stores (see docstring)
            req.update_block_hashes()
        blocks, hit, _ = self.kv.get_computed_blocks(req)
        new = self.kv.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        if new is None:
            return False
        t = self.t
        hits = len(blocks.blocks[0])
        n = len(new.blocks[0])
        t.hit_blocks += hits
        t.allocated += n
        t.hit_tokens += hit
        t.queried_tokens += req.num_prompt_tokens
        t.tokens += req.num_tokens
        t.requests += 1
        self.held[i] = hits + n
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        req.append_output_token_ids(self.outputs[i][0])  # sampled by the prefill
        return True

    def prefill(self, admitted: list[int]) -> None:
        pass

    def decode(self, running: list[int], k: list[int]) -> list[bool]:
        kv, reqs, outputs, held, empty, t = (self.kv, self.reqs, self.outputs, self.held,
                                             self.empty, self.t)
        ok = [True] * len(running)
        for j, i in enumerate(running):
            req = reqs[i]
            new = kv.allocate_slots(req, 1)
            if new is None:
                ok[j] = False
                t.stalls += 1
                continue
            if new is not empty:
                n = len(new.blocks[0])
                t.allocated += n
                held[i] += n
            req.num_computed_tokens += 1
            nxt = k[j] + 1
            if nxt < len(outputs[i]):
                req.append_output_token_ids(outputs[i][nxt])
        t.tokens += sum(ok)
        return ok

    def release(self, i: int) -> None:
        self.kv.free(self.reqs[i])
        self.t.released += self.held.pop(i)

    def num_free(self) -> int:
        return self.kv.block_pool.get_num_free_blocks()
