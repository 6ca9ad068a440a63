"""SGLang's own ``RadixCache`` and ``PagedTokenToKVPoolAllocator``, called as its scheduler does.

From the sglang wheel (``bench/peers/sglang_loader.py``). The request records are SGLang's own
``Req`` (built before the clock starts, like vLLM's requests). Per step, following
``sglang.srt.managers`` and ``sglang.srt.mem_cache``:

* admission (``PrefillAdder``): ``req.init_next_round_input(tree)`` (``match_kv_cache`` ->
  ``RadixCache.match_prefix``), a budget check against ``available_size() +
  evictable_size()``, then ``tree.lock(req.last_node)``;
* the prefill batch (``alloc_for_extend``): ``ReqToTokenPool.alloc``, ``evict_from_tree_cache``,
  ``PagedTokenToKVPoolAllocator.alloc_extend`` for the whole batch, the row writes of its
  non-Triton path, then (after the forward) the sampled token and ``checkpoint_kv_cache``
  (the prompt enters the tree);
* the decode batch (``alloc_for_decode_default``): ``last_loc`` from the rows,
  ``evict_from_tree_cache``, one ``alloc_decode`` for the whole batch, the row write;
* a finished request: ``release_kv_cache(req, tree, checkpoint=True)``.

SGLang has one decode path and it is batched: one ``alloc_decode`` per step for every running
request. Its allocator returns token slots, not blocks: blocks (pages) allocated are counted
with its own page arithmetic (``get_num_new_pages``).
"""

from __future__ import annotations

from array import array

import torch

from . import sglang_loader
from .tally import Tally


class SglangDriver:
    name = "SGLang"

    def __init__(self, trace: list, block_size: int, num_blocks: int, max_running: int
                 ) -> None:
        sg = sglang_loader.load()
        self.version = sg.version
        self.common = sg.common
        self.P = block_size
        max_len = max(len(r.prompt) + len(r.output) for r in trace) + 2 * block_size
        self.alloc = sg.PagedTokenToKVPoolAllocator(num_blocks * block_size, block_size,
                                                    torch.int64, "cpu", None, False)
        self.r2t = sg.ReqToTokenPool(max_running + 1, max_len, "cpu", False)
        self.tree = sg.RadixCache(sg.CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
            page_size=block_size))
        self.reqs = [sg.Req(f"r{i}", "", array("q", r.prompt),
                            sg.SamplingParams(max_new_tokens=len(r.output) + 1))
                     for i, r in enumerate(trace)]
        self.outputs = [r.output for r in trace]
        self.seq_len: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.empty = torch.empty((0,), dtype=torch.int64)
        self.t = Tally()

    def begin_step(self, step: int) -> None:
        pass

    def admit(self, i: int) -> bool:
        req, tree, P = self.reqs[i], self.tree, self.P
        req.init_next_round_input(tree)
        n = len(req.origin_input_ids)
        need = -(-(n - req.prefix_len) // P) * P
        if need > self.alloc.available_size() + tree.evictable_size():
            return False
        req.extend_end = n
        req.lock = tree.lock(req.last_node)
        return True

    def prefill(self, admitted: list[int]) -> None:
        if not admitted:
            return
        tree, r2t, alloc, P, t = self.tree, self.r2t, self.alloc, self.P, self.t
        reqs = [self.reqs[i] for i in admitted]
        prefix = [tree.prefix_device_indices(r) if r.prefix_len else self.empty for r in reqs]
        prefix_lens = [r.prefix_len for r in reqs]
        seq_lens = [len(r.origin_input_ids) for r in reqs]
        prefix_lens_cpu = torch.tensor(prefix_lens, dtype=torch.int64)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        rows = r2t.alloc(reqs)
        extend = sum(seq_lens) - sum(prefix_lens)
        self.common.evict_from_tree_cache(tree, extend + len(reqs) * P)
        last_loc = torch.cat([p[-1:] if len(p) else torch.full((1,), -1) for p in prefix])
        out = alloc.alloc_extend(prefix_lens_cpu, prefix_lens_cpu, seq_lens_cpu, seq_lens_cpu,
                                 last_loc, extend)
        if out is None:
            raise RuntimeError("SGLang prefill out of memory (the budget check admitted it)")
        pt = 0
        for j, r in enumerate(reqs):
            p, s = prefix_lens[j], seq_lens[j]
            r2t.write((rows[j], slice(0, p)), prefix[j])
            r2t.write((rows[j], slice(p, s)), out[pt:pt + s - p])
            pt += s - p
            r.kv.kv_allocated_len = r.kv.kv_committed_len = s
        for j, (i, r) in enumerate(zip(admitted, reqs, strict=True)):
            hits = prefix_lens[j] // P
            new = -(-seq_lens[j] // P) - hits
            t.hit_blocks += hits
            t.allocated += new
            t.hit_tokens += prefix_lens[j]
            t.queried_tokens += seq_lens[j]
            t.tokens += seq_lens[j]
            t.requests += 1
            self.held[i] = hits + new
            self.seq_len[i] = seq_lens[j]
            r.output_ids.append(self.outputs[i][0])  # sampled by the prefill
            self.common.checkpoint_kv_cache(r, tree)

    def decode(self, running: list[int], k: list[int]) -> list[bool]:
        if not running:
            return []
        tree, r2t, alloc, P, t = self.tree, self.r2t, self.alloc, self.P, self.t
        reqs = [self.reqs[i] for i in running]
        lens = [self.seq_len[i] for i in running]
        pool_idx = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        last_loc = r2t.req_to_token[pool_idx, seq_lens - 1]
        self.common.evict_from_tree_cache(tree, len(reqs) * P)
        nxt = seq_lens + 1
        out = alloc.alloc_decode(nxt, nxt, last_loc)
        if out is None:
            raise RuntimeError("SGLang decode out of memory")
        r2t.write((pool_idx, seq_lens), out.to(torch.int32))
        outputs, held, seq_len = self.outputs, self.held, self.seq_len
        for j, i in enumerate(running):
            r = reqs[j]
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1
            n = lens[j] + 1
            seq_len[i] = n
            if n % P == 1:  # get_num_new_pages(decode=True): a new page at its first slot
                t.allocated += 1
                held[i] += 1
            if k[j] + 1 < len(outputs[i]):
                r.output_ids.append(outputs[i][k[j] + 1])
        t.tokens += len(running)
        return [True] * len(running)

    def release(self, i: int) -> None:
        self.common.release_kv_cache(self.reqs[i], self.tree, checkpoint=True)
        del self.seq_len[i]
        self.t.released += self.held.pop(i)

    def num_free(self) -> int:
        return self.alloc.available_size() // self.P
