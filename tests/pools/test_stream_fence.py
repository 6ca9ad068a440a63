"""Stream-ordered fences (``Session.complete_on_stream``, ``blockd_client.fences``).

Three groups:

- CPU, with a real daemon and a real ``blockd_client.Client`` session on the host pool: the
  call publishes at once, the daemon retires the released blocks and hands them to another
  session; the monotonic rule; the errors.
- CPU, against ``FakeDriver``: NOT the CUDA driver, an in-memory stand-in with cuda-python 13's
  calling convention whose "stream" runs its queued operations when the test says so. It checks
  only ``FencePublisher``'s own logic: which mechanism it picks (stream write, host-function
  fallback on a device attribute or on CUDA_ERROR_NOT_SUPPORTED), that nothing reaches the page
  before the stream runs, the refusal of a host write under a queued one, and the teardown
  order. The host-function path does run the real ctypes thunk.
- ``@pytest.mark.gpu`` (skipped without a usable device): the real driver. A long kernel
  (``torch.cuda._sleep``) holds the fence back while the worker's thread has already returned,
  and the released blocks are not handed out (checked by content) until the stream passes it:
  with a real daemon on the cuda pool, and on a host pool with the kernels on the GPU (the
  stream passed explicitly); and the host-function fallback on the real driver.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from daemon_proc import TOKENS, start

import blockd_client.requests as rq
from blockd import wire
from blockd.pools.cuda import cuda_unavailable_reason
from blockd_client import Client, fences
from blockd_client.fences import FenceOrderError, FencePublisher
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")


def client(d: Any, who: str) -> Client:
    return Client(f"unix:{d.endpoints['unix']}", token=TOKENS[who])


def pool_stats(d: Any) -> Any:
    """The pool-wide counters (an admin's view: a worker's Stats shows its own tenants)."""
    with client(d, "admin") as c:
        return c.stats()


def wait_pending(d: Any, want: int, seconds: float = 5.0) -> int:
    deadline = time.monotonic() + seconds
    n = pool_stats(d).blocks_pending
    while n != want and time.monotonic() < deadline:
        time.sleep(0.01)
        n = pool_stats(d).blocks_pending
    return n


# -- CPU: a real daemon, the host pool ---------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = start(tmp_path_factory.mktemp("stream_fence"), num_blocks=32)
    yield d
    d.stop()


def test_on_cpu_tensors_it_publishes_at_once_and_the_daemon_retires(daemon) -> None:  # type: ignore[no-untyped-def]
    d = daemon
    with client(daemon, "alice") as ca, client(daemon, "bob") as cb:
        a = ca.attach("acme", LAYOUT)
        b = cb.attach("globex", LAYOUT)
        free = pool_stats(d).blocks_free + pool_stats(d).blocks_cached
        out = a.step([rq.admit(list(range(1000, 1024)), NS, cache=False)])
        seq = out.results[0].admit.sequence_id
        mine = set(out.results[0].admit.block_table)
        assert a.complete_on_stream(out.fence) == fences.HOST
        assert a.pool.fences.published == out.fence  # in the page on return
        rel = a.step([rq.release(seq)])
        assert pool_stats(d).blocks_pending == 6
        hog = b.step([rq.admit(list(range(4 * (free - 6))), NS, cache=False)])
        assert hog.results[0].status.code == 0 and not mine & set(hog.results[0].admit.block_table)
        more = b.step([rq.admit([1, 2, 3], NS, cache=False)])
        assert more.results[0].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        # CPU tensors: the released blocks' work already ran; published now, retired by the poll.
        assert a.complete_on_stream(rel.fence) == fences.HOST
        assert wire.read_fence(a.pool._fence) == rel.fence
        assert wait_pending(d, 0) == 0
        got = b.step([rq.admit([1, 2, 3], NS, cache=False)])
        assert got.results[0].status.code == 0
        assert set(got.results[0].admit.block_table) <= mine
        # What the page holds is what the session reports over RPC.
        assert a.state.completed_fence() == rel.fence
        a.heartbeat()
        b.step([rq.release(hog.results[0].admit.sequence_id),
                rq.release(got.results[0].admit.sequence_id)])
        a.detach()
        b.detach()


def test_fences_are_monotonic_and_bad_ones_are_named(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca:
        a = ca.attach("acme", LAYOUT)
        f1 = a.step([]).fence
        f2 = a.step([]).fence
        assert a.complete_on_stream(f2) == fences.HOST
        # Below or equal to the published fence: ignored, the page never goes down.
        assert a.complete_on_stream(f1) == fences.IGNORED
        assert a.complete_on_stream(f2) == fences.IGNORED
        assert a.pool.fences.published == f2
        a.complete(f1)  # the host call keeps its old rule: a lower fence is a no-op
        assert a.pool.fences.published == f2
        # A fence no Step announced is refused, naming both numbers.
        with pytest.raises(FenceOrderError, match=rf"fence {f2 + 5} was never announced.*{f2}"):
            a.complete_on_stream(f2 + 5)
        with pytest.raises(FenceOrderError, match="non-negative int"):
            a.pool.fences.publish_on_stream(-1, None)
        assert a.pool.fences.published == f2
        a.detach()
        with pytest.raises(ValueError, match="closed"):
            FencePublisher.publish(a_closed_publisher(), 9)


def a_closed_publisher() -> FencePublisher:
    page = mmap.mmap(-1, wire.FENCE_PAGE_BYTES)
    pub = FencePublisher(page)
    pub.close()
    return pub


def test_without_a_mapped_pool_a_stream_is_refused(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca:
        a = ca.attach("acme", LAYOUT, map_pool=False)
        f = a.step([]).fence
        with pytest.raises(ValueError, match="map_pool=False"):
            a.complete_on_stream(f, stream=1)
        assert a.complete_on_stream(f) == fences.HOST and a.state.completed_fence() == f
        a.detach()


def test_a_stream_without_a_driver_names_the_problem() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'cuda'")

    page = mmap.mmap(-1, wire.FENCE_PAGE_BYTES)
    pub = FencePublisher(page, loader=missing)
    with pytest.raises(RuntimeError, match="needs the CUDA driver: cuda-python is not installed"):
        pub.publish_on_stream(1, 7)
    assert pub.published == 0 and pub.publish(1) == fences.HOST
    pub.close()
    page.close()


# -- CPU: the fallback logic against a fake driver (NOT the real CUDA driver) --------------------


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_SUPPORTED = 801


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeDriver:
    """A stand-in for ``cuda.bindings.driver`` (labelled: not the driver). Streams are ints;
    their queued operations run on ``run(stream)``; every call is logged in ``calls``."""

    CUresult = FakeResult
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CU_MEMHOSTREGISTER_DEVICEMAP = 2
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS=120)
    CUstreamWriteValue_flags = SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0)

    def __init__(self, mem_ops: bool = True, write_result: FakeResult = FakeResult.CUDA_SUCCESS,
                 register_result: FakeResult = FakeResult.CUDA_SUCCESS) -> None:
        self.mem_ops = mem_ops
        self.write_result = write_result
        self.register_result = register_result
        self.calls: list[str] = []
        self.queues: dict[int, list[tuple[Any, ...]]] = {}
        self.registered: set[int] = set()

    def _ok(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.calls.append(name)
        return (FakeResult.CUDA_SUCCESS, *values)

    @staticmethod
    def CUstream(handle: int) -> int:  # noqa: N802 (cuda-python's name)
        return int(handle)

    @staticmethod
    def CUhostFn(addr: int) -> int:  # noqa: N802
        return int(addr)

    def cuInit(self, flags: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuInit")

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuDeviceGet", ordinal)

    def cuCtxGetDevice(self) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuCtxGetDevice", 0)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuDevicePrimaryCtxRetain", f"ctx{dev}")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuDevicePrimaryCtxRelease")

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuCtxPushCurrent")

    def cuCtxPopCurrent(self) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuCtxPopCurrent", None)

    def cuCtxSynchronize(self) -> tuple[Any, ...]:  # noqa: N802
        for stream in list(self.queues):
            self.run(stream)
        return self._ok("cuCtxSynchronize")

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuDeviceGetAttribute", int(self.mem_ops))

    def cuMemHostRegister(self, ptr: int, size: int, flags: int) -> tuple[Any, ...]:  # noqa: N802
        assert size == wire.FENCE_PAGE_BYTES and ptr % 4096 == 0 and flags == 3
        if self.register_result != FakeResult.CUDA_SUCCESS:
            self.calls.append("cuMemHostRegister")
            return (self.register_result,)
        self.registered.add(ptr)
        return self._ok("cuMemHostRegister")

    def cuMemHostGetDevicePointer(self, ptr: int, flags: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok("cuMemHostGetDevicePointer", ptr)  # UVA: the same address

    def cuMemHostUnregister(self, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        self.registered.discard(ptr)
        return self._ok("cuMemHostUnregister")

    def cuStreamWriteValue64(self, stream: int, addr: int, value: int, flags: int  # noqa: N802
                             ) -> tuple[Any, ...]:
        if self.write_result != FakeResult.CUDA_SUCCESS:
            self.calls.append("cuStreamWriteValue64")
            return (self.write_result,)
        assert any(0 <= addr - p < wire.FENCE_PAGE_BYTES for p in self.registered)
        assert flags == 0
        self.queues.setdefault(stream, []).append(("write", addr, value))
        return self._ok("cuStreamWriteValue64")

    def cuLaunchHostFunc(self, stream: int, fn: int, data: int) -> tuple[Any, ...]:  # noqa: N802
        self.queues.setdefault(stream, []).append(("host_fn", fn, data))
        return self._ok("cuLaunchHostFunc")

    def run(self, stream: int) -> None:
        """The stream passes every operation queued on it, in order."""
        for op in self.queues.pop(stream, []):
            if op[0] == "write":
                ctypes.c_uint64.from_address(op[1]).value = op[2]
            else:
                _HOST_FN(op[1])(op[2])  # the real ctypes thunk the publisher made


def fake_publisher(drv: FakeDriver, **kw: Any) -> tuple[FencePublisher, mmap.mmap]:
    page = mmap.mmap(-1, wire.FENCE_PAGE_BYTES)
    return FencePublisher(page, loader=lambda: drv, **kw), page


@pytest.mark.parametrize("mode", ["stream_write", "attribute_false", "not_supported", "forced"])
def test_fake_driver_the_page_changes_only_when_the_stream_runs(mode: str) -> None:
    drv = FakeDriver(mem_ops=mode != "attribute_false",
                     write_result=(FakeResult.CUDA_ERROR_NOT_SUPPORTED if mode == "not_supported"
                                   else FakeResult.CUDA_SUCCESS))
    pub, page = fake_publisher(drv, stream_writes=mode != "forced")
    want = fences.STREAM_WRITE if mode == "stream_write" else fences.HOST_FUNCTION
    assert pub.publish(2) == fences.HOST  # a host write first (its work is done)
    assert pub.publish_on_stream(5, 11) == want
    assert pub.published == 2 and pub.pending  # queued, not written
    assert pub.publish_on_stream(7, 11) == want  # the fallback is sticky
    assert pub.publish_on_stream(6, 11) == fences.IGNORED  # below the highest: never queued
    with pytest.raises(FenceOrderError, match="fence 7 is still queued on a CUDA stream"):
        pub.publish(8)
    drv.run(11)
    assert pub.published == 7 and not pub.pending
    assert pub.publish(8) == fences.HOST and pub.published == 8
    assert drv.calls.count("cuMemHostRegister") == 1  # registered once
    if mode == "not_supported":
        assert drv.calls.count("cuStreamWriteValue64") == 1  # tried once, then the fallback
    pub.close()
    assert not drv.registered and drv.calls[-1] == "cuDevicePrimaryCtxRelease"
    assert "cuCtxSynchronize" not in drv.calls  # nothing was queued any more
    page.close()  # the page is closable: no buffer export is left


def test_fake_driver_a_page_that_cannot_be_registered_is_written_by_host_functions() -> None:
    """A runtime that cannot pin the shared page (cuMemHostRegister fails): no stream write
    (it would need the page's device address), the host function instead, still in the
    stream's order; nothing to unregister at close."""
    drv = FakeDriver(register_result=FakeResult.CUDA_ERROR_NOT_SUPPORTED)
    pub, page = fake_publisher(drv)
    assert pub.publish_on_stream(3, 4) == fences.HOST_FUNCTION
    assert pub.published == 0 and pub.pending
    assert pub.publish_on_stream(5, 4) == fences.HOST_FUNCTION
    drv.run(4)
    assert pub.published == 5 and not pub.pending
    assert drv.calls.count("cuMemHostRegister") == 1  # tried once
    assert "cuStreamWriteValue64" not in drv.calls
    assert "cuMemHostGetDevicePointer" not in drv.calls
    pub.close()
    assert "cuMemHostUnregister" not in drv.calls
    assert drv.calls[-1] == "cuDevicePrimaryCtxRelease"
    page.close()


def test_fake_driver_close_waits_for_queued_writes_before_unregistering() -> None:
    drv = FakeDriver()
    pub, page = fake_publisher(drv)
    pub.publish_on_stream(3, 5)
    pub.close()
    order = [c for c in drv.calls if c in ("cuCtxSynchronize", "cuMemHostUnregister")]
    assert order == ["cuCtxSynchronize", "cuMemHostUnregister"]
    assert wire.read_fence(page) == 3
    page.close()


@pytest.mark.parametrize("mode", ["stream_write", "forced"])
def test_fake_driver_a_ranks_publisher_writes_its_slot_only(mode: str) -> None:
    """Tensor parallel: rank 1's worker writes slot 1 (offset 8), on the stream or by the host
    function; the page's fence (the daemon's ``read_fences``: the lowest slot) moves only
    once rank 0 wrote its own; a publisher of every shard writes every slot."""
    drv = FakeDriver()
    pub, page = fake_publisher(drv, stream_writes=mode == "stream_write", slots=(1,))
    assert pub.publish_on_stream(6, 3) in (fences.STREAM_WRITE, fences.HOST_FUNCTION)
    drv.run(3)
    assert (wire.read_fence(page, 0), wire.read_fence(page, 1)) == (0, 6)
    assert pub.published == 6 and wire.read_fences(page, 2) == 0
    wire.write_fence(page, 4, 0)  # rank 0 is behind: the session's fence is 4
    assert wire.read_fences(page, 2) == 4
    pub.close()
    both = FencePublisher(page, loader=lambda: drv, slots=(0, 1))
    assert both.publish(9) == fences.HOST and wire.read_fences(page, 2) == 9
    both.close()
    with pytest.raises(ValueError, match="slots: each in 0..511"):
        FencePublisher(page, slots=(512,))
    page.close()


def test_fake_driver_host_function_never_lowers_the_page() -> None:
    drv = FakeDriver(mem_ops=False)
    pub, page = fake_publisher(drv)
    pub.publish_on_stream(4, 1)  # stream 1
    pub.publish_on_stream(9, 2)  # stream 2 (not ordered with 1: the documented misuse)
    drv.run(2)
    drv.run(1)  # the late, lower write
    assert pub.published == 9
    pub.close()
    page.close()


# -- GPU: the real driver ------------------------------------------------------------------------


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (a CPU-only build or no device)"
    from blockd import cudadrv

    drv, problem = cudadrv.import_problem()
    return problem or cudadrv.init_problem(drv)


@pytest.fixture
def gpu() -> None:
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(reason)


#: ~1-2 s of a spinning kernel on an H200 (torch.cuda._sleep counts clock cycles).
SLEEP_CYCLES = 3_000_000_000


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("backend", ["cuda", "host"])
def test_gpu_a_long_kernel_holds_the_fence_and_the_blocks_back(tmp_path, backend: str) -> None:  # type: ignore[no-untyped-def]
    """cuda: the daemon's cuda pool, the pattern written by a kernel queued behind the sleep.
    host: a host pool, the kernels on the GPU and the stream passed explicitly."""
    if backend == "cuda" and (reason := cuda_unavailable_reason()) is not None:
        pytest.skip(reason)
    with start(tmp_path / "d", num_blocks=32, extra={"pool": {"backend": backend}}) as d, \
            client(d, "alice") as ca, client(d, "bob") as cb:
        a = ca.attach("acme", LAYOUT)
        b = cb.attach("globex", LAYOUT)
        kv_a = a.pool.kv_pool()
        stream = torch.cuda.current_stream(0)
        free = pool_stats(d).blocks_free + pool_stats(d).blocks_cached
        out = a.step([rq.admit(list(range(1000, 1024)), NS, cache=False)])
        seq = out.results[0].admit.sequence_id
        mine = sorted(out.results[0].admit.block_table)
        a.complete_on_stream(out.fence, stream)
        stream.synchronize()
        idx = torch.tensor(mine, device=kv_a.device)
        if backend == "host":
            kv_a.index_fill_(2, idx, 7.0)  # written by the CPU; the GPU kernel below "reads" it
        rel = a.step([rq.release(seq)])
        # The step's GPU work: a long kernel, then (cuda pool) a's pattern written into its
        # released blocks, queued behind it on the stream (a device-only op: no host wait).
        torch.cuda._sleep(SLEEP_CYCLES)
        if backend == "cuda":
            kv_a.index_fill_(2, idx, 7.0)
        t0 = time.monotonic()
        how = a.complete_on_stream(rel.fence, stream)
        returned_s = time.monotonic() - t0
        done = torch.cuda.Event()
        done.record(stream)
        assert how in (fences.STREAM_WRITE, fences.HOST_FUNCTION)
        assert not done.query(), "the kernel ended before the checks: raise SLEEP_CYCLES"
        assert returned_s < 0.5  # the thread did not wait for the kernel
        assert a.pool.fences.published == out.fence  # the page still has the old value
        time.sleep(0.05)  # many daemon polls
        assert pool_stats(d).blocks_pending == 6
        hog = b.step([rq.admit(list(range(4 * (free - 6))), NS, cache=False)])
        assert hog.results[0].status.code == 0
        assert not set(mine) & set(hog.results[0].admit.block_table)
        more = b.step([rq.admit([1, 2, 3], NS, cache=False)])
        assert more.results[0].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert not done.query(), "the kernel ended before the checks: raise SLEEP_CYCLES"
        stream.synchronize()
        assert a.pool.fences.published == rel.fence  # the stream wrote it
        assert torch.all(kv_a[:, :, mine] == 7.0)  # a's last write landed, nobody scrubbed it
        assert wait_pending(d, 0) == 0
        got = b.step([rq.admit(list(range(12)), NS, cache=False)])
        blocks = list(got.results[0].admit.block_table)
        assert got.results[0].status.code == 0 and set(blocks) <= set(mine)
        kv_b = b.pool.kv_pool()
        assert int(torch.count_nonzero(kv_b[:, :, blocks])) == 0  # scrubbed before b got them
        assert torch.all(kv_a[:, :, [x for x in mine if x not in blocks]] == 7.0)
        del kv_a, kv_b
        a.detach()
        b.detach()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gpu_host_function_fallback_on_the_real_driver() -> None:
    from blockd.pools.fences import FencePage

    page = FencePage()  # the daemon's side of a page; the publisher maps it as a worker does
    worker_map = mmap.mmap(page.fd, wire.FENCE_PAGE_BYTES, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
    pub = FencePublisher(worker_map, stream_writes=False)
    try:
        stream = torch.cuda.Stream(0)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES // 3)
        assert pub.publish_on_stream(4, stream) == fences.HOST_FUNCTION
        assert page.read() == 0
        stream.synchronize()
        assert page.read() == 4
        pub.close()  # unregistered: a second publisher may register the page again
        writes = FencePublisher(worker_map)
        assert writes.highest == 4
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES // 3)
        how = writes.publish_on_stream(5, stream)
        assert page.read() == 4
        stream.synchronize()
        assert page.read() == 5 and how in (fences.STREAM_WRITE, fences.HOST_FUNCTION)
        writes.close()
    finally:
        pub.close()
        worker_map.close()
        page.close()
