"""CudaPoolView: the daemon's CUDA KV pool imported into this worker, zero-copy, as torch tensors.

The CUDA twin of ``blockd_client.pool.PoolView`` (same public surface). The daemon
(``blockd.pools.cuda.CudaPool``) allocates one CUDA VMM allocation per tensor-parallel shard and
exports each as a POSIX file descriptor; the descriptors reach this process over the daemon's
handle socket (SCM_RIGHTS), so no file name, hostIPC or hostPID is involved.

The header (``blockd.handle_wire.HandleHeader``, parsed and checked by ``blockd_client.handles``)
carries the layout plus the cuda fields: ``devices`` (the daemon's ordinals, one per shard),
``shard_bytes`` (size of each allocation), ``granularity`` and, when present, ``device_uuids``
(hex; used to find the same GPUs when this process numbers its devices differently, e.g.
another container with its own CUDA_VISIBLE_DEVICES). Descriptor order
(``HandleHeader.split_fds``)::

    fds = [shard 0 fd, shard 1 fd, ..., shard tp_size-1 fd, fence page fd]

Per shard: ``cuMemImportFromShareableHandle`` -> ``cuMemAddressReserve`` -> ``cuMemMap`` ->
``cuMemSetAccess`` (read-write for that device), all with the device's primary context (the one
torch uses) pushed current; then ``torch.as_tensor`` of an object exposing
``__cuda_array_interface__`` (no copy: checked through ``data_ptr``). ``kv_pool[shard]`` is
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` on ``cuda:<device>``.

The fence page is the same host memfd page as with the host pool: write a fence only after the
GPU work it covers has completed on *your* stream (``event.synchronize()``, or a thread polling
``event.query()``); the daemon polls the page and never synchronises any device.

NOTE: the mapping is never unmapped under a live tensor. torch keeps a reference to the object
whose ``__cuda_array_interface__`` it consumed for as long as the tensor's storage lives (every
view shares that storage), and the unmap is a ``weakref.finalize`` of that object. ``close()``
therefore only drops this view's references; the memory is unmapped when the last tensor view is
garbage-collected (``mapped`` tells). Before unmapping, the finalizer synchronises the worker's
context: torch frees a storage without waiting for kernels still queued on it.

Verified on hardware only by ``tests/pools/test_cuda_pool.py`` on a GPU machine
(``scripts/gpu_check.sh``); without a GPU only the header/fd checks run.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

from blockd import cudadrv, handle_wire
from blockd_client.handles import fetch_handles
from blockd_client.views import MappedPool

log = logging.getLogger("blockd_client.cuda_view")

#: KV dtype -> (typestr torch can consume, torch dtype to view it as). bfloat16 has no typestr in
#: the CUDA array interface: it is imported as int16 and reinterpreted (same bytes, no copy).
_TYPESTR: dict[str, tuple[str, str | None]] = {
    "float32": ("<f4", None),
    "float16": ("<f2", None),
    "bfloat16": ("<i2", "bfloat16"),
}


class CudaViewError(RuntimeError):
    """A CUDA driver call failed while importing or mapping the pool."""

    def __init__(self, call: str, code: str) -> None:
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code


def _driver() -> Any:
    try:
        return cudadrv.driver()
    except ImportError as exc:
        raise ImportError(f"the CUDA pool needs cuda-python in the worker too "
                          f"(pip install 'cuda-python>=13'): {exc}") from exc


def _check(drv: Any, result: Any, call: str) -> Any:
    """``cudadrv.check`` raising CudaViewError naming the call and the CUresult."""
    return cudadrv.check(drv, result, call, CudaViewError)


def _logged(drv: Any, result: Any, call: str) -> bool:
    """For teardown (finalizers must not raise): log a failed call; True when it succeeded."""
    return cudadrv.logged(drv, result, call, log, "cuda pool view teardown")


def _unmap(drv: Any, device: int, dev: Any, ctx: Any, ptr: int, size: int, handle: Any,
           mapped: bool) -> None:
    """Undo one shard's import (the finalizer; also the cleanup of a half-done import)."""
    where = f"(device {device})"
    pushed = _logged(drv, drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent" + where)
    if mapped:
        # A kernel of this process may still be queued on the range (torch frees a storage
        # without waiting for its streams). This is a one-off, at teardown, in the worker only.
        _logged(drv, drv.cuCtxSynchronize(), "cuCtxSynchronize" + where)
        _logged(drv, drv.cuMemUnmap(ptr, size), "cuMemUnmap" + where)
    if handle is not None:
        _logged(drv, drv.cuMemRelease(handle), "cuMemRelease" + where)
    if ptr:
        _logged(drv, drv.cuMemAddressFree(ptr, size), "cuMemAddressFree" + where)
    if pushed:
        _logged(drv, drv.cuCtxPopCurrent(), "cuCtxPopCurrent" + where)
    _logged(drv, drv.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease" + where)


class _ShardMapping:
    """One imported shard mapped into this process. torch consumes it through
    ``__cuda_array_interface__`` and holds it while any tensor view exists; collecting it
    unmaps the memory (``weakref.finalize``), so it is never unmapped under a live tensor."""

    def __init__(self, drv: Any, fd: int, device: int, size: int, granularity: int,
                 shape: tuple[int, ...], typestr: str) -> None:
        self.device = device
        self.size = size
        self.shape = shape
        self.typestr = typestr
        where = f"(device {device})"
        dev = _check(drv, drv.cuDeviceGet(device), f"cuDeviceGet({device})")
        # The primary context is the one torch uses, so the mapping and torch's kernels share
        # one context; retained until the finalizer releases it.
        ctx = _check(drv, drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain" + where)
        handle: Any = None
        ptr = 0
        mapped = False
        try:
            _check(drv, drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent" + where)
            try:
                # The import does not take ownership of ``fd`` (the caller closes it).
                handle = _check(drv, drv.cuMemImportFromShareableHandle(
                    fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    "cuMemImportFromShareableHandle" + where)
                ptr = int(_check(drv, drv.cuMemAddressReserve(size, granularity, 0, 0),
                                 f"cuMemAddressReserve({size} bytes) {where}"))
                _check(drv, drv.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap" + where)
                mapped = True
                desc = drv.CUmemAccessDesc()
                desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = device
                desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _check(drv, drv.cuMemSetAccess(ptr, size, [desc], 1), "cuMemSetAccess" + where)
            except BaseException:
                _logged(drv, drv.cuCtxPopCurrent(), "cuCtxPopCurrent" + where)  # keep the error
                raise
            _check(drv, drv.cuCtxPopCurrent(), "cuCtxPopCurrent" + where)
        except BaseException:
            _unmap(drv, device, dev, ctx, ptr, size, handle, mapped)
            raise
        self.ptr = ptr
        self._finalizer = weakref.finalize(self, _unmap, drv, device, dev, ctx, ptr, size,
                                           handle, mapped)
        # At interpreter exit tensors may still be alive; process teardown frees the mapping.
        self._finalizer.atexit = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # stream None: no work of any stream is pending on this memory from the producer's side
        # (the daemon synchronises its scrub stream before it hands a block out).
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": None}

    def release_unused(self) -> None:
        """Unmap now; only for a mapping no tensor was ever made from."""
        self._finalizer()


def _local_devices(drv: Any, uuids: Sequence[str], devices: list[int]) -> list[int]:
    """This process's ordinals of the daemon's shard devices (by UUID when the header has them:
    ``uuids`` empty means "the same ordinals")."""
    if not uuids:
        return devices
    count = _check(drv, drv.cuDeviceGetCount(), "cuDeviceGetCount")
    local: dict[str, int] = {}
    for ordinal in range(count):
        dev = _check(drv, drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        uuid = _check(drv, drv.cuDeviceGetUuid(dev), f"cuDeviceGetUuid(device {ordinal})")
        local[bytes(uuid.bytes).hex()] = ordinal
    out = []
    for shard, uuid in enumerate(uuids):
        if uuid not in local:
            raise RuntimeError(
                f"shard {shard}: the daemon's GPU {uuid} (its device {devices[shard]}) is not "
                f"visible to this process ({count} visible); the worker and the daemon must see "
                f"the same GPUs")
        out.append(local[uuid])
    return out


class CudaPoolView(MappedPool):
    """The imported CUDA pool (one mapping per shard) plus this session's fence page."""

    def __init__(self, header: handle_wire.HandleHeader, fds: list[int]) -> None:
        """Import and map every shard (closes the fds: the mappings keep the memory)."""
        try:
            self._open(header, fds)
        finally:
            for fd in fds:
                os.close(fd)

    @classmethod
    def connect(cls, handle_socket: str, session_id: str, fetch_secret: str) -> CudaPoolView:
        """Fetch a session's header and descriptors from the daemon's handle socket
        (``fetch_secret``: the session's AttachResponse's)."""
        header, fds = fetch_handles(handle_socket, session_id, fetch_secret)
        return cls(header, fds)

    def _open(self, header: handle_wire.HandleHeader, fds: list[int]) -> None:
        if header.backend != "cuda":
            raise ConnectionError(f"pool backend {header.backend!r} is not 'cuda': use "
                                  f"blockd_client.pool.PoolView for the host pool")
        shard_fds, fence_fd = header.split_fds(fds)
        if header.dtype not in _TYPESTR:
            raise ValueError(f"dtype: {header.dtype!r} cannot be viewed as a torch CUDA tensor; "
                             f"supported: {', '.join(_TYPESTR)}")
        import torch

        typestr, view_as = _TYPESTR[header.dtype]
        drv = _driver()
        # torch first: its lazy init creates the primary contexts we then retain and share.
        torch.cuda.init()
        _check(drv, drv.cuInit(0), "cuInit")
        self.devices = _local_devices(drv, header.device_uuids, list(header.devices))
        self._adopt(header, fence_fd)
        shape = tuple(self.layout.pool_shape(self.num_blocks))
        mappings: list[_ShardMapping] = []
        pools: list[Any] = []
        made = 0  # mappings a tensor was made from
        try:
            for fd, dev in zip(shard_fds, self.devices, strict=True):
                mappings.append(_ShardMapping(drv, fd, dev, header.shard_bytes,
                                              header.granularity, shape, typestr))
            for m in mappings:
                t = torch.as_tensor(m, device=f"cuda:{m.device}")
                made += 1
                if t.data_ptr() != m.ptr:
                    raise RuntimeError(f"torch copied the pool of device {m.device} instead of "
                                       f"viewing it (data_ptr {t.data_ptr():#x} != {m.ptr:#x})")
                pools.append(t.view(getattr(torch, view_as)) if view_as else t)
        except BaseException:
            # Mappings no tensor was made from are unmapped now; the others when their tensors
            # (locals of this frame) are collected.
            for m in mappings[made:]:
                m.release_unused()
            self._fence.close()
            raise
        self._pools = pools
        # torch holds each mapping for as long as a tensor's storage lives (module NOTE).
        self._map_refs = [weakref.ref(m) for m in mappings]
        del mappings
