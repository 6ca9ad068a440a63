"""Ahead-of-time compile of every kernel for Hopper (sm_90), no GPU needed.

``python -m blockd_gpu._triton.aot`` compiles each variant in ``variants()`` with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` through every stage
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin; the cubin step runs the ``ptxas`` bundled with the
triton wheel), reads each cubin's register/stack use with the bundled ``cuobjdump``, and prints
one JSON object per variant. A variant's launch is built by the same
``*_launch`` function the public wrappers use, on small CPU tensors of the right dtypes, so the
compiled signature (pointer dtypes, int widths, constexprs, warps, stages) is the one that runs.

Must run where ``TRITON_INTERPRET`` is unset: under the interpreter ``triton.jit`` returns an
``InterpretedFunction``, which cannot be compiled.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

from ..decode import plan_decode
from .cache_kernels import copy_blocks_launch, reshape_and_cache_launch
from .decode_kernels import decode_launches
from .launch import Launch
from .prefill_kernels import prefill_launch

# Hopper: CUDA arch 90, warp size 32. Max dynamic shared memory per block on H100/H200: 227 KiB.
HOPPER = ("cuda", 90, 32)
HOPPER_MAX_SHARED_BYTES = 227 * 1024

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _decode(dtype: str, head_dim: int, *, hq: int = 32, hkv: int = 8, block_size: int = 16,
            splits: int = 1) -> Callable[[], list[Launch]]:
    def build() -> list[Launch]:
        dt = _DTYPES[dtype]
        q = torch.empty(2, hq, head_dim, dtype=dt)
        cache = torch.empty(4, block_size, hkv, head_dim, dtype=dt)
        bt = torch.zeros(2, 4, dtype=torch.int32)
        lens = torch.zeros(2, dtype=torch.int32)
        part_out = torch.empty(2, hq, splits, head_dim)
        part_lse = torch.empty(2, hq, splits)
        tile = plan_decode(2, 4096, hq, hkv, head_dim, dtype=dt).tile
        return decode_launches(q, cache, cache, bt, lens, torch.empty_like(q), head_dim ** -0.5,
                               num_splits=splits, partition_size=4 * tile, tile=tile,
                               part_out=part_out, part_lse=part_lse)
    return build


def _prefill(dtype: str, head_dim: int, *, hq: int = 32, hkv: int = 8,
             block_size: int = 16) -> Callable[[], list[Launch]]:
    def build() -> list[Launch]:
        dt = _DTYPES[dtype]
        q = torch.empty(8, hq, head_dim, dtype=dt)
        cache = torch.empty(4, block_size, hkv, head_dim, dtype=dt)
        bt = torch.zeros(2, 4, dtype=torch.int32)
        lens = torch.zeros(2, dtype=torch.int32)
        indptr = torch.zeros(3, dtype=torch.int32)
        return [prefill_launch(q, cache, cache, bt, lens, indptr, torch.empty_like(q),
                               head_dim ** -0.5, max_q_len=8)]
    return build


def _reshape_and_cache(dtype: str, head_dim: int, hkv: int = 8) -> Callable[[], list[Launch]]:
    def build() -> list[Launch]:
        dt = _DTYPES[dtype]
        key = torch.empty(4, hkv, head_dim, dtype=dt)
        cache = torch.empty(4, 16, hkv, head_dim, dtype=dt)
        slots = torch.zeros(4, dtype=torch.int64)
        return [reshape_and_cache_launch(key, key, cache, cache, slots)]
    return build


def _copy_blocks(dtype: str, head_dim: int, hkv: int = 8) -> Callable[[], list[Launch]]:
    def build() -> list[Launch]:
        pool = torch.empty(2, 2, 4, 16, hkv, head_dim, dtype=_DTYPES[dtype])
        return [copy_blocks_launch(pool, torch.zeros(1, 2, dtype=torch.int64))]
    return build


def variants() -> dict[str, Callable[[], list[Launch]]]:
    """Named kernel variants covering the dtypes, head dims, head groupings, block sizes and the
    split-K path that the library supports. Each builds one or more launches."""
    v: dict[str, Callable[[], list[Launch]]] = {}
    for dtype in _DTYPES:
        for hd in (64, 128):
            v[f"decode-{dtype}-d{hd}-gqa4"] = _decode(dtype, hd)
        v[f"decode_split-{dtype}-d128-gqa4"] = _decode(dtype, 128, splits=8)
        v[f"prefill-{dtype}-d128-gqa4"] = _prefill(dtype, 128)
        v[f"reshape_and_cache-{dtype}-d128"] = _reshape_and_cache(dtype, 128)
        v[f"copy_blocks-{dtype}-d128"] = _copy_blocks(dtype, 128)
    v["decode-bf16-d128-mha"] = _decode("bf16", 128, hq=8, hkv=8)
    v["decode-bf16-d128-mqa"] = _decode("bf16", 128, hq=8, hkv=1)
    for hd in (80, 96, 256):
        v[f"decode-bf16-d{hd}-gqa4"] = _decode("bf16", hd)
        v[f"prefill-bf16-d{hd}-gqa4"] = _prefill("bf16", hd)
    v["decode-fp32-d256-gqa4"] = _decode("fp32", 256)
    v["prefill-fp32-d256-gqa4"] = _prefill("fp32", 256)
    for bs in (8, 32, 256):
        v[f"decode-bf16-d128-gqa4-bs{bs}"] = _decode("bf16", 128, block_size=bs)
    return v


def signature(
    launch: Launch,
) -> tuple[dict[str, str], dict[str, object], dict[tuple[int, ...], list[list[object]]]]:
    """The compile signature, constexprs and attributes Triton's JIT would derive for this
    launch on a GPU: each runtime argument's type (``*bf16``, ``i32``/``i64``, ``fp32``), ints
    equal to 1 folded into constexprs, and ``tt.divisibility=16`` on 16-aligned pointers and on
    ints divisible by 16 (without these hints loads are not vectorised and the compiled code
    would not be the code that runs)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    fn = launch.kernel
    sig: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for index, name in enumerate(fn.arg_names):
        if name in launch.constexprs:
            sig[name] = "constexpr"
            constexprs[name] = launch.constexprs[name]
            continue
        if name not in launch.args:
            raise KeyError(f"{launch.name}: kernel parameter {name!r} has no argument")
        value = launch.args[name]
        kind, key = native_specialize_impl(CUDABackend, value, False, True, True)
        sig[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        elif isinstance(key, str) and CUDABackend.parse_attr(key):
            attrs[(index,)] = CUDABackend.parse_attr(key)
    return sig, constexprs, attrs


def compile_launch(launch: Launch, target: tuple[str, int, int] = HOPPER) -> dict[str, object]:
    """Compile one launch to a cubin for ``target``; returns a summary (raises on failure)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(launch.kernel, JITFunction):
        raise RuntimeError("kernels were decorated under TRITON_INTERPRET=1; compile in a "
                           "process without it")
    sig, constexprs, attrs = signature(launch)
    src = ASTSource(fn=launch.kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget(*target),
                              options={"num_warps": launch.num_warps,
                                       "num_stages": launch.num_stages})
    asm = compiled.asm
    return {
        "kernel": launch.name,
        "stages": [s for s in ("ttir", "ttgir", "llir", "ptx", "cubin") if asm.get(s)],
        "arch": getattr(compiled.metadata, "arch", None),
        "cubin_bytes": len(asm.get("cubin", b"")),
        "shared_bytes": int(compiled.metadata.shared),
        "num_warps": int(compiled.metadata.num_warps),
        "num_stages": launch.num_stages,
        "resources": resource_usage(asm.get("cubin", b"")),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """Registers, stack and local memory per thread from ``cuobjdump -res-usage`` (bundled with
    the triton wheel); a non-zero STACK/LOCAL means ptxas spilled registers. None if the tool
    is missing."""
    import os
    import re
    import subprocess
    import tempfile

    from triton import knobs

    try:
        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # no bundled or system cuobjdump
        return None
    if not cubin or not tool or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()} or None


def main(argv: list[str] | None = None) -> int:
    """Compile the named variants (all by default); one JSON line per variant on stdout."""
    names = argv if argv else list(variants())
    table = variants()
    failed = 0
    for name in names:
        record: dict[str, object] = {"variant": name}
        try:
            record["launches"] = [compile_launch(launch) for launch in table[name]()]
            record["ok"] = True
        except Exception as exc:  # reported per variant; the caller decides what fails
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
            failed += 1
        print(json.dumps(record), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
