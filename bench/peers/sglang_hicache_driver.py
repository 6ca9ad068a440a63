"""SGLang's hierarchical cache (device pool + host tier), called as its scheduler calls it.

What the brief calls HiRadixCache: SGLang 0.5.23 has no ``HiRadixCache`` any more (only a test
helper still names its file). ``--enable-hierarchical-cache`` builds the default tree,
``UnifiedRadixCache`` with its one FULL component, and calls its ``init_hicache``
(``mem_cache/kv_cache_builder.py`` -> ``registry.create_unified_radix_cache``). That call
builds the host pool (``MHATokenToKVPoolHost`` in a ``HostPoolGroup``) and the
``HybridCacheController`` (a subclass of ``managers/cache_controller.HiCacheController``)
through SGLang's own assembler (``attach_hybrid_pool_to_unified_cache``). This driver does the
same, on SGLang's default server arguments plus those that select the tier, installed while
the tier is built (SGLang reads them there) and then put back:

* ``enable_hierarchical_cache=True``; ``hicache_write_policy`` left at SGLang's default,
  ``write_through`` (the server-argument default; the controller class's own keyword default,
  ``write_through_selective``, is not what a server runs): a node is copied to the host when it
  is inserted, evicting a device node whose host copy is done keeps the host copy, one without
  is dropped. ``write_policy=`` picks another (``write_back``: copy at eviction);
* ``hicache_ratio`` such that the host pool holds exactly ``host_blocks`` pages (SGLang sizes
  it as ``int(device tokens * ratio) // page + 1`` pages; the constructor checks the count);
* ``hicache_io_backend="direct"``, ``hicache_mem_layout="layer_first"`` (a valid pair, left as
  is by SGLang's argument resolution): the default ``kernel`` backend needs CUDA kernels, and
  with ``direct`` + ``layer_first`` both directions go through one copy op (below). No storage
  backend (L3).

The device pool is SGLang's ``MHATokenToKVPool`` on ``device="cpu"`` (one layer, one head of
width one: contents never decide a hit, the tree keys on token ids) behind its
``PagedTokenToKVPoolAllocator``; requests are SGLang's ``Req``. ``host_blocks=0`` leaves the
tier out (``init_hicache`` is not called): the same tree as the scheduler builds without
``--enable-hierarchical-cache``.

Per step, in the order of ``managers/scheduler.py`` and ``managers/schedule_policy.py``:

* ``begin_step``: ``check_hicache_events()`` (first thing in ``get_next_batch_to_run``: submit
  queued backups, reap finished write-through and load-back acks, unlock their nodes);
* ``admit`` (``PrefillAdder.add_one_req``): ``req.init_next_round_input(tree)`` (the match:
  device prefix ``prefix_len``, host-only part ``host_hit_length``, ``best_match_node``); the
  budget check of bench/peers/sglang_driver.py (a host hit needs device pages as much as the
  suffix does); if ``req.needs_host_load_back()``: with ``req.last_node`` locked and
  ``best_match_node`` locked on host and device (``_lock_node``), ``init_load_back(
  InitLoadBackParams(best_match_node, host_hit_length, req=req))``, which may evict device
  nodes to make room and queues the H->D copy; ``prefix_len += host_loaded_length``,
  ``cache_protected_len = prefix_len``; then ``req.lock = tree.lock(req.last_node)``;
* ``prefill``: ``ready_to_load_host_cache()`` (submits the batch's loads; its consumer index
  goes to the KV pool's layer counter as ``tp_worker.set_hicache_consumer`` does), the
  allocation of ``alloc_for_extend`` as sglang_driver.py does it, ``checkpoint_kv_cache`` per
  request (the insert queues backups) and ``flush_pending_backups()`` (end of
  ``process_batch_result``);
* ``decode``: SGLang's batched ``alloc_decode`` as in sglang_driver.py, then
  ``flush_pending_backups()``;
* ``release``: the finish reason is set (``FINISH_LENGTH``, as ``check_finished`` does), then
  ``release_kv_cache(req, tree, checkpoint=True)``.

What stands in for what on the CPU, and why none of it changes which tokens hit:

* CUDA streams and events: nothing of the driver's. SGLang asks ``get_device_module()``, which
  without an accelerator is ``torch.cpu``, whose ``Stream``, ``Event`` and ``stream()`` are
  PyTorch's own device-agnostic no-ops (``Event.query()`` is always True). The copies run
  synchronously inside ``start_writing`` / ``start_loading``, so each ack is complete when the
  next ``check_hicache_events`` polls it: a backup queued in step t is published at the start
  of step t+1, as on a GPU whose copy finished within the step, and a load-back is in place
  before the step's forward would read it. Which nodes are backed up, evicted, dropped or
  loaded is decided by the tree and the controller, from these completions, as on a GPU.
* The copy kernel: with ``direct`` + ``layer_first`` the host pool calls
  ``transfer_kv_direct`` from ``sgl_kernel.kvcacheio`` (a CUDA/ROCm build; XPU binds it from
  ``pool_host/_kvcacheio.py``), which ``pool_host/mha.py`` imports only on those platforms.
  Where that name is missing, the driver binds in its place a torch version doing the same
  copy: for each layer buffer, ``dst[dst_indices] = src[src_indices]``. It moves KV contents
  only; SGLang chooses the indices. ``check_kv=True`` verifies the data: every token's KV is
  written as a function of its id when computed, and every prefix a request reuses, resident
  or loaded back, must read back as those values.
* Page-locking the host pool: ``MHATokenToKVPoolHost`` registers its buffer with
  ``cudaHostRegister`` (``pool_host/common._cuda_host_register``), which a CPU-only torch
  cannot do; while the tier is built that one function is a no-op. Pinning makes DMA faster and
  decides nothing.
* Metrics: the tree reports each finished backup (``increment_backup_num_tokens``) and
  load-back (``increment_load_back_num_tokens``) to its ``metrics_collector``. The driver hands
  it a recorder that adds these up, instead of the Prometheus collector (whose series cannot be
  registered twice in a process): ``stored_blocks`` comes from there, and the recorded
  load-backs must equal the driver's own count of loaded tokens.

Counting (bench/peers/tier_tally.py): device hits are the match's ``prefix_len``, host hits
``host_loaded_length`` from ``init_load_back`` (``hit_tokens_host``, ``loaded_blocks``).
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import torch

from . import sglang_loader
from .tier_tally import TierTally


class _Recorder:
    """What the tree gets as ``metrics_collector``: adds up the counts it reports."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)

    def increment_backup_num_tokens(self, num_tokens: int, pool: str = "kv") -> None:
        self.counts[f"backup_tokens_{pool}"] += num_tokens

    def increment_load_back_num_tokens(self, num_tokens: int, pool: str = "kv") -> None:
        self.counts[f"load_back_tokens_{pool}"] += num_tokens

    def increment_dropped_tokens(self, num_tokens: int, reason: str = "",
                                 pool: str = "kv") -> None:
        self.counts[f"dropped_tokens_{reason}"] += num_tokens

    def increment_eviction_num_tokens(self, num_tokens: int) -> None:
        self.counts["evicted_tokens"] += num_tokens

    def __getattr__(self, name: str) -> Any:  # durations, byte counts: not needed here
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _transfer_kv_direct(src_layers: list, dst_layers: list, src_indices: torch.Tensor,
                        dst_indices: torch.Tensor, page_size: int) -> None:
    """The copy ``sgl_kernel.kvcacheio.transfer_kv_direct`` does, in torch (see module doc)."""
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


def _install_copy_op() -> bool:
    """Bind the torch copy where SGLang's MHA host pool looks for the kernel; True if bound."""
    from sglang.srt.mem_cache.pool_host import mha

    if hasattr(mha, "transfer_kv_direct"):  # the real kernel (CUDA, ROCm, XPU builds)
        return mha.transfer_kv_direct is _transfer_kv_direct
    mha.transfer_kv_direct = _transfer_kv_direct
    return True


@contextmanager
def _no_host_register():  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.pool_host import common

    saved = common._cuda_host_register
    common._cuda_host_register = lambda *args, **kwargs: None
    try:
        yield
    finally:
        common._cuda_host_register = saved


class SglangHiCacheDriver:
    def __init__(self, trace: list, block_size: int, num_blocks: int, host_blocks: int,
                 max_running: int, write_policy: str | None = None,
                 check_kv: bool = False) -> None:
        sg = sglang_loader.load()
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context

        self.name = "SGLang HiCache" if host_blocks else "SGLang unified"
        self.version = sg.version
        self.common = sg.common
        self.InitLoadBackParams = InitLoadBackParams
        self.FINISH_LENGTH = FINISH_LENGTH
        self.P = P = block_size
        self.host_blocks = host_blocks
        max_len = max(len(r.prompt) + len(r.output) for r in trace) + 2 * block_size
        self.kvpool = MHATokenToKVPool(num_blocks * P, P, torch.float16, head_num=1,
                                       head_dim=1, layer_num=1, device="cpu",
                                       enable_memory_saver=False, enable_alt_stream=False)
        self.alloc = sg.PagedTokenToKVPoolAllocator(num_blocks * P, P, torch.int64, "cpu",
                                                    self.kvpool, False)
        self.r2t = sg.ReqToTokenPool(max_running + 1, max_len, "cpu", False)
        params = sg.CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
            page_size=P, tree_components=(ComponentType.FULL,))
        self.tree = UnifiedRadixCache(params)
        self.recorder = _Recorder()
        self.cc = None
        if host_blocks:
            fields: dict[str, Any] = {
                "enable_hierarchical_cache": True,
                # SGLang sizes the host pool as int(device tokens * ratio) // P + 1 pages.
                "hicache_ratio": ((host_blocks - 1) * P + P / 2) / (num_blocks * P),
                "hicache_io_backend": "direct",
                "hicache_mem_layout": "layer_first",
            }
            if write_policy is not None:
                fields["hicache_write_policy"] = write_policy
            # The tier's arguments are read while it is built; the process config goes back
            # to the loader's default afterwards (the other SGLang driver shares it).
            self.copy_op_stood_in = _install_copy_op()
            override = get_context().override_server_args(**fields)
            server_args = override.install()
            try:
                with _no_host_register():
                    self.tree.init_hicache(server_args, params)
            finally:
                override.restore()
            self.cc = self.tree.cache_controller
            host = self.cc.mem_pool_host
            if host.available_size() != host_blocks * P:
                raise AssertionError(f"SGLang host pool holds {host.available_size()} tokens, "
                                     f"asked for {host_blocks} pages of {P}")
            self.write_policy = self.cc.write_policy
            self.tree.metrics_collector = self.recorder
        else:
            self.write_policy = ""
        self.reqs = [sg.Req(f"r{i}", "", array("q", r.prompt),
                            sg.SamplingParams(max_new_tokens=len(r.output) + 1))
                     for i, r in enumerate(trace)]
        self.outputs = [r.output for r in trace]
        self.seq_len: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.device_hit: dict[int, int] = {}
        self.check_kv = check_kv
        self.kv_checked = 0
        self.empty = torch.empty((0,), dtype=torch.int64)
        self.t = TierTally()

    # -- the scheduler's per-step calls ------------------------------------------------------

    def begin_step(self, step: int) -> None:
        if self.cc is not None:
            self.tree.check_hicache_events()
            self._sync_stored()

    def admit(self, i: int) -> bool:
        req, tree, P = self.reqs[i], self.tree, self.P
        req.init_next_round_input(tree)
        n = len(req.origin_input_ids)
        need = -(-(n - req.prefix_len) // P) * P
        if need > self.alloc.available_size() + tree.evictable_size():
            return False
        self.device_hit[i] = req.prefix_len
        if req.needs_host_load_back():
            pin = tree.lock(req.last_node)
            host_pin = tree.inc_host_lock_ref(req.best_match_node).to_dec_params()
            best_pin = tree.lock(req.best_match_node)
            try:
                loaded = tree.init_load_back(self.InitLoadBackParams(
                    best_match_node=req.best_match_node,
                    host_hit_length=req.host_hit_length, req=req))
            finally:
                tree.unlock(best_pin)
                tree.dec_host_lock_ref(req.best_match_node, host_pin)
                tree.unlock(pin)
            req.host_loaded_length, req.last_node = loaded
            req.prefix_len += req.host_loaded_length
            if tree.load_back_is_cache_owned():
                req.kv.cache_protected_len = req.prefix_len
        req.extend_end = n
        req.lock = tree.lock(req.last_node)
        return True

    def prefill(self, admitted: list[int]) -> None:
        if not admitted:
            return
        tree, r2t, alloc, P, t = self.tree, self.r2t, self.alloc, self.P, self.t
        if self.cc is not None:
            consumer = tree.ready_to_load_host_cache()
            self.kvpool.layer_transfer_counter.set_consumer(consumer)
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
            if self.check_kv:  # the prefix reused must hold its tokens' KV; the forward
                self._check_kv(r.origin_input_ids[:p], prefix[j])  # writes the rest
                self._write_kv(r.origin_input_ids[p:s], out[pt:pt + s - p])
            pt += s - p
            r.kv.kv_allocated_len = r.kv.kv_committed_len = s
        for j, (i, r) in enumerate(zip(admitted, reqs, strict=True)):
            dev = self.device_hit.pop(i)
            t.hit(dev, prefix_lens[j] - dev, P)
            hits = prefix_lens[j] // P
            new = -(-seq_lens[j] // P) - hits
            t.allocated += new
            t.queried_tokens += seq_lens[j]
            t.tokens += seq_lens[j]
            t.requests += 1
            self.held[i] = hits + new
            self.seq_len[i] = seq_lens[j]
            r.output_ids.append(self.outputs[i][0])  # sampled by the prefill
            self.common.checkpoint_kv_cache(r, tree)
        tree.flush_pending_backups()

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
        if self.check_kv:
            self._write_kv([outputs[i][k[j]] for j, i in enumerate(running)], out)
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
        if self.cc is not None:
            tree.flush_pending_backups()
        return [True] * len(running)

    def release(self, i: int) -> None:
        req = self.reqs[i]
        req.finished_reason = self.FINISH_LENGTH(length=len(self.outputs[i]))
        self.common.release_kv_cache(req, self.tree, checkpoint=True)
        del self.seq_len[i]
        self.t.released += self.held.pop(i)

    def num_free(self) -> int:
        return self.alloc.available_size() // self.P

    # -- KV contents (check_kv) --------------------------------------------------------------

    @staticmethod
    def _kv_of(tokens: Any) -> torch.Tensor:
        # Integers below 2048 are exact in float16.
        return (torch.tensor(list(tokens), dtype=torch.int64) % 2039).to(torch.float16)

    def _write_kv(self, tokens: Any, slots: torch.Tensor) -> None:
        values = self._kv_of(tokens).view(-1, 1, 1)
        slots = slots.to(torch.int64)
        self.kvpool.k_buffer[0][slots] = values
        self.kvpool.v_buffer[0][slots] = -values

    def _check_kv(self, tokens: Any, slots: torch.Tensor) -> None:
        if not len(slots):
            return
        want = self._kv_of(tokens).view(-1, 1, 1)
        slots = slots.to(torch.int64)
        k, v = self.kvpool.k_buffer[0][slots], self.kvpool.v_buffer[0][slots]
        if not (torch.equal(k, want) and torch.equal(v, -want)):
            bad = int((k != want).sum() + (v != -want).sum())
            raise AssertionError(f"SGLang served a prefix whose KV is not its tokens' "
                                 f"({bad} of {2 * len(slots)} values differ)")
        self.kv_checked += len(slots)

    # -- reporting ---------------------------------------------------------------------------

    def _sync_stored(self) -> None:
        self.t.stored_blocks = self.recorder.counts["backup_tokens_kv"] // self.P

    def tier_counts(self) -> dict[str, int]:
        """What the tree itself reported (tokens), after reaping what is still in flight."""
        if self.cc is not None:
            self.tree.check_hicache_events()
            self._sync_stored()
        return dict(self.recorder.counts)
