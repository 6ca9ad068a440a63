"""Every kernel compiles for Hopper (sm_90, H100/H200) on this GPU-less machine.

What is checked, per variant in ``blockd_gpu._triton.aot.variants()`` (dtypes fp32/fp16/bf16,
head dims 64/80/96/128/256, MHA/GQA/MQA, block sizes 8-256, split-K + reduction, prefill,
reshape_and_cache, copy_blocks):

- ``triton.compile(ASTSource(kernel, signature, constexprs, attrs),
  target=GPUTarget("cuda", 90, 32))`` runs every stage: TTIR, TTGIR, LLVM IR, PTX, and a cubin
  from the ptxas bundled with the triton wheel. The signature, constexprs and divisibility
  attributes are derived from the exact launch the public wrapper builds, specialised the way
  Triton's JIT specialises real GPU arguments.
- shared memory fits an H100/H200 block (227 KiB), and the kernel runs with the expected warps.
- ptxas spilled no registers (``cuobjdump -res-usage``: STACK and LOCAL are 0), when the bundled
  cuobjdump is present: a spilling decode kernel would compile but miss the bandwidth target.

Not checked (needs a GPU): that the cubin loads, runs, and how fast.

The compile runs in a subprocess without TRITON_INTERPRET: under the interpreter ``triton.jit``
returns interpreted functions, which cannot be compiled. Compiled kernels land in Triton's cache
(~15 s of CPU on a clean cache, near zero after).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockd_gpu._triton import aot, cache_kernels, decode_kernels, prefill_kernels

VARIANTS = list(aot.variants())
GPU_ROOT = Path(aot.__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GPU_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "blockd_gpu._triton.aot"], env=env,
                          capture_output=True, text=True, timeout=600)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["variant"]] = record
    if not records:
        pytest.fail(f"aot produced no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return records


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_for_sm90(compiled, variant):
    record = compiled.get(variant)
    assert record is not None, f"{variant}: no result"
    assert record["ok"], f"{variant} does not compile for sm_90:\n{record.get('error')}"
    for launch in record["launches"]:
        name = f"{variant}/{launch['kernel']}"
        assert launch["stages"] == ["ttir", "ttgir", "llir", "ptx", "cubin"], name
        assert launch["arch"] == "sm90", name
        assert launch["cubin_bytes"] > 0, name
        assert launch["shared_bytes"] <= aot.HOPPER_MAX_SHARED_BYTES, name
        res = launch["resources"]
        if res is not None:
            assert res.get("stack", 0) == 0 and res.get("local", 0) == 0, (
                f"{name}: ptxas spilled registers: {res}")


def test_every_kernel_has_a_variant():
    """A new @triton.jit kernel without an aot variant would escape the Hopper check."""
    kernels = {name for module in (decode_kernels, prefill_kernels, cache_kernels)
               for name, obj in inspect.getmembers(module)
               if name.endswith("_kernel") and hasattr(obj, "fn")}
    covered = {launch.kernel.__name__ for build in aot.variants().values() for launch in build()}
    assert kernels and kernels <= covered, f"no sm_90 compile variant for {kernels - covered}"
