"""cuda-python's driver module and the checks of what its calls return: one module for the
daemon's CUDA pool (``blockd.pools.cuda``) and the worker's view of it
(``blockd_client.cuda_view``).

cuda-python 13 returns a tuple ``(CUresult, value...)`` from every driver call; ``check`` turns
a failure into an exception naming the call and the CUresult, ``logged`` does the same for
teardown paths that must not raise. Nothing here imports cuda-python at module import:
``cuda.bindings.driver`` imports without a GPU (only ``cuInit`` fails then), but it must not be
loaded at all by a daemon running the host pool.

Pure of the rest of blockd (no core, no grpc): the client library imports it too.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["CudaCallError", "check", "device_attribute", "driver", "host_function",
           "import_problem", "init_problem", "logged", "result_name"]


class CudaCallError(RuntimeError):
    """A CUDA driver call failed. ``call`` is what was called, ``code`` the CUresult's name."""

    def __init__(self, call: str, code: str) -> None:
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code


#: Makes the exception ``check`` raises from (call, CUresult name).
ErrorFactory = Callable[[str, str], Exception]


def driver() -> Any:
    """The ``cuda.bindings.driver`` module. ImportError when cuda-python is not installed;
    RuntimeError or OSError when it is installed but broken (e.g. a version check)."""
    from cuda.bindings import driver as drv

    return drv


def import_problem(loader: Callable[[], Any] = driver) -> tuple[Any, str | None]:
    """``(driver module, None)``, or ``(None, why it cannot be imported)``; never raises."""
    try:
        return loader(), None
    except ImportError as exc:
        return None, f"cuda-python is not installed ({exc}); install the 'gpu' extra"
    except (RuntimeError, OSError) as exc:
        return None, f"cuda-python could not be imported: {exc}"


def init_problem(drv: Any, hint: str = "is a GPU visible to this container?") -> str | None:
    """None once ``cuInit(0)`` succeeded, else why it did not; never raises.

    cuda-python raises (a RuntimeError subclass) when libcuda cannot be loaded at all, and
    returns an error code when the driver loads but finds no usable device.
    """
    try:
        err = drv.cuInit(0)[0]
    except (RuntimeError, OSError) as exc:
        return f"the CUDA driver library could not be loaded: {exc} ({hint})"
    if int(err) != 0:
        return f"cuInit failed: {result_name(drv, err)} ({hint})"
    return None


def result_name(drv: Any, err: Any) -> str:
    """The CUresult's enum name. It needs no driver library, unlike ``cuGetErrorName`` (which
    would fail in exactly the situations being reported)."""
    try:
        return str(drv.CUresult(int(err)).name)
    except (ValueError, TypeError):
        return f"CUresult({err!r})"


def check(drv: Any, result: Any, call: str, error: ErrorFactory = CudaCallError) -> Any:
    """Unpack a cuda-python return tuple ``(CUresult, *values)``; raise ``error(call, name)`` on
    failure. Returns None for calls that return only the CUresult, the value for one, a tuple
    for more."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:  # never seen in cuda-python 13; tolerated so a bare CUresult is still checked
        err, values = result, ()
    if int(err) != 0:  # CUDA_SUCCESS
        raise error(call, result_name(drv, err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def logged(drv: Any, result: Any, call: str, log: logging.Logger, what: str) -> bool:
    """For teardown (finalizers, cleanup after a failure): log a failed call as ``what: ...``
    instead of raising; True when it succeeded."""
    try:
        check(drv, result, call)
    except CudaCallError as exc:
        log.warning("%s: %s", what, exc)
        return False
    return True


#: The C signature of a ``CUhostFn``: ``void fn(void *userData)``.
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def host_function(drv: Any, fn: Callable[[int | None], None]) -> tuple[Any, Any]:
    """``(CUhostFn, keepalive)`` for ``cuLaunchHostFunc``: ``fn`` is called with the launch's
    ``userData`` as an integer (None for 0) on a driver thread, holding the GIL. The caller
    must keep ``keepalive`` (the ctypes thunk) alive until every launch of it has run."""
    thunk = HOST_FN(fn)
    return drv.CUhostFn(ctypes.cast(thunk, ctypes.c_void_p).value), thunk


def device_attribute(drv: Any, dev: Any, names: tuple[str, ...]) -> int | None:
    """The first of the ``CUdevice_attribute`` ``names`` this cuda-python knows, queried for
    ``dev``; None when it knows none of them or the query fails (e.g. an attribute the driver
    is too old for)."""
    for name in names:
        attr = getattr(drv.CUdevice_attribute, name, None)
        if attr is None:
            continue
        try:
            return int(check(drv, drv.cuDeviceGetAttribute(attr, dev),
                             f"cuDeviceGetAttribute({name})"))
        except CudaCallError:
            return None
    return None
