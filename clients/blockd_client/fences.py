"""Stream-ordered fence publishing: the worker's CUDA stream writes the fence page itself.

A session's fence page (``blockd.wire``: ``FENCE_PAGE_BYTES``, one little-endian u64 slot per
tensor-parallel shard of the pool, at offset ``8 * rank``) is host memory the daemon polls; the
session's fence is the lowest slot. A worker that owns every shard writes every slot; one rank's
worker of a tensor-parallel engine writes its own (``slots``), so a step's blocks count as done
only once every rank published. ``FencePublisher`` writes its slots in one of three ways:

* ``publish(fence)``: now, from the host (the GPU work the fence covers is known to be done, or
  there is none: CPU tensors).
* ``publish_on_stream(fence, stream)``: *enqueued* on a CUDA stream, so the page changes exactly
  when the GPU passes that point and the calling thread never waits. The page is registered
  once as device-mapped host memory (``cuMemHostRegister(DEVICEMAP | PORTABLE)``,
  ``cuMemHostGetDevicePointer``) and the stream does ``cuStreamWriteValue64`` (with its default
  memory barrier: the step's kernels' writes are visible before the fence is). Where 64-bit
  stream memory operations are unavailable (the device attribute says so, the call answers
  ``CUDA_ERROR_NOT_SUPPORTED``, or the page cannot be registered) the stream runs a host
  function instead (``cuLaunchHostFunc``)
  that stores the fence with ``wire.write_fence``; one ctypes thunk serves every launch (the
  fence travels as its ``userData``) and lives as long as the publisher.

Monotonic by construction: a fence not above the highest one already handed over (published
or enqueued) is ignored, so a late or repeated call never lowers the page; writes enqueued on
one stream run in order. A host ``publish`` while a stream write is still queued is refused
(``FenceOrderError``): it would be overwritten later by the lower queued value. A worker using
several streams must publish on the one that orders them (or after joining them into it with
events): a fence written by a stream that did not wait for another stream's kernels would let
the daemon reuse blocks those kernels still read.

``close()`` (before the page is unmapped) waits for queued writes if any are left (a one-off at
detach), then ``cuMemHostUnregister`` and releases the context it retained.

Verified on hardware only by ``tests/pools/test_stream_fence.py``'s gpu tests
(``scripts/gpu_check.sh``); without a GPU the fallback logic runs against a labelled fake
driver there.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable, Sequence
from typing import Any

from blockd import cudadrv, wire

__all__ = ["FenceOrderError", "FencePublisher", "HOST", "HOST_FUNCTION", "IGNORED",
           "STREAM_WRITE"]

log = logging.getLogger("blockd_client.fences")

#: What a publish did (the return value of ``publish`` / ``publish_on_stream``).
HOST = "host"                    # written now, from the host
STREAM_WRITE = "stream_write"    # enqueued: cuStreamWriteValue64
HOST_FUNCTION = "host_function"  # enqueued: cuLaunchHostFunc (fallback)
IGNORED = "ignored"              # not above the highest fence already handed over

_MEM_OPS_ATTRS = ("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
                  "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1")


class FenceOrderError(ValueError):
    """A fence publish that would break the monotonic rule or cannot be ordered."""


class _Registration:
    """The fence page registered with CUDA: a device pointer, the context retained for it."""

    def __init__(self, drv: Any, page: mmap.mmap, device: int) -> None:
        self.drv = drv
        self.device = device
        buf = ctypes.c_char.from_buffer(page)
        self.host_ptr = ctypes.addressof(buf)
        del buf  # release the buffer export: the mmap must stay closable
        where = f"(device {device})"
        cudadrv.check(drv, drv.cuInit(0), "cuInit")
        self.dev = cudadrv.check(drv, drv.cuDeviceGet(device), f"cuDeviceGet({device})")
        self.ctx = cudadrv.check(drv, drv.cuDevicePrimaryCtxRetain(self.dev),
                                 "cuDevicePrimaryCtxRetain" + where)
        self.registered = False
        #: The page's device address (None: not registered; host functions only).
        self.dev_ptr: Any = None
        try:
            with self.current():
                self._register_page(where)
        except BaseException:
            self.close(pending=False)
            raise
        ok = cudadrv.device_attribute(drv, self.dev, _MEM_OPS_ATTRS)
        #: Whether cuStreamWriteValue64 may be used (None: unknown, try it).
        self.stream_writes = self.dev_ptr is not None and (ok is None or bool(ok))

    def _register_page(self, where: str) -> None:
        """Register the page as device-mapped host memory. Where that fails (a runtime that
        cannot pin a shared mapping, say) fences are written by host functions on the stream,
        which need no registration."""
        drv = self.drv
        flags = int(drv.CU_MEMHOSTREGISTER_DEVICEMAP) | int(drv.CU_MEMHOSTREGISTER_PORTABLE)
        try:
            cudadrv.check(drv, drv.cuMemHostRegister(self.host_ptr, wire.FENCE_PAGE_BYTES,
                                                     flags), "cuMemHostRegister" + where)
            self.registered = True
            self.dev_ptr = cudadrv.check(drv, drv.cuMemHostGetDevicePointer(
                self.host_ptr, 0), "cuMemHostGetDevicePointer" + where)
        except cudadrv.CudaCallError as err:
            log.warning("the fence page cannot be mapped for the GPU (%s): fences are written "
                        "by a host function on the stream", err)
            if self.registered:
                cudadrv.logged(drv, drv.cuMemHostUnregister(self.host_ptr),
                               "cuMemHostUnregister" + where, log, "fence page registration")
                self.registered = False
            self.dev_ptr = None

    def current(self) -> _Pushed:
        return _Pushed(self.drv, self.ctx, f"(device {self.device})")

    def close(self, pending: bool) -> None:
        """Unregister (after waiting for queued work when ``pending``); never raises."""
        drv, where = self.drv, f"(device {self.device})"
        what = "fence page teardown"
        pushed = cudadrv.logged(drv, drv.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent" + where,
                                log, what)
        if pending:
            # A write still queued into the page must land before it is unregistered.
            cudadrv.logged(drv, drv.cuCtxSynchronize(), "cuCtxSynchronize" + where, log, what)
        if self.registered:
            cudadrv.logged(drv, drv.cuMemHostUnregister(self.host_ptr),
                           "cuMemHostUnregister" + where, log, what)
            self.registered = False
        if pushed:
            cudadrv.logged(drv, drv.cuCtxPopCurrent(), "cuCtxPopCurrent" + where, log, what)
        cudadrv.logged(drv, drv.cuDevicePrimaryCtxRelease(self.dev),
                       "cuDevicePrimaryCtxRelease" + where, log, what)


class _Pushed:
    """``with``: the retained context current on this thread, popped after."""

    def __init__(self, drv: Any, ctx: Any, where: str) -> None:
        self.drv, self.ctx, self.where = drv, ctx, where

    def __enter__(self) -> None:
        cudadrv.check(self.drv, self.drv.cuCtxPushCurrent(self.ctx),
                      "cuCtxPushCurrent" + self.where)

    def __exit__(self, *exc: object) -> None:
        cudadrv.logged(self.drv, self.drv.cuCtxPopCurrent(), "cuCtxPopCurrent" + self.where,
                       log, "fence publish")


def _stream_parts(drv: Any, stream: Any) -> tuple[Any, int | None]:
    """``(CUstream, device ordinal or None)`` of a torch.cuda.Stream, a CUstream or a raw
    handle (an int)."""
    handle = getattr(stream, "cuda_stream", stream)
    device = getattr(getattr(stream, "device", None), "index", None)
    return drv.CUstream(int(handle)), device


class FencePublisher:
    """Publishes one session's fences into its mapped fence page (see the module docstring)."""

    def __init__(self, page: mmap.mmap, loader: Callable[[], Any] = cudadrv.driver, *,
                 stream_writes: bool = True, slots: Sequence[int] = (0,)) -> None:
        """``page``: the mapped fence page. ``loader``: returns cuda-python's driver module
        (called on the first stream publish only). ``stream_writes`` False: always the host
        function, even where cuStreamWriteValue64 would work. ``slots``: the page's slots this
        publisher writes (its ranks' shards)."""
        self._page = page
        self.slots = tuple(slots)
        if not self.slots or any(not 0 <= r < wire.MAX_FENCE_SLOTS for r in self.slots):
            raise ValueError(f"slots: each in 0..{wire.MAX_FENCE_SLOTS - 1}, at least one; "
                             f"got {list(self.slots)}")
        self._loader = loader
        self._stream_writes = stream_writes
        #: Highest fence handed over (written now, or enqueued on a stream).
        self.highest = self.published
        #: Highest fence enqueued on a stream (0: none).
        self._queued = 0
        self._reg: _Registration | None = None
        self._thunk: Any = None
        self._host_fn: Any = None
        self.closed = False

    @property
    def published(self) -> int:
        """The value in the page now (what the daemon reads; lags ``highest`` while a stream
        write is queued)."""
        return min(wire.read_fence(self._page, r) for r in self.slots)

    @property
    def pending(self) -> bool:
        """Whether a fence enqueued on a stream has not reached the page yet."""
        return self._queued > self.published

    def _accept(self, fence: int) -> bool:
        if self.closed:
            raise ValueError("the fence page is closed (the session detached)")
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
            raise FenceOrderError(f"fence: must be a non-negative int, got {fence!r}")
        return fence > self.highest

    def publish(self, fence: int) -> str:
        """Write ``fence`` now (its GPU work is done). ``IGNORED`` when not above the highest
        fence handed over; ``FenceOrderError`` while a stream write is still queued."""
        if not self._accept(fence):
            return IGNORED
        if self.pending:
            raise FenceOrderError(
                f"fence {fence}: fence {self._queued} is still queued on a CUDA stream and would "
                f"overwrite it; publish {fence} on that stream (publish_on_stream) or after "
                f"synchronizing it")
        for r in self.slots:
            wire.write_fence(self._page, fence, r)
        self.highest = fence
        return HOST

    def publish_on_stream(self, fence: int, stream: Any) -> str:
        """Enqueue the write of ``fence`` on ``stream`` (a torch.cuda.Stream, a CUstream or a
        raw handle); returns at once with ``STREAM_WRITE`` or ``HOST_FUNCTION`` (which
        mechanism), or ``IGNORED`` when ``fence`` is not above the highest handed over."""
        if not self._accept(fence):
            return IGNORED
        drv = self._driver()
        cu_stream, device = _stream_parts(drv, stream)
        reg = self._register(drv, device)
        with reg.current():
            how = HOST_FUNCTION
            if reg.stream_writes and self._write_on_stream(drv, reg, cu_stream, fence):
                how = STREAM_WRITE
            if how == HOST_FUNCTION:
                cudadrv.check(drv, drv.cuLaunchHostFunc(cu_stream, self._host_function(drv),
                                                        fence), "cuLaunchHostFunc")
        self.highest = self._queued = fence
        return how

    def _write_on_stream(self, drv: Any, reg: _Registration, cu_stream: Any, fence: int
                         ) -> bool:
        """One cuStreamWriteValue64 per slot; False when the device cannot (nothing enqueued
        then: the caller falls back to a host function)."""
        flags = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        for i, r in enumerate(self.slots):
            err = drv.cuStreamWriteValue64(cu_stream, int(reg.dev_ptr) + 8 * r, fence, flags)[0]
            if i == 0 and cudadrv.result_name(drv, err) == "CUDA_ERROR_NOT_SUPPORTED":
                log.info("cuStreamWriteValue64 is not supported here: fences are written by "
                         "a host function on the stream")
                reg.stream_writes = False
                return False
            cudadrv.check(drv, (err,), "cuStreamWriteValue64")
        return True

    def _driver(self) -> Any:
        drv, problem = cudadrv.import_problem(self._loader)
        if problem is None:
            problem = cudadrv.init_problem(drv)
        if problem is not None:
            raise RuntimeError(f"publishing a fence on a CUDA stream needs the CUDA driver: "
                               f"{problem}")
        return drv

    def _register(self, drv: Any, device: int | None) -> _Registration:
        if self._reg is None:
            if device is None:
                try:
                    device = int(cudadrv.check(drv, drv.cuCtxGetDevice(), "cuCtxGetDevice"))
                except cudadrv.CudaCallError:
                    device = 0  # no current context: the first device
            self._reg = _Registration(drv, self._page, device)
            self._reg.stream_writes &= self._stream_writes
        return self._reg

    def _host_function(self, drv: Any) -> Any:
        """The one CUhostFn every fallback launch uses (``userData`` is the fence)."""
        if self._host_fn is None:
            page, slots = self._page, self.slots

            def store(fence: int | None) -> None:
                for r in slots:
                    if fence and fence > wire.read_fence(page, r):  # never lower the page
                        wire.write_fence(page, fence, r)

            self._host_fn, self._thunk = cudadrv.host_function(drv, store)
        return self._host_fn

    def close(self) -> None:
        """Wait for queued writes if any, unregister the page; call before unmapping it."""
        if self.closed:
            return
        self.closed = True
        if self._reg is not None:
            self._reg.close(pending=self.pending)
            self._reg = None
        self._thunk = self._host_fn = None
