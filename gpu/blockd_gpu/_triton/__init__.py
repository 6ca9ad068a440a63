"""Triton kernels and their launch descriptions; imported only when a Triton path runs.

Each kernel module pairs a ``@triton.jit`` kernel with a function that builds its ``Launch``
(grid, arguments, constexprs, warps) from tensors. The public wrappers launch it; ``aot`` compiles
the very same argument lists for Hopper, so the compile check cannot drift from what runs.
"""

from __future__ import annotations


def kernels_interpreted() -> bool:
    """True if the kernels were decorated under ``TRITON_INTERPRET=1`` (they run on the CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    from .decode_kernels import paged_decode_kernel

    return isinstance(paged_decode_kernel, InterpretedFunction)
