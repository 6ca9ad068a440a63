"""Which implementation runs a call: the Triton kernel or its torch twin.

``"auto"``: Triton for CUDA tensors, the torch twin for CPU tensors. ``"torch"``: always the twin.
``"triton"``: always the kernel; on CPU tensors that needs Triton's interpreter, which Triton only
uses if ``TRITON_INTERPRET=1`` was in the environment when the kernels were decorated. The
kernels live in ``blockd_gpu._triton`` and are imported on first use, so ``import blockd_gpu``
works without Triton, without a GPU and without the variable.
"""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, device: torch.device) -> bool:
    """Resolve ``backend`` for tensors on ``device``; raises if the choice cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda"
    if device.type == "cuda":
        return True
    from ._triton import kernels_interpreted

    if not kernels_interpreted():
        raise RuntimeError("backend='triton' on CPU tensors needs Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before blockd_gpu's kernels are first used")
    return True
