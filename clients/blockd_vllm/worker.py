"""The worker side: copies between vLLM's KV tensors and blockd's pool, then the fence.

``register_kv_caches`` checks every layer's tensor against the engine's KV shape and builds one
``[blocks, 2, block_size, kv_heads, head_dim]`` view per layer (``blockd_vllm.layout``). The
pool of the scheduler side's session is mapped on the first step that names it (and mapped
again when the epoch changes); its header must match the same shape.

Per step, with the step's metadata bound:

- ``start_load_kv``: loads, blockd -> vLLM. On CPU tensors all layers are copied here, before
  the forward; on CUDA they are enqueued on a side stream, one event per layer, and
  ``wait_for_layer_load`` makes the compute stream wait for that layer's event only, so loading
  overlaps the forward layer by layer.
- ``wait_for_save``: saves, vLLM -> blockd, of the blocks this step completed (all layers, after
  the forward wrote them, in the compute stream's order), then the scheduler session's fence
  is published in that same order (``MappedPool.publish_fence_on_stream``): by the GPU itself
  on CUDA, so no thread waits and no device-wide sync is made; on CPU tensors by the worker's
  copy thread after the copies (``blockd_vllm.copier``), which runs them during the next step's
  forward. A save is reported (``SaveReport``; a held request in ``finished_sending``) only
  once its copy ran.
- ``handle_preemptions`` (the first hook of every step): the copy thread may run the earlier
  steps' saves now; after a preemption it runs them first, and the step waits
  (``BlockdMetadata.drain``): the preempted requests' blocks may be written in this step.

A load that cannot run (the pool cannot be mapped), or a block promised to an async load that
blockd does not hold (``load_failed``), is reported through ``get_block_ids_with_load_errors``;
vLLM then recomputes them (the connector sets vLLM's
``kv_load_failure_policy`` to ``recompute``), so a fault never changes a token.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from blockd_vllm.copier import Copier, spare_cpus
from blockd_vllm.layout import KvShape, block_view, copy_blocks, pool_view
from blockd_vllm.metadata import BlockdMetadata, PoolRef, SaveReport

log = logging.getLogger("blockd_vllm")

#: A fence-page value at or above every fence a session can be issued (the daemon reads it
#: clamped to those issued: "all done").
ALL_ISSUED = 2**64 - 1


def block_ids(ids: list[int], device: Any) -> Any:
    """``ids`` as an int64 tensor on ``device``, without a host wait: on CUDA through pinned
    memory, copied on the current stream (a copy from pageable memory may wait for the work
    already queued on that stream, e.g. this step's forward)."""
    import torch

    t = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def out_of_range(vllm_ids: list[int], vllm_blocks: int, blockd_ids: list[int],
                 blockd_blocks: int) -> str | None:
    """What is wrong with a copy's block ids, checked on the host before any launch (on CUDA
    a bad index is a device-side assert that ends the process's CUDA context), or None."""
    for what, ids, n in (("vLLM", vllm_ids, vllm_blocks), ("blockd", blockd_ids, blockd_blocks)):
        bad = next((i for i in ids if not 0 <= i < n), None)
        if bad is not None:
            return f"{what} block id {bad} is outside 0..{n - 1}"
    return None


def layer_index(name: str) -> int:
    """The layer number in an attention layer's name (``model.layers.7.self_attn.attn``)."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"blockd_vllm: cannot tell the layer index of {name!r}")
    return numbers[0]


class WorkerSide:
    def __init__(self, shape: KvShape, layout_name: str | None) -> None:
        self.shape = shape
        self.layout_name = layout_name
        self.views: dict[str, Any] = {}
        self.layers: dict[str, int] = {}
        self.pool: Any = None
        self.pool_ref: PoolRef | None = None
        self.failed_blocks: set[int] = set()
        self.report = SaveReport()
        #: Ended requests whose saves ran (``BlockdMetadata.sent``), for ``finished_sending``;
        #: requests whose async loads ran (``BlockdMetadata.recv``), for ``finished_recving``.
        self.sent: set[str] = set()
        self.recving: set[str] = set()
        self.counters: Counter[str] = Counter()
        #: This worker's tensor-parallel rank: it copies shard ``rank`` of the pool and
        #: publishes its fences into slot ``rank`` of the page (``MappedPool.for_rank``), so a
        #: step's blocks are done for blockd once every rank's copies are.
        self.rank = 0
        self._events: dict[str, Any] = {}
        self._side_stream: Any = None
        #: CPU tensors: the thread the saves run on (``blockd_vllm.copier``); ``_done`` guards
        #: what it files (``report``, ``sent``, ``counters``) against the worker's thread.
        self.copier: Copier | None = None
        self._done = threading.Lock()

    def register(self, kv_caches: dict[str, Any]) -> None:
        if len(kv_caches) != self.shape.num_layers:
            raise ValueError(f"blockd_vllm: vLLM registered {len(kv_caches)} KV layers, its "
                             f"model config says num_layers={self.shape.num_layers}")
        seen: set[int] = set()
        for name, tensor in kv_caches.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype != self.shape.dtype:
                raise ValueError(f"blockd_vllm: layer {name} holds {dtype}, the engine's KV "
                                 f"dtype is {self.shape.dtype}")
            self.views[name] = block_view(tensor, self.shape, self.layout_name)
            index = layer_index(name)
            if index in seen or not 0 <= index < self.shape.num_layers:
                raise ValueError(f"blockd_vllm: layer {name} has index {index}, outside 0.."
                                 f"{self.shape.num_layers - 1} or repeated")
            seen.add(index)
            self.layers[name] = index
        first = next(iter(self.views.values()), None)
        if first is not None and first.device.type == "cpu" and self.copier is None:
            self.copier = Copier(spare_cpus(self.shape.tp_size))

    def release(self) -> None:
        """A step starts: the saves of the steps before it may run now, during its forward."""
        if self.copier is not None:
            self.copier.release()

    def drain(self) -> None:
        """Wait until every save handed to the copy thread has run (its source blocks may be
        written next, or its mapping closed)."""
        if self.copier is not None:
            self.copier.drain()

    # -- the pool ------------------------------------------------------------------------------

    def _map(self, ref: PoolRef) -> bool:
        if self.pool is not None and self.pool_ref == ref:
            return True
        from blockd_client.pool import open_pool

        old = self.pool
        if old is not None:
            self.drain()  # copies in flight write through the old mapping
        self.pool, self.pool_ref = None, None
        if old is not None:
            old.close()
        try:
            pool = open_pool(ref.handle_socket, ref.session_id, ref.fetch_secret)
        except (OSError, ConnectionError, ValueError) as err:
            self.counters["map_failures"] += 1
            log.warning("blockd_vllm: cannot map blockd's pool for session %s (%s): its loads "
                        "are recomputed", ref.session_id, err)
            return False
        mismatch = self._mismatch(pool)
        if mismatch:  # a daemon restarted with another layout: never copy, recompute
            pool.close()
            self.counters["map_failures"] += 1
            log.error("blockd_vllm: blockd's pool does not match vLLM's KV cache: %s",
                      mismatch)
            return False
        if self.shape.tp_size > 1:
            pool.for_rank(self.rank)
        self.pool, self.pool_ref = pool, ref
        return True

    def _mismatch(self, pool: Any) -> str:
        lay = pool.layout
        want = self.shape
        got = KvShape(num_layers=lay.num_layers, block_size=lay.block_size,
                      num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                      dtype=str(lay.dtype).removeprefix("torch."), tp_size=pool.tp_size)
        return "" if got == want else f"pool {got.describe()}, vLLM {want.describe()}"

    # -- a step --------------------------------------------------------------------------------

    def start_load(self, meta: BlockdMetadata) -> None:
        try:
            self._start_load(meta)
        finally:
            # Async loads: what blockd did not hold is recomputed; the requests go on.
            if meta.load_failed:  # (a zero would leave a key: every step's stats built)
                self.failed_blocks.update(meta.load_failed)
                self.counters["load_failures"] += len(meta.load_failed)
            self.recving.update(meta.recv)

    def _start_load(self, meta: BlockdMetadata) -> None:
        if meta.pool is None or not meta.has_work():
            return
        # Loads of blocks of the session mapped now (an epoch change may have named a new one:
        # loads promised in the old epoch come from the old mapping, which holds their bytes).
        mapped = self.pool_ref.session_id if self.pool_ref is not None else None
        if mapped is not None and mapped != meta.pool.session_id:
            self._load(meta, mapped)
            if self._side_stream is not None:
                self._side_stream.synchronize()  # the old mapping goes away next (rare path)
        if not self._map(meta.pool):
            self._fail_loads(meta, {s for s in meta.load_session})
            return
        self._load(meta, meta.pool.session_id)
        self._fail_loads(meta, set(meta.load_session) - {mapped, meta.pool.session_id})

    def _pairs(self, meta: BlockdMetadata, session: str | None) -> tuple[list[int], list[int]]:
        pairs = [(v, b) for v, b, s in zip(meta.load_vllm, meta.load_blockd, meta.load_session,
                                           strict=True) if s == session]
        return [v for v, _ in pairs], [b for _, b in pairs]

    def _fail_loads(self, meta: BlockdMetadata, sessions: set[str | None]) -> None:
        """Loads that cannot run: vLLM recomputes those blocks (``kv_load_failure_policy``)."""
        for session in sessions:
            vllm_blocks, _ = self._pairs(meta, session)
            self.failed_blocks.update(vllm_blocks)
            self.counters["load_failures"] += len(vllm_blocks)

    def _load(self, meta: BlockdMetadata, session: str | None) -> None:
        vllm_blocks, blockd_blocks = self._pairs(meta, session)
        if not vllm_blocks or self.pool is None:
            return
        kv_pool = self.pool.kv_pool(self.rank)
        first = next(iter(self.views.values()))
        if (bad := out_of_range(vllm_blocks, first.shape[0], blockd_blocks,
                                pool_view(kv_pool, 0).shape[0])) is not None:
            log.warning("blockd_vllm: loading %d blocks refused (%s): vLLM recomputes them",
                        len(vllm_blocks), bad)
            self._fail_loads(meta, {session})
            return
        src = block_ids(blockd_blocks, kv_pool.device)
        dst = block_ids(vllm_blocks, first.device)
        if first.device.type == "cuda":
            self._load_on_side_stream(kv_pool, src, dst)
        else:
            for name, view in self.views.items():
                copy_blocks(view, dst, pool_view(kv_pool, self.layers[name]), src)
        self._count_blocks("loaded_blocks", len(vllm_blocks))

    def _load_on_side_stream(self, kv_pool: Any, src: Any, dst: Any) -> None:
        import torch

        compute = torch.cuda.current_stream()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=compute.device)
        side = self._side_stream
        side.wait_stream(compute)  # the blocks were allocated (and maybe zeroed) before
        for ids in (src, dst):
            if ids.is_cuda:
                # Allocated on the compute stream, read on the side one: without this the
                # caching allocator could hand their memory out again before the copies ran.
                ids.record_stream(side)
        with torch.cuda.stream(side):
            for name, view in self.views.items():
                copy_blocks(view, dst, pool_view(kv_pool, self.layers[name]), src)
                event = torch.cuda.Event()
                event.record(side)
                self._events[name] = event

    def wait_layer(self, name: str) -> None:
        event = self._events.pop(name, None)
        if event is not None:
            import torch

            torch.cuda.current_stream().wait_event(event)

    def save(self, meta: BlockdMetadata) -> None:
        """Every save of the step, then the fence (called once per step, after the forward):
        here on CUDA (enqueued on the stream), on the copy thread on CPU, behind the saves
        of earlier steps (a fence must never be published before an earlier step's copies)."""
        for name in list(self._events):  # layers whose load nobody waited for
            self.wait_layer(name)
        if self._nothing_to_do(meta):
            return
        mapped = True
        if meta.pool is not None and (meta.save_vllm or meta.fence):
            mapped = self._map(meta.pool)  # here: a new mapping first drains the thread
        if self.copier is not None and (meta.save_vllm or self.copier.busy):
            pool = self.pool
            self.copier.submit(lambda: self._finish_on_thread(meta, pool, mapped))
        else:
            self._finish(meta, self.pool, mapped)

    def _nothing_to_do(self, meta: BlockdMetadata) -> bool:
        """Most decode steps: no copy (so no step number), no held request to let go, nothing
        queued on the copy thread, and a fence already published on the pool it names."""
        if meta.step or meta.sent or (self.copier is not None and self.copier.busy):
            return False
        return not meta.fence or (self.pool is not None and meta.fence <= self.pool.fences.highest
                                  and self.pool_ref == meta.pool)

    def _finish_on_thread(self, meta: BlockdMetadata, pool: Any, mapped: bool) -> None:
        """``_finish`` on the copy thread, in inference mode as vLLM's forward (torch's mode is
        per thread; vLLM's KV tensors, and the pool's views made in its steps, are inference
        tensors, which only inference mode may update in place)."""
        import torch

        with torch.inference_mode():
            self._finish(meta, pool, mapped)

    def _finish(self, meta: BlockdMetadata, pool: Any, mapped: bool) -> None:
        """A step's saves and fence, then its report."""
        try:
            self._save(meta, pool, mapped)
        finally:
            with self._done:
                self.report.done = max(self.report.done, meta.step)
                self.sent.update(meta.sent)  # saved or not: vLLM must get its blocks back

    def _save(self, meta: BlockdMetadata, pool: Any, mapped: bool) -> None:
        if meta.pool is None or not (meta.save_vllm or meta.fence):
            return
        if not mapped:
            if meta.save_vllm:
                with self._done:
                    self.report.failed.add(meta.step)
            return
        first = next(iter(self.views.values()))
        if meta.save_vllm:
            kv_pool = pool.kv_pool(self.rank)
            why = out_of_range(meta.save_vllm, first.shape[0], meta.save_blockd,
                               pool_view(kv_pool, 0).shape[0])
            if why is None:
                try:
                    src = block_ids(meta.save_vllm, first.device)
                    dst = block_ids(meta.save_blockd, kv_pool.device)
                    for name, view in self.views.items():
                        copy_blocks(pool_view(kv_pool, self.layers[name]), dst, view, src)
                except (RuntimeError, IndexError) as err:
                    why = str(err)
            with self._done:
                if why is None:
                    self.report.ok.add(meta.step)
                    self._count_blocks("saved_blocks", len(meta.save_vllm))
                else:
                    self.report.failed.add(meta.step)
                    self.counters["save_failures"] += 1
            if why is not None:
                log.warning("blockd_vllm: saving %d blocks failed (%s): they are not "
                            "committed", len(meta.save_vllm), why)
        if meta.fence:
            stream = None
            if first.device.type == "cuda":
                import torch

                stream = torch.cuda.current_stream(first.device)
            pool.publish_fence_on_stream(meta.fence, stream)

    def _count_blocks(self, key: str, n: int) -> None:
        """Blocks are counted once per engine (by rank 0: every rank copies its shard of the
        same blocks); failures by every rank (vLLM sums the workers' counters)."""
        if self.rank == 0:
            self.counters[key] += n

    def take_report(self) -> SaveReport | None:
        if not (self.report.ok or self.report.failed or self.report.done):
            return None  # (the copy thread only adds to it: a report seen empty is empty)
        with self._done:
            report, self.report = self.report, SaveReport()
        return report if (report.ok or report.failed or report.done) else None

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""
        with self._done:
            sent, self.sent = self.sent, set()
        recving, self.recving = self.recving, set()
        return sent, recving

    def take_counters(self) -> Counter[str]:
        """The copy counters since the last call."""
        if not self.counters:
            return Counter()
        with self._done:
            counters, self.counters = self.counters, Counter()
        return counters

    def take_failed(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def retire(self) -> bool:
        """The worker stops for good (engine shutdown, after its last step): no copy of it is
        in flight any more, so every fence the session was issued is done. Publishing that
        (the daemon clamps the page's value to the fences it issued) lets the Steps the
        scheduler side sent after the last step (an idle engine's last commits and releases)
        apply before the session is detached, instead of being dropped with it. Only right
        before the detach: the page then says "done" for any later fence too. True when every
        rank has retired (this one last, or alone): the one to detach the session."""
        self.drain()  # the last saves run and publish their fences first
        if self.pool is None:
            return False
        first = next(iter(self.views.values()), None)
        try:
            if first is not None and first.device.type == "cuda":
                import torch

                torch.cuda.synchronize(first.device)  # the queued fence writes land first
            self.pool.publish_fence(ALL_ISSUED)
            return self.shape.tp_size == 1 or self.pool.session_fence() == ALL_ISSUED
        except Exception as err:  # (a failed publish only leaves those Steps to the lease)
            log.warning("blockd_vllm: could not report the worker's copies done: %s", err)
            return self.shape.tp_size == 1

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
