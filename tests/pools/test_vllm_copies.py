"""The connector's data path without vLLM: ``blockd_vllm.worker`` against a real daemon's pool.

vLLM-shaped KV tensors in each layout the connector knows (the CPU backend's LBHNC
``[blocks, H, B, 2D]``, FlashAttention's NHD ``[2, blocks, B, H, D]`` and HND), a session
attached as the connector's scheduler side attaches (no mapping of its own), and the worker side
mapping that session's pool through the handle socket: saves land in blockd's blocks
token-major, loads bring them back into other vLLM blocks, byte for byte, and the step's fence is
published. On a GPU (``test_gpu_*``, the cuda pool, CUDA tensors): loads run on a side stream and
the fence is written in the stream's order, so the worker's thread returns while a long kernel
still holds both back (checked by content and by the fence page).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from blockd_vllm.layout import KvShape
from blockd_vllm.metadata import BlockdMetadata, PoolRef
from blockd_vllm.worker import WorkerSide
from daemon_proc import TOKENS, start

import blockd_client.requests as rq
from blockd_client import Client
from blockd_gpu import KvLayout

B, H, D, LAYERS, VLLM_BLOCKS = 4, 2, 8, 2, 10
SHAPE = KvShape(num_layers=LAYERS, block_size=B, num_kv_heads=H, head_dim=D, dtype="float16")
LAYOUT = KvLayout(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_size=B, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")


def vllm_caches(form: str, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = {"LBHNC": (VLLM_BLOCKS, H, B, 2 * D), "NHD": (2, VLLM_BLOCKS, B, H, D),
             "HND": (2, VLLM_BLOCKS, H, B, D)}[form]
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(shape, generator=g).to(torch.float16).to(device) for i in range(LAYERS)}


def kv_of(t: torch.Tensor, form: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one vLLM block, token-major ``[B, H, D]`` (read independently of the view)."""
    if form == "LBHNC":
        x = t[block].permute(1, 0, 2)  # [B, H, 2D]
        return x[..., :D], x[..., D:]
    if form == "NHD":
        return t[0, block], t[1, block]
    return t[0, block].permute(1, 0, 2), t[1, block].permute(1, 0, 2)


def scenario(d: Any, form: str, device: str, sync: Any = None) -> None:
    with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"]) as c:
        s = c.attach("acme", LAYOUT, map_pool=False)
        out = s.step([rq.admit(list(range(100, 112)), NS)])  # 3 full blocks, all new
        table = list(out.results[0].admit.block_table)
        ref = PoolRef(s.session_id, s.epoch, s.state.attach.pool.handle_socket_path,
                      fetch_secret=s.fetch_secret)
        caches = vllm_caches(form, device)
        worker = WorkerSide(SHAPE, "LBHNC" if form == "LBHNC" else form)
        worker.register(caches)
        # Save vLLM blocks 3, 5, 7 into the sequence's blockd blocks, then the fence.
        save = BlockdMetadata(pool=ref, fence=out.fence, step=1, save_vllm=[3, 5, 7],
                              save_blockd=table)
        worker.start_load(save)  # maps the pool (nothing to load)
        assert not worker.take_counters()  # nothing loaded or failed: no figure for vLLM
        worker.save(save)
        worker.drain()  # CPU tensors: the copy thread ran it (CUDA: nothing to wait for here)
        if sync:
            sync()
        kv = worker.pool.kv_pool(0)
        for name, t in caches.items():
            layer = int(name.split(".")[2])
            for vb, bb in zip([3, 5, 7], table, strict=True):
                k, v = kv_of(t, form, vb)
                assert torch.equal(kv[layer, 0, bb], k) and torch.equal(kv[layer, 1, bb], v)
        assert worker.pool.fences.published == out.fence
        report = worker.take_report()
        assert report is not None and report.ok == {1} and report.done == 1
        # Load them back into vLLM blocks 1, 2, 4 (zeroed first).
        originals = {n: [kv_of(t, form, vb) for vb in (3, 5, 7)] for n, t in caches.items()}
        for t in caches.values():
            for vb in (1, 2, 4):
                if form == "LBHNC":
                    t[vb].zero_()
                else:
                    t[:, vb].zero_()
        load = BlockdMetadata(pool=ref, fence=out.fence, step=2, load_vllm=[1, 2, 4],
                              load_blockd=table, load_session=[s.session_id] * 3)
        worker.start_load(load)
        for name in caches:
            worker.wait_layer(name)
        if sync:
            sync()
        for name, t in caches.items():
            for vb, (k, v) in zip((1, 2, 4), originals[name], strict=True):
                got_k, got_v = kv_of(t, form, vb)
                assert torch.equal(got_k, k) and torch.equal(got_v, v)
        # A load for a session the worker cannot map is refused as a load error (recomputed).
        stale = BlockdMetadata(pool=ref, step=3, load_vllm=[6], load_blockd=[table[0]],
                               load_session=["someone-else"])
        worker.start_load(stale)
        assert worker.take_failed() == {6}
        # Block ids out of range are refused on the host before any copy is launched (on CUDA
        # a bad index would be a device-side assert): such loads are recomputed, a save fails.
        n_pool = worker.pool.num_blocks
        vllm_before = {n: t.clone() for n, t in caches.items()}
        pool_before = worker.pool.kv_pool(0).clone()
        worker.start_load(BlockdMetadata(pool=ref, step=4, load_vllm=[VLLM_BLOCKS + 5, 0],
                                         load_blockd=table[:2], load_session=[s.session_id] * 2))
        worker.start_load(BlockdMetadata(pool=ref, step=5, load_vllm=[8], load_blockd=[n_pool],
                                         load_session=[s.session_id]))
        for name in caches:
            worker.wait_layer(name)
        assert worker.take_failed() == {VLLM_BLOCKS + 5, 0, 8}
        worker.save(BlockdMetadata(pool=ref, step=6, save_vllm=[3], save_blockd=[n_pool]))
        worker.save(BlockdMetadata(pool=ref, step=7, save_vllm=[-1], save_blockd=[table[0]]))
        worker.drain()
        if sync:
            sync()
        report = worker.take_report()
        assert report is not None and report.failed == {6, 7} and not report.ok
        assert all(torch.equal(t, vllm_before[n]) for n, t in caches.items())
        assert torch.equal(worker.pool.kv_pool(0), pool_before)
        worker.close()
        s.detach()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    with start(tmp_path_factory.mktemp("vllm_copies"), num_blocks=32) as d:
        yield d


@pytest.mark.parametrize("form", ["LBHNC", "NHD", "HND"])
def test_saves_and_loads_are_byte_exact_in_every_layout(daemon, form: str) -> None:  # type: ignore[no-untyped-def]
    scenario(daemon, form, "cpu")


def test_cpu_saves_run_on_the_copy_thread_and_count_only_once_copied(daemon, caplog) -> None:  # type: ignore[no-untyped-def]
    """On CPU tensors ``save`` returns before the copy (the copy thread runs it, bound to a
    CPU the worker is not, when there is one, and named for the kernel so that nothing takes
    it for one of vLLM's worker threads): blockd's blocks, the fence, the report and a held
    request's ``finished_sending`` all wait for it, and a later step's fence never overtakes
    an earlier step's copy; ``drain`` returns once the copies in flight ran. A save that
    succeeds logs nothing."""
    import logging
    import threading

    from blockd_vllm.copier import THREAD_NAME, spare_cpus

    caplog.set_level(logging.WARNING, logger="blockd_vllm")

    with Client(f"unix:{daemon.endpoints['unix']}", token=TOKENS["alice"]) as c:
        s = c.attach("acme", LAYOUT, map_pool=False)
        out = s.step([rq.admit(list(range(300, 312)), NS)])
        table = list(out.results[0].admit.block_table)
        f2, f3 = s.step([]).fence, s.step([]).fence  # later Steps: later fences
        ref = PoolRef(s.session_id, s.epoch, s.state.attach.pool.handle_socket_path,
                      fetch_secret=s.fetch_secret)
        caches = vllm_caches("LBHNC", "cpu")
        worker = WorkerSide(SHAPE, "LBHNC")
        worker.register(caches)
        assert worker.copier is not None and worker.copier.cpus == spare_cpus()
        worker.save(BlockdMetadata(pool=ref, fence=out.fence))  # maps the pool; nothing queued
        assert worker.pool.fences.published == out.fence
        kv = worker.pool.kv_pool(0)
        kv[:, :, table] = 0
        gate = threading.Event()
        worker.copier.submit(lambda: gate.wait(10))  # an earlier step's slow copy
        worker.save(BlockdMetadata(pool=ref, fence=f2, step=1, save_vllm=[3, 5, 7],
                                   save_blockd=table, sent=["held"]))
        worker.save(BlockdMetadata(pool=ref, fence=f3))  # no saves: behind them all the same
        assert worker.copier.held == 3  # all wait for the next step to start (``release``)
        assert worker.take_report() is None and worker.take_finished() == (set(), set())
        assert worker.pool.fences.published == out.fence and not kv[:, :, table].any()
        opened = threading.Timer(0.3, gate.set)
        opened.start()
        t0 = time.monotonic()
        worker.drain()  # what a step after a preemption does first (``handle_preemptions``)
        assert time.monotonic() - t0 >= 0.25  # it waited for the copies in flight
        assert worker.copier.held == 0
        for name, t in caches.items():
            layer = int(name.split(".")[2])
            for vb, bb in zip([3, 5, 7], table, strict=True):
                k, v = kv_of(t, "LBHNC", vb)
                assert torch.equal(kv[layer, 0, bb], k) and torch.equal(kv[layer, 1, bb], v)
        assert worker.pool.fences.published == f3
        report = worker.take_report()
        assert report is not None and report.ok == {1} and report.done == 1
        assert worker.take_finished() == ({"held"}, set())  # vLLM frees its blocks now
        assert worker.take_counters()["saved_blocks"] == 3
        assert not [r for r in caplog.records if r.name == "blockd_vllm"]
        tid = worker.copier._thread.native_id
        with open(f"/proc/self/task/{tid}/comm") as f:
            assert f.read().strip() == THREAD_NAME
        worker.close()
        s.detach()


def test_the_copy_thread_goes_where_no_worker_of_the_engine_is_bound() -> None:
    from blockd_vllm.copier import spare

    four = {0, 1, 2, 3}
    assert spare({0}, "auto", four, ranks=1) == {1, 2, 3}  # vLLM's reserved cores included
    assert spare({0}, "auto", four, ranks=2) == {0}  # the other rank's cores are unknown
    assert spare({0}, "0|1", four, ranks=2) == {2, 3}
    assert spare({0, 1}, "0-1,3|2", four, ranks=2) == {0, 1}  # none left: its own
    assert spare({0}, "not a list", four, ranks=1) == {0}


def test_a_tensor_of_another_shape_is_refused_naming_it() -> None:
    worker = WorkerSide(SHAPE, "LBHNC")
    bad = {f"model.layers.{i}.self_attn.attn": torch.zeros(VLLM_BLOCKS, H, B + 1, 2 * D,
                                                          dtype=torch.float16)
           for i in range(LAYERS)}
    with pytest.raises(ValueError, match=r"shape \(10, 2, 5, 16\)"):
        worker.register(bad)
    wrong_dtype = {n: t.float() for n, t in vllm_caches("NHD", "cpu").items()}
    with pytest.raises(ValueError, match="holds float32, the engine's KV dtype is float16"):
        worker.register(wrong_dtype)


def _gpu_reason() -> str | None:
    from blockd.pools.cuda import cuda_unavailable_reason

    if not torch.cuda.is_available():
        return "no CUDA device"
    return cuda_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["NHD", "HND"])
def test_gpu_copies_on_the_stream_with_the_cuda_pool(tmp_path, form: str) -> None:  # type: ignore[no-untyped-def]
    """The cuda pool and CUDA tensors laid out as vLLM's FlashAttention cache: byte-exact, and
    the fence and the loads wait for the stream (a long kernel ahead of them), not the host."""
    if (reason := _gpu_reason()) is not None:
        pytest.skip(reason)
    with start(tmp_path / "d", num_blocks=32, extra={"pool": {"backend": "cuda"}}) as d:
        scenario(d, form, "cuda", sync=torch.cuda.synchronize)
        # The stream order: a long kernel, then a save and its fence; the thread returns first.
        with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"]) as c:
            s = c.attach("acme", LAYOUT, map_pool=False)
            out = s.step([rq.admit(list(range(200, 204)), NS)])
            table = list(out.results[0].admit.block_table)
            ref = PoolRef(s.session_id, s.epoch, s.state.attach.pool.handle_socket_path,
                          fetch_secret=s.fetch_secret)
            worker = WorkerSide(SHAPE, form)
            caches = vllm_caches(form, "cuda")
            worker.register(caches)
            meta = BlockdMetadata(pool=ref, fence=out.fence, step=1, save_vllm=[9],
                                  save_blockd=table)
            worker.start_load(meta)
            torch.cuda.synchronize()
            torch.cuda._sleep(3_000_000_000)
            t0 = time.monotonic()
            worker.save(meta)
            assert time.monotonic() - t0 < 0.5
            done = torch.cuda.Event()
            done.record()
            assert not done.query(), "the kernel ended before the check: raise the sleep"
            assert worker.pool.fences.published < out.fence
            torch.cuda.synchronize()
            assert worker.pool.fences.published == out.fence
            worker.close()
            s.detach()
