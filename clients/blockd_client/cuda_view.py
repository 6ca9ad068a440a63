"""CudaPoolView: the daemon's CUDA KV pool imported into this worker, zero-copy, as torch tensors.

The CUDA twin of ``blockd_client.pool.PoolView`` (same public surface). The daemon
(``blockd.pools.cuda.CudaPool``) allocates one CUDA VMM allocation per tensor-parallel shard and
exports each as a POSIX file descriptor; the descriptors reach this process over the daemon's
handle socket (SCM_RIGHTS), so no file name, hostIPC or hostPID is involved.

Descriptor order (what the daemon's handle server must send)::

    fds = [shard 0 fd, shard 1 fd, ..., shard tp_size-1 fd, fence page fd]

Header keys read here: the host header's ``epoch``, ``num_blocks``, ``block_size``,
``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``tp_size``, ``fence_page_bytes``, plus
the CUDA pool's ``CudaPool.header()``: ``backend`` (``"cuda"``), ``devices`` (the daemon's
ordinals, one per shard), ``shard_bytes`` (size of each allocation), ``granularity`` and, when
present, ``device_uuids`` (hex; used to find the same GPUs when this process numbers its devices
differently, e.g. another container with its own CUDA_VISIBLE_DEVICES).

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
import mmap
import os
import struct
import weakref
from typing import Any

log = logging.getLogger("blockd_client.cuda_view")
_U64 = struct.Struct("<Q")

#: KV dtype -> (typestr torch can consume, torch dtype to view it as). bfloat16 has no typestr in
#: the CUDA array interface: it is imported as int16 and reinterpreted (same bytes, no copy).
_TYPESTR: dict[str, tuple[str, str | None]] = {
    "float32": ("<f4", None),
    "float16": ("<f2", None),
    "bfloat16": ("<i2", "bfloat16"),
}

_HOST_KEYS = ("epoch", "num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim",
              "dtype", "tp_size", "fence_page_bytes")
_CUDA_KEYS = ("devices", "shard_bytes", "granularity")


class CudaViewError(RuntimeError):
    """A CUDA driver call failed while importing or mapping the pool."""

    def __init__(self, call: str, code: str) -> None:
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ImportError(f"the CUDA pool needs cuda-python in the worker too "
                          f"(pip install 'cuda-python>=13'): {exc}") from exc
    return driver


def _check(drv: Any, result: Any, call: str) -> Any:
    """Unpack cuda-python's ``(CUresult, *values)``; raise CudaViewError naming the error."""
    err, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if int(err) != 0:
        try:
            name = str(drv.CUresult(int(err)).name)
        except (ValueError, TypeError):
            name = f"CUresult({err!r})"
        raise CudaViewError(call, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _logged(drv: Any, result: Any, call: str) -> bool:
    """For teardown (finalizers must not raise): log a failed call; True when it succeeded."""
    try:
        _check(drv, result, call)
    except CudaViewError as exc:
        log.warning("cuda pool view teardown: %s", exc)
        return False
    return True


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


def _header_error(key: str, why: str) -> ValueError:
    return ValueError(f"pool header {key}: {why}")


def _local_devices(drv: Any, header: dict[str, Any], devices: list[int]) -> list[int]:
    """This process's ordinals of the daemon's shard devices (by UUID when the header has them)."""
    uuids = header.get("device_uuids")
    if not uuids:
        return devices
    if len(uuids) != len(devices):
        raise _header_error("device_uuids", f"expected {len(devices)} entries, got {len(uuids)}")
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


class CudaPoolView:
    """The imported CUDA pool (one mapping per shard) plus this session's fence page."""

    def __init__(self, header: dict[str, Any], fds: list[int]) -> None:
        try:
            self._open(header, fds)
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory; the descriptors are not needed

    @classmethod
    def connect(cls, handle_socket: str, session_id: str) -> CudaPoolView:
        """Fetch a session's header and descriptors from the daemon's handle socket."""
        from blockd_client.pool import fetch_handles

        header, fds = fetch_handles(handle_socket, session_id)
        return cls(header, fds)

    def _open(self, header: dict[str, Any], fds: list[int]) -> None:
        if header.get("backend") != "cuda":
            raise ConnectionError(f"pool backend {header.get('backend')!r} is not 'cuda': use "
                                  f"blockd_client.pool.PoolView for the host pool")
        missing = [k for k in (*_HOST_KEYS, *_CUDA_KEYS) if k not in header]
        if missing:
            raise _header_error(", ".join(missing), "missing")
        tp_size = int(header["tp_size"])
        devices = [int(d) for d in header["devices"]]
        if len(devices) != tp_size:
            raise _header_error("devices", f"expected {tp_size} (tp_size) ordinals, got {devices}")
        if len(fds) != tp_size + 1:
            raise ValueError(f"expected {tp_size + 1} descriptors ({tp_size} shard fds then the "
                             f"fence page fd), got {len(fds)}")
        dtype = str(header["dtype"])
        if dtype not in _TYPESTR:
            raise _header_error("dtype", f"{dtype!r} cannot be viewed as a torch CUDA tensor; "
                                f"supported: {', '.join(_TYPESTR)}")
        import torch

        from blockd_gpu.layout import KvLayout

        self.header = header
        self.epoch = int(header["epoch"])
        self.layout = KvLayout(num_layers=header["num_layers"],
                               num_kv_heads=header["num_kv_heads"], head_dim=header["head_dim"],
                               block_size=header["block_size"], dtype=dtype)
        self.num_blocks = int(header["num_blocks"])
        self.tp_size = tp_size
        shape = tuple(self.layout.pool_shape(self.num_blocks))
        size, granularity = int(header["shard_bytes"]), int(header["granularity"])
        if size < self.layout.pool_bytes(self.num_blocks):
            raise _header_error("shard_bytes", f"{size} is smaller than the layout's "
                                f"{self.layout.pool_bytes(self.num_blocks)} bytes")
        typestr, view_as = _TYPESTR[dtype]

        drv = _driver()
        # torch first: its lazy init creates the primary contexts we then retain and share.
        torch.cuda.init()
        _check(drv, drv.cuInit(0), "cuInit")
        self.devices = _local_devices(drv, header, devices)
        fence_fd = fds[-1]
        self._fence = mmap.mmap(fence_fd, int(header["fence_page_bytes"]), mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        mappings: list[_ShardMapping] = []
        pools: list[Any] = []
        made = 0  # mappings a tensor was made from
        try:
            for fd, dev in zip(fds[:-1], self.devices, strict=True):
                mappings.append(_ShardMapping(drv, fd, dev, size, granularity, shape, typestr))
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
        self._pools: list[Any] | None = pools
        self._map_refs = [weakref.ref(m) for m in mappings]
        del mappings

    def kv_pool(self, shard: int = 0) -> Any:
        """The stacked pool of one shard: ``[num_layers, 2, num_blocks, B, H, D]`` on its GPU."""
        assert self._pools is not None, "CudaPoolView is closed"
        return self._pools[shard]

    def kv_caches(self, shard: int = 0) -> list[tuple[Any, Any]]:
        """Per-layer ``(k_cache, v_cache)`` views, each ``[num_blocks, B, H, D]``."""
        return self.layout.kv_caches(self.kv_pool(shard))

    def publish_fence(self, fence: int) -> None:
        """Tell the daemon that all GPU work up to ``fence`` is done (an 8-byte store). Call it
        only once that work has completed on your stream (e.g. after ``event.synchronize()``)."""
        _U64.pack_into(self._fence, 0, fence)

    @property
    def mapped(self) -> bool:
        """Whether any shard is still mapped (by this view or a tensor that outlived it)."""
        return any(ref() is not None for ref in self._map_refs)

    def close(self) -> None:
        """Drop this view's references; see the module NOTE for when memory is unmapped."""
        if self._pools is None:
            return
        self._pools = None
        self._fence.close()
