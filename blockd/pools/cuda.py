"""The CUDA pool: one CUDA VMM allocation per tensor-parallel shard, shared by file descriptor.

Layout of one shard (documented once in ``blockd_gpu.layout``): a stacked tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype`` on that shard's
device. Unlike the host pool (all shards in one memfd), every shard is its own allocation on its
own device, so a block is ``2 * num_layers`` contiguous runs of
``block_size * num_kv_heads * head_dim`` elements *per shard*; all shards share one block id.

Per shard the daemon does::

    cuMemCreate(size, prop{PINNED, DEVICE dev, requestedHandleTypes=POSIX_FILE_DESCRIPTOR})
    cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)  -> the fd a worker receives (SCM_RIGHTS)
    cuMemAddressReserve + cuMemMap + cuMemSetAccess(READWRITE on dev)   -> the daemon's own view

``size`` is ``spec.pool_bytes`` rounded up to the allocation granularity (the same for every
shard). The daemon maps the memory only to scrub it (``zero_blocks``) and for tests
(``read_block``); it never runs kernels on it. Scrubbing is a ``cuMemsetD8Async`` per
contiguous run on the daemon's own stream of that device, followed by ``cuStreamSynchronize``
of that stream only: the zeros are on the device before the block id is handed out, and the
workers' streams (other processes) are never waited for.

Nothing here imports cuda-python at module import: ``cuda.bindings.driver`` is imported inside
functions, so the daemon imports and runs its host backend on machines without CUDA.
The code paths that need a device are written against cuda-python 13 (every call returns a
tuple ``(CUresult, value...)``) and are verified only on a GPU machine
(``scripts/gpu_check.sh``); without one, ``tests/pools/test_cuda_pool.py`` checks the
unavailable paths and this module's bookkeeping against an in-memory stand-in for the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from blockd import cudadrv, handle_wire
from blockd.core.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from blockd.core.spec import PoolSpec
from blockd.pools.base import Planes, header_for

log = logging.getLogger("blockd.pools.cuda")

FIELD = "pool.backend"


class CudaError(Internal):
    """A CUDA driver call failed. ``call`` is the function, ``code`` the CUresult's name."""

    def __init__(self, call: str, code: str, detail: str = "") -> None:
        msg = f"{call} failed: {code}" + (f" ({detail})" if detail else "")
        super().__init__(msg)
        self.call = call
        self.code = code


def _driver() -> Any:
    """The cuda-python driver module (imported lazily; tests replace this function)."""
    return cudadrv.driver()


def check(drv: Any, result: Any, call: str) -> Any:
    """``cudadrv.check`` raising this module's CudaError (an Internal the server can map)."""
    return cudadrv.check(drv, result, call, CudaError)


def _log_failure(drv: Any, result: Any, call: str) -> bool:
    """For teardown: log a failed call instead of raising; True when it succeeded."""
    return cudadrv.logged(drv, result, call, log, "cuda pool teardown")


def _device_problem(drv: Any, ordinal: int) -> str | None:
    """Why device ``ordinal`` cannot hold a pool shard (None when it can)."""
    dev = check(drv, drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    attr = drv.CUdevice_attribute
    needs = (
        (attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
         "does not support CUDA virtual memory management (cuMemCreate)"),
        (attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
         "cannot export memory as a POSIX file descriptor"),
    )
    for which, what in needs:
        if not check(drv, drv.cuDeviceGetAttribute(which, dev), f"cuDeviceGetAttribute({which})"):
            return f"CUDA device {ordinal} {what}"
    return None


def cuda_unavailable_reason(devices: Sequence[int] | None = None) -> str | None:
    """None when a CUDA pool can be created on ``devices`` (default: device 0), else why not.

    Never raises for a missing package, driver or device: the answer is the message.
    """
    prefix = "cuda pool unavailable: "
    drv, problem = cudadrv.import_problem(_driver)
    if problem is None:
        problem = cudadrv.init_problem(drv)
    if problem is not None:
        return prefix + problem
    try:
        count = check(drv, drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if count < 1:
            return f"{prefix}no CUDA device is visible (is a GPU visible to this container?)"
        wanted = [0] if devices is None else list(devices)
        missing = [d for d in wanted if not 0 <= d < count]
        if missing:
            return (f"{prefix}CUDA device(s) {missing} requested but only {count} visible "
                    f"(ordinals 0..{count - 1})")
        for d in wanted:
            problem = _device_problem(drv, d)
            if problem:
                return prefix + problem
    except CudaError as exc:
        return prefix + exc.message
    except (RuntimeError, OSError) as exc:
        return f"{prefix}the CUDA driver failed: {exc}"
    return None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Shard:
    """One device's allocation as the daemon holds it. Fields are filled as steps succeed, so
    ``CudaPool._release_shard`` undoes exactly what was done, also after a failure half way."""

    __slots__ = ("device", "dev", "ctx", "stream", "handle", "fd", "ptr", "mapped")

    def __init__(self, device: int) -> None:
        self.device = device
        self.dev: Any = None  # the CUdevice of ``device``
        self.ctx: Any = None
        self.stream: Any = None
        self.handle: Any = None
        self.fd = -1
        self.ptr = 0
        self.mapped = False


class CudaPool:
    """A KV pool in device memory, one VMM allocation per shard. Owned by the daemon; workers
    import the exported fds (``clients/blockd_client/cuda_view.py``). A
    ``blockd.pools.base.Pool``."""

    medium = "GPU"
    #: The backend's name in the config and the handle header. The daemon's comparisons with it
    #: are to become ``medium`` comparisons (then only ``handle`` reads it).
    backend = "cuda"

    def __init__(self, spec: PoolSpec, prefault: bool = False,
                 devices: list[int] | None = None) -> None:
        self.spec = spec
        devs = list(range(spec.tp_size)) if devices is None else [int(d) for d in devices]
        if len(devs) != spec.tp_size or len(set(devs)) != len(devs):
            raise InvalidArgument(
                f"devices must list {spec.tp_size} distinct CUDA ordinals (one per tensor-parallel "
                f"shard, pool.tp_size={spec.tp_size}), got {devs}", field="pool.devices")
        self.devices = devs
        reason = cuda_unavailable_reason(devs)
        if reason is not None:
            raise FailedPrecondition(reason, field=FIELD)
        #: The planes of one shard (each shard is its own allocation, unlike the host pool).
        self.planes = Planes.of(spec)
        self.run_bytes = self.planes.run_bytes
        self.plane_bytes = self.planes.plane_bytes
        self.num_planes = self.planes.num_planes
        self._drv = _driver()
        self._shards: list[_Shard] = []
        self._closed = False
        self.granularity = 0
        self.size = 0
        self.device_uuids: list[str] = []
        self.fds: list[int] = []
        try:
            self.granularity = self._granularity()
            #: Bytes of each shard's allocation (what a worker maps).
            self.size = _round_up(self.planes.region_bytes, self.granularity)
            for dev in devs:
                shard = _Shard(dev)
                self._shards.append(shard)
                self._create(shard)
            self.device_uuids = [self._uuid(d) for d in devs]
            # cuMemCreate does not promise zeroed memory, and the host pool starts zeroed
            # (memfd): scrub everything once so a never-used block never leaks old bytes. It also
            # touches every page, which is all ``prefault`` asks of the host pool.
            self._memset_all()
        except CudaError as exc:
            self._release_all()
            raise self._creation_error(exc) from exc
        except BaseException:
            self._release_all()
            raise
        # ``prefault`` needs no action: cuMemCreate commits device memory and the scrub above
        # touched all of it. It is accepted so both backends take the same arguments.
        #: One exported POSIX fd per shard, in ``devices`` order (what workers receive).
        self.fds = [s.fd for s in self._shards]

    # -- creation -------------------------------------------------------------------------------

    def _prop(self, device: int) -> Any:
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = (
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return prop

    def _access(self, device: int) -> Any:
        drv = self._drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _granularity(self) -> int:
        """The recommended granularity, common to every shard's device (their lcm)."""
        drv = self._drv
        g = 1
        for dev in self.devices:
            got = check(drv, drv.cuMemGetAllocationGranularity(
                self._prop(dev),
                drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                f"cuMemGetAllocationGranularity(device {dev})")
            g = math.lcm(g, int(got))
        return g

    def _uuid(self, device: int) -> str:
        drv = self._drv
        dev = check(drv, drv.cuDeviceGet(device), f"cuDeviceGet({device})")
        uuid = check(drv, drv.cuDeviceGetUuid(dev), f"cuDeviceGetUuid(device {device})")
        return bytes(uuid.bytes).hex()

    @contextlib.contextmanager
    def _current(self, shard: _Shard) -> Iterator[None]:
        """Make ``shard``'s device's primary context current on this thread, then restore the
        caller's (push/pop, so whatever context the thread had is untouched)."""
        drv = self._drv
        check(drv, drv.cuCtxPushCurrent(shard.ctx), f"cuCtxPushCurrent(device {shard.device})")
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            popped = drv.cuCtxPopCurrent()
            if failed:  # do not mask the body's error with the pop's
                _log_failure(drv, popped, f"cuCtxPopCurrent(device {shard.device})")
            else:
                check(drv, popped, f"cuCtxPopCurrent(device {shard.device})")

    def _create(self, shard: _Shard) -> None:
        drv = self._drv
        dev_id = shard.device
        shard.dev = check(drv, drv.cuDeviceGet(dev_id), f"cuDeviceGet({dev_id})")
        # The primary context is the one torch and the runtime use; retaining it (instead of
        # creating a context) costs no extra device memory.
        shard.ctx = check(drv, drv.cuDevicePrimaryCtxRetain(shard.dev),
                          f"cuDevicePrimaryCtxRetain(device {dev_id})")
        with self._current(shard):
            # Non-blocking: the scrub stream must not serialise with the legacy default stream.
            shard.stream = check(drv, drv.cuStreamCreate(
                int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)), f"cuStreamCreate(device {dev_id})")
            shard.handle = check(drv, drv.cuMemCreate(self.size, self._prop(dev_id), 0),
                                 f"cuMemCreate({self.size} bytes, device {dev_id})")
            fd = check(drv, drv.cuMemExportToShareableHandle(
                shard.handle,
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                f"cuMemExportToShareableHandle(device {dev_id})")
            shard.fd = int(fd)
            # The driver does not document O_CLOEXEC on exported fds; a child the daemon spawns
            # must not inherit access to the pool.
            os.set_inheritable(shard.fd, False)
            ptr = check(drv, drv.cuMemAddressReserve(self.size, self.granularity, 0, 0),
                        f"cuMemAddressReserve({self.size} bytes, device {dev_id})")
            shard.ptr = int(ptr)
            check(drv, drv.cuMemMap(shard.ptr, self.size, 0, shard.handle, 0),
                  f"cuMemMap(device {dev_id})")
            shard.mapped = True
            check(drv, drv.cuMemSetAccess(shard.ptr, self.size, [self._access(dev_id)], 1),
                  f"cuMemSetAccess(device {dev_id})")

    def _creation_error(self, exc: CudaError) -> Exception:
        spec = self.spec
        if exc.code == "CUDA_ERROR_OUT_OF_MEMORY" and exc.call.startswith("cuMemCreate"):
            return ResourceExhausted(
                f"cannot allocate {self.size} bytes of device memory per shard for the pool "
                f"(pool.num_blocks={spec.num_blocks} x {spec.block_bytes} bytes per block): "
                f"{exc.message}", reason="device_memory", field="pool.num_blocks")
        return FailedPrecondition(f"cuda pool unavailable: {exc.message}", field=FIELD)

    # -- blocks ---------------------------------------------------------------------------------

    def block_runs(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of each contiguous run of ``block``'s bytes within one shard."""
        return self.planes.block_runs(block)

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """Scrub: zero every byte of each block on every shard; returns once the zeros are on
        the devices (each device's own stream synchronised, never the whole device)."""
        self._check_open()
        runs = list(self.planes.zero_runs(blocks))  # adjacent blocks: one memset per plane
        if not runs:
            return
        # Enqueue on every device first, then wait: the shards are scrubbed in parallel.
        self._on_every_shard("cuMemsetD8Async", lambda s: [
            (s.ptr + off, 0, n, s.stream) for off, n in runs])
        self._sync_streams()

    def _memset_all(self) -> None:
        self._on_every_shard("cuMemsetD8Async", lambda s: [(s.ptr, 0, self.size, s.stream)])
        self._sync_streams()

    def _sync_streams(self) -> None:
        self._on_every_shard("cuStreamSynchronize", lambda s: [(s.stream,)])

    def _on_every_shard(self, call: str, args: Callable[[_Shard], list[tuple[Any, ...]]]
                        ) -> None:
        """``drv.<call>(*a)`` for each ``a`` in ``args(shard)``, shard by shard, with that
        shard's context current; raises CudaError naming the call and the device."""
        drv = self._drv
        fn = getattr(drv, call)
        for shard in self._shards:
            with self._current(shard):
                for a in args(shard):
                    check(drv, fn(*a), f"{call}(device {shard.device})")

    def read_block(self, block: int, shard: int = 0) -> bytes:
        """Every byte of a block on one shard, runs concatenated (for tests and diagnostics)."""
        self._check_open()
        runs = self.planes.block_runs(block)
        s = self._shards[shard]
        drv = self._drv
        out = bytearray(self.num_planes * self.run_bytes)
        dst = ctypes.addressof(ctypes.c_char.from_buffer(out))
        with self._current(s):
            # On the daemon's stream, so a read is ordered after any scrub still in flight.
            for i, (off, n) in enumerate(runs):
                check(drv, drv.cuMemcpyDtoHAsync(dst + i * n, s.ptr + off, n, s.stream),
                      f"cuMemcpyDtoHAsync(device {s.device})")
            check(drv, drv.cuStreamSynchronize(s.stream), f"cuStreamSynchronize(device {s.device})")
        return bytes(out)

    # -- the tiers' copies (blockd.runtime.tier_io) -----------------------------------------------

    def copy_out(self, block: int, out: memoryview) -> None:
        """Every byte of ``block`` on every shard into host ``out`` (``spec.slot_bytes``: shard
        by shard, each shard's runs in plane order, as the host pool lays a block out), copied
        on each shard's own stream; returns once those streams passed the copies (the daemon's
        streams only, never the device nor a worker's)."""
        self._copies(block, out, "cuMemcpyDtoHAsync", to_device=False)

    def copy_in(self, block: int, data: memoryview) -> None:
        """Overwrite every byte of ``block`` on every shard with host ``data`` (``copy_out``'s
        layout), on each shard's own stream; returns once the bytes are on the devices."""
        self._copies(block, data, "cuMemcpyHtoDAsync", to_device=True)

    def _copies(self, block: int, host: memoryview, call: str, *, to_device: bool) -> None:
        self._check_open()
        runs = self.planes.block_runs(block)
        if len(host) != len(runs) * self.run_bytes * len(self._shards):
            raise ValueError(f"a block is {len(runs) * self.run_bytes * len(self._shards)} "
                             f"bytes on the host, got {len(host)}")
        base = ctypes.addressof(ctypes.c_char.from_buffer(host))
        per_shard = len(runs) * self.run_bytes
        drv = self._drv
        fn = getattr(drv, call)
        for i, shard in enumerate(self._shards):  # enqueued on every device, then waited for
            with self._current(shard):
                for j, (off, n) in enumerate(runs):
                    hptr, dptr = base + i * per_shard + j * n, shard.ptr + off
                    args = (dptr, hptr) if to_device else (hptr, dptr)
                    check(drv, fn(*args, n, shard.stream), f"{call}(device {shard.device})")
        self._sync_streams()

    def register_host(self, region: memoryview) -> bool:
        """Pin ``region`` (a tier's host memory) for the devices' DMA (``cuMemHostRegister``,
        portable to every context), so its copies run at the link's speed instead of through
        the driver's staging buffer. False (logged; the copies still work, slower) where the
        runtime cannot pin a shared mapping (a sandboxed one, say)."""
        drv = self._drv
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(region))
        flags = drv.CU_MEMHOSTREGISTER_PORTABLE
        with self._current(self._shards[0]):
            return cudadrv.logged(drv, drv.cuMemHostRegister(ptr, len(region), flags),
                                  "cuMemHostRegister", log, "tier memory stays pageable")

    def unregister_host(self, region: memoryview) -> None:
        drv = self._drv
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(region))
        with self._current(self._shards[0]):
            cudadrv.logged(drv, drv.cuMemHostUnregister(ptr), "cuMemHostUnregister", log,
                           "tier memory")

    # -- what workers receive -------------------------------------------------------------------

    def handle(self, epoch: int, fence_fd: int) -> tuple[handle_wire.HandleHeader, list[int]]:
        """The header and ``[shard fds in device order..., fence page fd]`` a worker receives.

        ``devices`` are this daemon's ordinals; ``device_uuids`` identify the same GPUs in a
        worker whose ordinals differ (another container with its own CUDA_VISIBLE_DEVICES).
        """
        self._check_open()
        header = header_for(self.spec, epoch=epoch, backend=self.backend, pool_bytes=self.size,
                            devices=tuple(self.devices), shard_bytes=self.size,
                            granularity=self.granularity,
                            device_uuids=tuple(self.device_uuids))
        return header, [*self.fds, fence_fd]

    # -- teardown -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the CUDA pool is closed")

    def _release_shard(self, shard: _Shard) -> None:
        """Undo whatever of ``_create`` happened, best effort (a failed step is logged and the
        rest still run). Workers that imported the memory keep it: the allocation is freed only
        once every process has unmapped it and released its handle."""
        drv = self._drv
        try:
            if shard.ctx is not None:
                pushed = drv.cuCtxPushCurrent(shard.ctx)
                where = f"(device {shard.device})"
                if shard.stream is not None:  # no scrub may still be writing what we unmap
                    _log_failure(drv, drv.cuStreamSynchronize(shard.stream),
                                 "cuStreamSynchronize" + where)
                if shard.mapped:
                    _log_failure(drv, drv.cuMemUnmap(shard.ptr, self.size), "cuMemUnmap" + where)
                if shard.handle is not None:
                    _log_failure(drv, drv.cuMemRelease(shard.handle), "cuMemRelease" + where)
                if shard.ptr:
                    _log_failure(drv, drv.cuMemAddressFree(shard.ptr, self.size),
                                 "cuMemAddressFree" + where)
                if shard.stream is not None:
                    _log_failure(drv, drv.cuStreamDestroy(shard.stream),
                                 "cuStreamDestroy" + where)
                if _log_failure(drv, pushed, "cuCtxPushCurrent" + where):
                    _log_failure(drv, drv.cuCtxPopCurrent(), "cuCtxPopCurrent" + where)
                _log_failure(drv, drv.cuDevicePrimaryCtxRelease(shard.dev),
                             "cuDevicePrimaryCtxRelease" + where)
        finally:
            shard.stream = shard.handle = shard.ctx = None
            shard.mapped = False
            shard.ptr = 0
            if shard.fd >= 0:
                os.close(shard.fd)
                shard.fd = -1

    def _release_all(self) -> None:
        for shard in reversed(self._shards):
            self._release_shard(shard)

    def close(self) -> None:
        """Unmap, release and free every shard and close the exported fds (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._release_all()
        self.fds = []
