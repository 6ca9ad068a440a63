"""A kernel launch as data: what runs, on which grid, with which arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange extents must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Launch:
    """``kernel[grid](**args, **constexprs, num_warps=..., num_stages=...)``.

    ``args`` holds the runtime arguments (tensors, ints, floats) in the kernel's parameter order;
    ``aot.signature`` turns the same dict into a compile signature.
    """

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    name: str = field(default="")

    def __call__(self) -> None:
        if min(self.grid) == 0:
            return  # Nothing to do; a zero-size grid is an error on some drivers.
        self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages)
