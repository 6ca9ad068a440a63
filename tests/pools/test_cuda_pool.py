"""The CUDA pool (``blockd.pools.cuda``) and the worker's view of it (``blockd_client.cuda_view``).

Three groups:

- Always run: the module imports without touching CUDA; without a usable device the pool
  reports why (``cuda_unavailable_reason``) and refuses with FAILED_PRECONDITION on
  ``pool.backend``; the worker view rejects a bad header or descriptor list and closes the fds.
- Always run, against ``FakeDriver``: an in-memory stand-in for ``cuda.bindings.driver`` with
  cuda-python 13's calling convention (tuples ``(CUresult, value...)``). It checks this module's
  own logic (granularity rounding, run offsets, coalesced memsets on the daemon's own stream,
  never a device-wide sync, error mapping, cleanup after a failure half way) and nothing about
  the real driver: that is what the GPU group is for.
- ``@pytest.mark.gpu``, skipped with the reason when no CUDA device is usable: the real driver,
  including an fd passed over a Unix socket (SCM_RIGHTS) to a second process that writes K/V
  through ``CudaPoolView``. Run them with ``scripts/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from blockd import handle_wire, wire
from blockd.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from blockd.core.spec import PoolSpec
from blockd.pools import cuda as cuda_pool
from blockd.pools.cuda import CudaPool, cuda_unavailable_reason
from blockd.pools.fences import FencePage

ROOT = Path(__file__).resolve().parents[2]
SPEC = PoolSpec(block_size=16, num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=64,
                dtype="float16")


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# -- always run: no CUDA needed ---------------------------------------------------------------


def test_modules_import_without_touching_cuda() -> None:
    probe = (
        "import json, sys\n"
        "import blockd.pools.cuda, blockd_client.cuda_view\n"
        "torch = sys.modules.get('torch')\n"
        "print(json.dumps({'driver': 'cuda.bindings.driver' in sys.modules,\n"
        "                  'bindings': 'cuda.bindings' in sys.modules,\n"
        "                  'torch_cuda': bool(torch and torch.cuda.is_initialized())}))\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "gpu"), str(ROOT / "clients"),
                      env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "driver": False, "bindings": False, "torch_cuda": False}


def test_unavailable_reason_never_raises() -> None:
    reason = cuda_unavailable_reason()
    assert reason is None or (isinstance(reason, str)
                              and reason.startswith("cuda pool unavailable: "))


def test_pool_without_cuda_is_a_failed_precondition_on_pool_backend() -> None:
    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("a CUDA device is usable here; the GPU tests cover creation")
    assert reason.strip()
    with pytest.raises(FailedPrecondition) as info:
        CudaPool(SPEC)
    assert info.value.field == "pool.backend"
    assert reason in info.value.message


def test_cuda_python_missing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import raise ImportError, as if the package were absent.
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    reason = cuda_unavailable_reason()
    assert reason is not None and "cuda-python is not installed" in reason
    with pytest.raises(FailedPrecondition) as info:
        CudaPool(SPEC)
    assert info.value.field == "pool.backend" and "cuda-python" in info.value.message


def test_devices_must_match_tp_size() -> None:
    spec = PoolSpec(block_size=16, num_blocks=8, tp_size=2)
    for devices in ([0], [0, 0], [0, 1, 2]):
        with pytest.raises(InvalidArgument) as info:
            CudaPool(spec, devices=devices)
        assert info.value.field == "pool.devices"


def _view_header(**over: Any) -> dict[str, Any]:
    h: dict[str, Any] = {"ok": True, "epoch": 3, "backend": "cuda", "pool_bytes": 2 << 20,
                         "num_blocks": 64, "block_size": 16, "num_layers": 2, "num_kv_heads": 2,
                         "head_dim": 64, "dtype": "float16", "tp_size": 1,
                         "fence_page_bytes": wire.FENCE_PAGE_BYTES, "devices": [0],
                         "shard_bytes": 2 << 20, "granularity": 2 << 20}
    h.update(over)
    return h


@pytest.mark.parametrize(("header", "nfds", "error", "words"), [
    (_view_header(tp_size=2), 2, ValueError, "^devices"),
    (_view_header(tp_size=2, devices=[0, 1]), 2, ValueError, "expected 3 descriptors"),
    (_view_header(), 3, ValueError, "expected 2 descriptors"),
    (_view_header(dtype="float8_e4m3"), 2, ValueError, "^dtype"),
    (_view_header(shard_bytes=1 << 19, granularity=1 << 19), 2, ValueError, "^shard_bytes"),
    ({k: v for k, v in _view_header().items() if k != "shard_bytes"}, 2, ValueError,
     "^shard_bytes"),
    ({"ok": False, "code": "NOT_FOUND", "message": "gone"}, 2, ConnectionError, "NOT_FOUND"),
])
def test_worker_rejects_a_bad_answer_and_closes_the_fds(header: dict[str, Any], nfds: int,
                                                        error: type[Exception],
                                                        words: str) -> None:
    from blockd_client.handles import parse_answer

    fds = [os.memfd_create("t", os.MFD_CLOEXEC) for _ in range(nfds)]
    with pytest.raises(error, match=words):
        parse_answer(json.dumps(header).encode() + b"\n", fds)
    assert not any(fd_is_open(fd) for fd in fds)


def test_cuda_view_refuses_a_host_header_and_closes_the_fds() -> None:
    from blockd_client.cuda_view import CudaPoolView

    header = handle_wire.HandleHeader.from_json({
        k: v for k, v in _view_header(backend="host").items()
        if k not in ("devices", "shard_bytes", "granularity")})
    fds = [os.memfd_create("t", os.MFD_CLOEXEC) for _ in range(2)]
    with pytest.raises(ConnectionError, match="PoolView"):
        CudaPoolView(header, fds)
    assert not any(fd_is_open(fd) for fd in fds)


def _driver_library_missing() -> bool:
    try:
        from cuda.bindings import driver
    except ImportError:
        return False
    try:
        driver.cuInit(0)
    except RuntimeError:
        return True
    return False


@pytest.mark.skipif(not _driver_library_missing(),
                    reason="needs cuda-python without libcuda: the calls would reach a driver")
def test_real_bindings_accept_the_argument_types_we_pass() -> None:
    """cuda-python converts arguments before it loads libcuda, so without the library every call
    below stops at the load: a wrong argument type (say, an int where it wants a CUdeviceptr)
    would be a TypeError instead. This pins the calling convention both modules rely on."""
    from cuda.bindings import driver as d

    fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handle, stream, dev = d.CUmemGenericAllocationHandle(), d.CUstream(), d.CUdevice(0)
    out = bytearray(16)
    host = ctypes.addressof(ctypes.c_char.from_buffer(out))
    ptr, size = 1 << 40, 1 << 21
    calls = [
        lambda: d.cuMemGetAllocationGranularity(
            d.CUmemAllocationProp(),
            d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        lambda: d.cuMemCreate(size, d.CUmemAllocationProp(), 0),
        lambda: d.cuMemExportToShareableHandle(handle, fd_type, 0),
        lambda: d.cuMemImportFromShareableHandle(5, fd_type),  # the fd as a plain int
        lambda: d.cuMemAddressReserve(size, size, 0, 0),
        lambda: d.cuMemMap(ptr, size, 0, handle, 0),  # int pointers throughout
        lambda: d.cuMemSetAccess(ptr, size, [d.CUmemAccessDesc()], 1),
        lambda: d.cuMemsetD8Async(ptr, 0, 16, stream),
        lambda: d.cuMemcpyDtoHAsync(host, ptr, 16, stream),
        lambda: d.cuMemUnmap(ptr, size),
        lambda: d.cuMemRelease(handle),
        lambda: d.cuMemAddressFree(ptr, size),
        lambda: d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)),
        lambda: d.cuStreamSynchronize(stream),
        lambda: d.cuStreamDestroy(stream),
        lambda: d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
        lambda: d.cuDeviceGetUuid(dev),
        lambda: d.cuDevicePrimaryCtxRetain(dev),
        lambda: d.cuDevicePrimaryCtxRelease(dev),
        lambda: d.cuCtxPushCurrent(d.CUcontext()),
        lambda: d.cuCtxPopCurrent(),
        lambda: d.cuCtxSynchronize(),
        lambda: d.cuDeviceGet(0),
        lambda: d.cuDeviceGetCount(),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(RuntimeError) as info:
            call()
        assert not isinstance(info.value, TypeError), i
    with pytest.raises(TypeError):  # the control: conversion does happen before the load
        d.cuMemMap("not a pointer", size, 0, handle, 0)
    # An error code needs no library to be named (what the pool's messages use).
    assert d.CUresult(2).name == "CUDA_ERROR_OUT_OF_MEMORY"


# -- always run: the module's logic against an in-memory driver -------------------------------


class FakeDriver:
    """``cuda.bindings.driver`` as far as CudaPool uses it, backed by bytearrays.

    Enums and structs come from the real module (they need no driver library). Memory starts as
    0xAB garbage, so a pool that forgot its initial scrub is caught. Every memset and copy is
    bounds-checked against the mapping it falls in and must use a stream of the context that is
    current, i.e. the right device.
    """

    def __init__(self, num_devices: int = 2, granularity: int = 1 << 16,
                 fail: dict[str, tuple[int, str]] | None = None, vmm: bool = True) -> None:
        self._real = pytest.importorskip("cuda.bindings.driver")
        self.R = self._real.CUresult
        self.num_devices = num_devices
        self.granularity = granularity
        self.vmm = vmm
        #: call name -> (which call fails, 1-based or 0 for all; the CUresult name returned)
        self.fail = dict(fail or {})
        self.calls: Counter[str] = Counter()
        self.log: list[tuple[str, Any]] = []
        self.memory: dict[int, bytearray] = {}
        self.handle_device: dict[int, int] = {}
        self.maps: dict[int, tuple[int, int]] = {}  # va -> (handle, size)
        self.reserved: dict[int, int] = {}
        self.access: dict[int, list[Any]] = {}
        self.streams: dict[int, tuple[int, int]] = {}  # id -> (device, flags)
        self.retained: Counter[int] = Counter()
        self.stack: list[str] = []
        self.exported: list[int] = []
        self._next = 1
        self._next_va = 1 << 40
        #: Size of an allocation imported from an fd (the fake cannot ask the fd).
        self.import_bytes = granularity

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    # bookkeeping

    def _ok(self, name: str, *values: Any) -> tuple[Any, ...]:
        self.calls[name] += 1
        rule = self.fail.get(name)
        if rule and rule[0] in (0, self.calls[name]):  # 0: every call fails
            err = getattr(self.R, rule[1])
            return (err, *([None] * len(values)))
        return (self.R.CUDA_SUCCESS, *values)

    def _id(self) -> int:
        self._next += 1
        return self._next

    def _current_device(self) -> int:
        assert self.stack, "no current context"
        return int(self.stack[-1].removeprefix("ctx"))

    def locate(self, ptr: int, n: int) -> tuple[bytearray, int]:
        for va, (handle, size) in self.maps.items():
            if va <= ptr and ptr + n <= va + size:
                assert self.handle_device[handle] == self._current_device(), "wrong device"
                return self.memory[handle], ptr - va
        raise AssertionError(f"access [{ptr:#x}, +{n}) outside every mapping")

    # device and context

    def cuInit(self, flags: int) -> tuple[Any, ...]:
        return self._ok("cuInit")

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return self._ok("cuDeviceGetCount", self.num_devices)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        if not 0 <= ordinal < self.num_devices:
            return (self.R.CUDA_ERROR_INVALID_DEVICE, None)
        return self._ok("cuDeviceGet", ordinal)

    def cuDeviceGetAttribute(self, attrib: Any, dev: int) -> tuple[Any, ...]:
        return self._ok("cuDeviceGetAttribute", 1 if self.vmm else 0)

    def cuDeviceGetUuid(self, dev: int) -> tuple[Any, ...]:
        return self._ok("cuDeviceGetUuid", SimpleNamespace(bytes=bytes([dev + 1]) * 16))

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, ...]:
        self.retained[dev] += 1
        return self._ok("cuDevicePrimaryCtxRetain", f"ctx{dev}")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple[Any, ...]:
        self.retained[dev] -= 1
        return self._ok("cuDevicePrimaryCtxRelease")

    def cuCtxPushCurrent(self, ctx: str) -> tuple[Any, ...]:
        self.stack.append(ctx)
        return self._ok("cuCtxPushCurrent")

    def cuCtxPopCurrent(self) -> tuple[Any, ...]:
        ctx = self.stack.pop()
        return self._ok("cuCtxPopCurrent", ctx)

    def cuCtxSynchronize(self) -> tuple[Any, ...]:
        self.log.append(("cuCtxSynchronize", self._current_device()))
        return self._ok("cuCtxSynchronize")

    # streams

    def cuStreamCreate(self, flags: int) -> tuple[Any, ...]:
        s = self._id()
        self.streams[s] = (self._current_device(), flags)
        return self._ok("cuStreamCreate", s)

    def cuStreamSynchronize(self, stream: int) -> tuple[Any, ...]:
        assert self.streams[stream][0] == self._current_device()
        self.log.append(("cuStreamSynchronize", stream))
        return self._ok("cuStreamSynchronize")

    def cuStreamDestroy(self, stream: int) -> tuple[Any, ...]:
        del self.streams[stream]
        return self._ok("cuStreamDestroy")

    # VMM

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[Any, ...]:
        assert option == self._real.CUmemAllocationGranularity_flags.\
            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return self._ok("cuMemGetAllocationGranularity", self.granularity)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, ...]:
        real = self._real
        assert size % self.granularity == 0 and flags == 0
        assert prop.type == real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert prop.requestedHandleTypes == \
            real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        out = self._ok("cuMemCreate", None)
        if out[0] != self.R.CUDA_SUCCESS:
            return out
        h = self._id()
        self.memory[h] = bytearray(b"\xab" * size)
        self.handle_device[h] = prop.location.id
        return (out[0], h)

    def cuMemExportToShareableHandle(self, handle: int, kind: Any, flags: int) -> tuple[Any, ...]:
        assert handle in self.memory
        out = self._ok("cuMemExportToShareableHandle", None)
        if out[0] != self.R.CUDA_SUCCESS:
            return out
        fd = os.memfd_create("fake-cuda-export")  # inheritable, like the driver's
        self.exported.append(fd)
        return (out[0], fd)

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> tuple[Any, ...]:
        assert fd_is_open(fd)
        assert kind == self._real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        out = self._ok("cuMemImportFromShareableHandle", None)
        if out[0] != self.R.CUDA_SUCCESS:
            return out
        h = self._id()
        self.memory[h] = bytearray(self.import_bytes)
        self.handle_device[h] = self._current_device()
        return (out[0], h)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int
                            ) -> tuple[Any, ...]:
        va = self._next_va
        self._next_va += size + (1 << 30)
        self.reserved[va] = size
        return self._ok("cuMemAddressReserve", va)

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int
                 ) -> tuple[Any, ...]:
        out = self._ok("cuMemMap")
        if out[0] == self.R.CUDA_SUCCESS:
            assert self.reserved.get(ptr) == size and len(self.memory[handle]) == size
            self.maps[ptr] = (handle, size)
        return out

    def cuMemSetAccess(self, ptr: int, size: int, desc: list[Any], count: int
                       ) -> tuple[Any, ...]:
        assert ptr in self.maps and count == len(desc) == 1
        self.access[ptr] = desc
        return self._ok("cuMemSetAccess")

    def cuMemsetD8Async(self, ptr: int, value: int, n: int, stream: int) -> tuple[Any, ...]:
        assert self.streams[stream][0] == self._current_device(), "memset on another device"
        buf, off = self.locate(ptr, n)
        buf[off:off + n] = bytes([value]) * n
        self.log.append(("cuMemsetD8Async", (ptr, n, stream)))
        return self._ok("cuMemsetD8Async")

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, stream: int) -> tuple[Any, ...]:
        assert self.streams[stream][0] == self._current_device()
        buf, off = self.locate(src, n)
        ctypes.memmove(dst, bytes(buf[off:off + n]), n)
        return self._ok("cuMemcpyDtoHAsync")

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[Any, ...]:
        assert self.maps.pop(ptr)[1] == size
        return self._ok("cuMemUnmap")

    def cuMemRelease(self, handle: int) -> tuple[Any, ...]:
        del self.memory[handle]
        return self._ok("cuMemRelease")

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[Any, ...]:
        assert ptr not in self.maps and self.reserved.pop(ptr) == size
        return self._ok("cuMemAddressFree")

    # test helpers

    def fill(self, value: int) -> None:
        for buf in self.memory.values():
            buf[:] = bytes([value]) * len(buf)

    def assert_all_released(self) -> None:
        assert not self.maps and not self.reserved and not self.memory and not self.streams
        assert not self.stack and all(n == 0 for n in self.retained.values())
        assert not any(fd_is_open(fd) for fd in self.exported)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver()
    monkeypatch.setattr(cuda_pool, "_driver", lambda: drv)
    return drv


def test_fake_geometry_fds_and_header(fake: FakeDriver) -> None:
    spec = PoolSpec(block_size=16, num_blocks=100, num_layers=3, num_kv_heads=2, head_dim=64,
                    dtype="bfloat16", tp_size=2)
    pool = CudaPool(spec)
    try:
        assert pool.run_bytes == 16 * 2 * 64 * 2
        assert pool.plane_bytes == pool.run_bytes * 100 and pool.num_planes == 6
        assert pool.size % fake.granularity == 0
        assert pool.plane_bytes * pool.num_planes <= pool.size < (
            pool.plane_bytes * pool.num_planes + fake.granularity)
        assert pool.size >= spec.pool_bytes
        assert pool.devices == [0, 1] and len(pool.fds) == 2
        assert all(not os.get_inheritable(fd) for fd in pool.fds)  # no leak into children
        header, fds = pool.handle(7, 99)
        assert header.backend == "cuda" and header.device_uuids == ("01" * 16, "02" * 16)
        assert fds == [*pool.fds, 99] and header.split_fds(fds) == (pool.fds, 99)
        assert header.medium == pool.medium == "GPU" and header.epoch == 7
        assert (header.devices, header.shard_bytes, header.granularity) == (
            (0, 1), pool.size, fake.granularity)
        assert header.device_uuids == ("01" * 16, "02" * 16)
        assert handle_wire.HandleHeader.from_json(header.to_json()) == header
        # Each shard mapped read-write for its own device only.
        for va, desc in fake.access.items():
            dev = fake.handle_device[fake.maps[va][0]]
            assert [d.location.id for d in desc] == [dev]
            assert desc[0].flags == fake.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        # The daemon's streams do not serialise with the legacy default stream.
        flags = int(fake.CUstream_flags.CU_STREAM_NON_BLOCKING)
        assert sorted(d for d, f in fake.streams.values() if f == flags) == [0, 1]
    finally:
        pool.close()
    fake.assert_all_released()


def test_fake_pool_starts_zeroed(fake: FakeDriver) -> None:
    pool = CudaPool(SPEC)
    try:  # fresh device memory is garbage (0xAB) until the pool's initial scrub
        for b in (0, 17, SPEC.num_blocks - 1):
            assert pool.read_block(b) == bytes(pool.num_planes * pool.run_bytes)
    finally:
        pool.close()


def test_fake_zero_blocks_touches_exactly_the_blocks(fake: FakeDriver) -> None:
    spec = PoolSpec(block_size=4, num_blocks=16, num_layers=2, num_kv_heads=1, head_dim=8,
                    dtype="float16", tp_size=2)
    pool = CudaPool(spec)
    try:
        fake.fill(0x5A)
        fake.log.clear()
        pool.zero_blocks([9, 3, 4, 3])
        block = pool.num_planes * pool.run_bytes
        for shard in (0, 1):
            for b in range(spec.num_blocks):
                want = bytes(block) if b in (3, 4, 9) else b"\x5a" * block
                assert pool.read_block(b, shard=shard) == want, (shard, b)
        memsets = [args for name, args in fake.log if name == "cuMemsetD8Async"]
        # Blocks 3 and 4 are adjacent: one memset per plane covers both (2 spans x 4 planes).
        assert len(memsets) == 2 * pool.num_planes * 2
        assert sorted({n for _, n, _ in memsets}) == [pool.run_bytes, 2 * pool.run_bytes]
        # Ordered before the ids are handed out: each device's own stream is synchronised, after
        # its memsets, and the whole device never is.
        syncs = [i for i, (name, _) in enumerate(fake.log) if name == "cuStreamSynchronize"]
        last_memset = max(i for i, (name, _) in enumerate(fake.log) if name == "cuMemsetD8Async")
        assert len(syncs) >= 2 and syncs[0] > last_memset
        assert not any(name == "cuCtxSynchronize" for name, _ in fake.log)
        assert {args for name, args in fake.log if name == "cuStreamSynchronize"} == set(
            fake.streams)
        pool.zero_blocks([])
        with pytest.raises(IndexError):
            pool.zero_blocks([spec.num_blocks])
        with pytest.raises(IndexError):
            pool.read_block(-1)
    finally:
        pool.close()


def test_fake_out_of_device_memory_is_resource_exhausted(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # The second shard's allocation fails: the first one must be released completely.
    drv = FakeDriver(fail={"cuMemCreate": (2, "CUDA_ERROR_OUT_OF_MEMORY")})
    monkeypatch.setattr(cuda_pool, "_driver", lambda: drv)
    with pytest.raises(ResourceExhausted) as info:
        CudaPool(PoolSpec(block_size=16, num_blocks=64, tp_size=2))
    err = info.value
    assert err.reason == "device_memory" and err.field == "pool.num_blocks"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in err.message and "device 1" in err.message
    drv.assert_all_released()


@pytest.mark.parametrize(("call", "nth"), [("cuMemMap", 1), ("cuMemSetAccess", 2),
                                           ("cuMemExportToShareableHandle", 1),
                                           ("cuStreamSynchronize", 1)])
def test_fake_driver_failure_is_failed_precondition_and_cleans_up(
        monkeypatch: pytest.MonkeyPatch, call: str, nth: int) -> None:
    drv = FakeDriver(fail={call: (nth, "CUDA_ERROR_NOT_SUPPORTED")})
    monkeypatch.setattr(cuda_pool, "_driver", lambda: drv)
    with pytest.raises(FailedPrecondition) as info:
        CudaPool(PoolSpec(block_size=16, num_blocks=64, tp_size=2))
    assert info.value.field == "pool.backend"
    assert call in info.value.message and "CUDA_ERROR_NOT_SUPPORTED" in info.value.message
    drv.assert_all_released()


def test_fake_close_is_idempotent_and_final(fake: FakeDriver) -> None:
    pool = CudaPool(SPEC)
    fds = list(pool.fds)
    pool.close()
    pool.close()
    assert not any(fd_is_open(fd) for fd in fds) and pool.fds == []
    fake.assert_all_released()
    with pytest.raises(ValueError, match="closed"):
        pool.zero_blocks([0])


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"num_devices": 0}, "no CUDA device is visible"),
    ({"num_devices": 1}, "only 1 visible"),
    ({"vmm": False}, "virtual memory management"),
    ({"fail": {"cuInit": (0, "CUDA_ERROR_NO_DEVICE")}},
     "cuInit failed: CUDA_ERROR_NO_DEVICE (is a GPU visible to this container?)"),
])
def test_fake_unavailable_reasons(monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any],
                                  words: str) -> None:
    driver = FakeDriver(**kwargs)
    monkeypatch.setattr(cuda_pool, "_driver", lambda: driver)
    spec = PoolSpec(block_size=16, num_blocks=8, tp_size=2)
    reason = cuda_unavailable_reason([0, 1])
    assert reason is not None and words in reason
    with pytest.raises(FailedPrecondition) as info:
        CudaPool(spec)
    assert info.value.field == "pool.backend" and words in info.value.message


def test_fake_driver_library_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = FakeDriver()

    def no_library(flags: int) -> Any:  # what cuda-python 13 does without libcuda.so.1
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via '
                           'system search.')

    drv.cuInit = no_library  # type: ignore[method-assign]
    monkeypatch.setattr(cuda_pool, "_driver", lambda: drv)
    reason = cuda_unavailable_reason()
    assert reason is not None and "could not be loaded" in reason and "NVIDIA driver" in reason


def test_fake_worker_mapping_lives_as_long_as_its_holders() -> None:
    from blockd_client.cuda_view import _ShardMapping

    drv = FakeDriver()
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    try:
        m = _ShardMapping(drv, fd, 1, drv.granularity, drv.granularity, (2, 2, 4, 4, 1, 8), "<f2")
    finally:
        os.close(fd)  # the import does not own the fd
    iface = m.__cuda_array_interface__
    assert iface["data"] == (m.ptr, False) and iface["version"] == 3
    assert iface["shape"] == (2, 2, 4, 4, 1, 8) and iface["typestr"] == "<f2"
    assert m.ptr in drv.maps and [d.location.id for d in drv.access[m.ptr]] == [1]
    assert drv.stack == [] and drv.retained[1] == 1  # popped, but retained while mapped
    holder = [m]  # what torch does: a reference for as long as a tensor's storage lives
    del m
    gc.collect()
    assert drv.maps  # never unmapped under a live tensor
    holder.clear()
    gc.collect()
    drv.assert_all_released()
    # Before unmapping, the worker's own context is synchronised (queued kernels may read it).
    assert [name for name, _ in drv.log] == ["cuCtxSynchronize"]


def test_fake_worker_mapping_failure_cleans_up() -> None:
    from blockd_client.cuda_view import CudaViewError, _ShardMapping

    drv = FakeDriver(fail={"cuMemSetAccess": (1, "CUDA_ERROR_INVALID_DEVICE")})
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    try:
        with pytest.raises(CudaViewError, match="cuMemSetAccess.*CUDA_ERROR_INVALID_DEVICE"):
            _ShardMapping(drv, fd, 0, drv.granularity, drv.granularity, (1,), "<f2")
    finally:
        os.close(fd)
    drv.assert_all_released()


def test_fake_worker_finds_the_daemons_gpus_by_uuid() -> None:
    from blockd_client.cuda_view import _local_devices

    drv = FakeDriver(num_devices=3)  # uuid of ordinal i is (i + 1) repeated
    header = {"devices": [0, 1], "device_uuids": ["03" * 16, "01" * 16]}
    assert _local_devices(drv, header["device_uuids"], [0, 1]) == [2, 0]
    assert _local_devices(drv, (), [0, 1]) == [0, 1]  # no uuids: as sent
    with pytest.raises(RuntimeError, match="shard 1: the daemon's GPU .* is not visible"):
        _local_devices(drv, ["01" * 16, "09" * 16], [0, 1])


# -- GPU: the real driver ---------------------------------------------------------------------

CUDA_REASON = cuda_unavailable_reason()


def _torch_cuda_reason() -> str | None:
    if CUDA_REASON is not None:
        return CUDA_REASON
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (a CPU-only build?)"
    return None


@pytest.fixture
def gpu() -> None:
    reason = _torch_cuda_reason()
    if reason is not None:
        pytest.skip(reason)


def worker_header(pool: CudaPool, page: FencePage, epoch: int = 1
                  ) -> tuple[handle_wire.HandleHeader, list[int]]:
    """What the daemon's handle server sends with the CUDA pool, fds duplicated (the view
    closes the ones it is given)."""
    header, fds = pool.handle(epoch, page.fd)
    return header, [os.dup(fd) for fd in fds]


def pattern(spec: PoolSpec, seed: int) -> Any:
    """One block's K (or V) of one layer: exact in fp16 and bf16 (halves below 128)."""
    import torch

    n = spec.block_size * spec.num_kv_heads * spec.head_dim
    x = ((torch.arange(n, dtype=torch.float32) * 7 + seed) % 251) * 0.5 + 0.5
    return x.reshape(spec.block_size, spec.num_kv_heads, spec.head_dim)


def raw(t: Any) -> bytes:
    import torch

    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return bytes(t.numpy().tobytes())


def run_of(pool: CudaPool, data: bytes, layer: int, kv: int) -> bytes:
    """The (layer, kv) run of a ``read_block`` result."""
    p = 2 * layer + kv
    return data[p * pool.run_bytes:(p + 1) * pool.run_bytes]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gpu_pool_is_zeroed_and_scrubbed() -> None:
    pool = CudaPool(SPEC)
    try:
        assert pool.size % pool.granularity == 0 and pool.size >= SPEC.pool_bytes
        zero = bytes(pool.num_planes * pool.run_bytes)
        assert pool.read_block(0) == zero and pool.read_block(SPEC.num_blocks - 1) == zero
        pool.zero_blocks([1, 2, 40])
        assert pool.read_block(40) == zero
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_view_in_process_is_zero_copy_both_ways(dtype: str) -> None:
    import torch

    from blockd_client.cuda_view import CudaPoolView

    spec = PoolSpec(block_size=16, num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=64,
                    dtype=dtype)
    pool = CudaPool(spec)
    page = FencePage()
    try:
        view = CudaPoolView(*worker_header(pool, page))
        kv = view.kv_pool(0)
        assert kv.shape == (2, 2, 64, 16, 2, 64) and kv.dtype == getattr(torch, dtype)
        assert kv.device == torch.device("cuda", pool.devices[0])
        want = pattern(spec, 1).to(kv.dtype)
        k_cache, v_cache = view.kv_caches(0)[1]
        assert k_cache.data_ptr() == kv[1, 0].data_ptr()  # views, not copies
        k_cache[3].copy_(want.cuda(kv.device))
        torch.cuda.synchronize(kv.device)
        got = pool.read_block(3)
        for layer in (0, 1):
            for k_or_v in (0, 1):
                expect = raw(want) if (layer, k_or_v) == (1, 0) else bytes(pool.run_bytes)
                assert run_of(pool, got, layer, k_or_v) == expect, (layer, k_or_v)
        # The daemon's scrub is visible through the worker's mapping once zero_blocks returns.
        pool.zero_blocks([3])
        assert int(torch.count_nonzero(kv[:, :, 3])) == 0
        view.publish_fence(5)
        assert page.read() == 5
        # close() keeps the memory while a tensor view lives; dropping it unmaps.
        view.close()
        assert view.mapped
        k_cache.add_(0)  # still valid memory
        del kv, k_cache, v_cache, want
        gc.collect()
        assert not view.mapped
    finally:
        page.close()
        pool.close()


CHILD = r"""
import json, os, socket, sys
import torch
from blockd_client.cuda_view import CudaPoolView
from blockd_client.handles import parse_answer

sock = socket.socket(fileno=int(sys.argv[1]))
buf, fds, _, _ = socket.recv_fds(sock, 1 << 16, 16)
header, fds = parse_answer(buf, fds)
view = CudaPoolView(header, fds)
kv = view.kv_pool(0)
n = header.block_size * header.num_kv_heads * header.head_dim
x = ((torch.arange(n, dtype=torch.float32) * 7 + 11) % 251) * 0.5 + 0.5
kv[1, 0, 3].copy_(x.reshape(kv.shape[3:]).to(kv.dtype))     # layer 1, K, block 3
kv[:, :, 8].fill_(1)                                         # every run of block 8
torch.cuda.current_stream(kv.device).synchronize()           # the work is done...
view.publish_fence(7)                                        # ...so publish its fence
print("written", flush=True)
assert sys.stdin.readline().strip() == "zeroed"
print(json.dumps({"block8_nonzero": int(torch.count_nonzero(kv[:, :, 8])),
                  "block3_k": int(torch.count_nonzero(kv[1, 0, 3]))}), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gpu_fd_over_scm_rights_to_another_process() -> None:
    pool = CudaPool(SPEC)
    page = FencePage()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "gpu"), str(ROOT / "clients"),
                      env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(child.fileno())],
                            pass_fds=[child.fileno()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    child.close()
    try:
        # Exactly what the handle server does: one JSON line plus [shard fds..., fence fd].
        header, fds = pool.handle(1, page.fd)
        socket.send_fds(parent, [header.to_json()], fds)
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline().strip()
        assert line == "written", proc.stderr.read() if proc.stderr else line
        assert page.read() == 7
        got = pool.read_block(3)
        import torch

        assert run_of(pool, got, 1, 0) == raw(pattern(SPEC, 11).to(torch.float16))
        assert run_of(pool, got, 0, 0) == bytes(pool.run_bytes)
        one = raw(torch.ones(SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim,
                             dtype=torch.float16))
        assert pool.read_block(8) == one * pool.num_planes
        # Scrub ordering: once zero_blocks returns, the other process reads zeros.
        pool.zero_blocks([8, 3])
        proc.stdin.write("zeroed\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        assert report == {"block8_nonzero": 0, "block3_k": 0}
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        parent.close()
        page.close()
        pool.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gpu_tensor_parallel_shards_share_block_ids() -> None:
    import torch

    from blockd_client.cuda_view import CudaPoolView

    if torch.cuda.device_count() < 2:
        pytest.skip(f"tp_size=2 needs 2 CUDA devices, {torch.cuda.device_count()} visible")
    spec = PoolSpec(block_size=16, num_blocks=32, num_layers=2, num_kv_heads=2, head_dim=64,
                    dtype="float16", tp_size=2)
    pool = CudaPool(spec)
    page = FencePage()
    try:
        assert pool.devices == [0, 1] and len(pool.fds) == 2
        view = CudaPoolView(*worker_header(pool, page))
        assert [view.kv_pool(s).device.index for s in (0, 1)] == [0, 1]
        want = pattern(spec, 3).to(torch.float16)
        view.kv_pool(1)[0, 1, 5].copy_(want.cuda(1))  # shard 1, layer 0, V, block 5
        torch.cuda.synchronize(1)
        assert run_of(pool, pool.read_block(5, shard=1), 0, 1) == raw(want)
        assert pool.read_block(5, shard=0) == bytes(pool.num_planes * pool.run_bytes)
        pool.zero_blocks([5])
        assert pool.read_block(5, shard=1) == bytes(pool.num_planes * pool.run_bytes)
        view.close()
    finally:
        page.close()
        pool.close()
