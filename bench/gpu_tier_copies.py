"""On a GPU: how fast the tiers load blocks into the cuda pool, as a fraction of the link's peak.

In one run (``scripts/gpu_check.sh`` runs it when a GPU is there):

* **link peak**: one ``cuMemcpyHtoDAsync`` of ``--megabytes`` from pinned host memory into the
  device, on the daemon pool's own stream, waited for with ``cuStreamSynchronize``; the same the
  other way (``cuMemcpyDtoHAsync``);
* **tier load / spill**: the daemon's ``PoolTierIO`` between a ``CudaPool`` and a pinned
  ``HostTierStore`` (``cuMemHostRegister``), block by block, the slot checked (XXH3) before each
  load, the stream waited for after each copy, exactly as a Step does it.

Reports bytes per second and the ratios tier / peak per repetition (median, min, max); the goal
is a load at 80% or more of the link's peak. Without a usable CUDA device it says so and exits 0
(nothing measured). Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blockd.core.spec import PoolSpec  # noqa: E402
from blockd.pools import cuda as cuda_pool  # noqa: E402
from blockd.runtime.tier_io import PoolTierIO, TierIOStats  # noqa: E402
from blockd.tiers.host import HostTierStore  # noqa: E402

KEY = bytes(range(16))
#: An 8B-class model's block (2 MiB: 16 tokens x K,V x 32 layers x 8 KV heads x 128 x bf16).
LAYOUT = dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def peak(pool: cuda_pool.CudaPool, host: memoryview, to_device: bool) -> float:
    """Bytes per second of one big copy between pinned ``host`` and the pool's first shard."""
    drv = pool._drv
    shard = pool._shards[0]
    n = min(len(host), pool.size)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    with pool._current(shard):
        t0 = time.perf_counter()
        if to_device:
            cuda_pool.check(drv, drv.cuMemcpyHtoDAsync(shard.ptr, ptr, n, shard.stream), "HtoD")
        else:
            cuda_pool.check(drv, drv.cuMemcpyDtoHAsync(ptr, shard.ptr, n, shard.stream), "DtoH")
        cuda_pool.check(drv, drv.cuStreamSynchronize(shard.stream), "sync")
        return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megabytes", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_tiers.json")
    args = ap.parse_args(argv)
    reason = cuda_pool.cuda_unavailable_reason()
    if reason is not None:
        print(f"gpu_tier_copies: no usable CUDA device ({reason}); nothing measured")
        return 0
    probe = PoolSpec(num_blocks=1, **LAYOUT)
    blocks = max(4, args.megabytes * 2**20 // probe.slot_bytes)
    spec = PoolSpec(num_blocks=blocks, **LAYOUT)
    pool = cuda_pool.CudaPool(spec)
    host = HostTierStore(blocks, spec.slot_bytes)
    region = host.host_region()
    assert region is not None
    pinned = pool.register_host(region)
    runs = []
    try:
        io = PoolTierIO(pool, {"host": host}, TierIOStats(), "bench")
        for b in range(blocks):  # every slot written once, so each load has a checked slot
            assert io.spill(b, "host", b, b + 1, KEY)
        for rep in range(args.repeats):
            r = {"repetition": rep, "peak_htod": peak(pool, region, True),
                 "peak_dtoh": peak(pool, region, False)}
            t0 = time.perf_counter()
            for b in range(blocks):
                assert io.load("host", b, b, b + 1, KEY)
            r["tier_load"] = blocks * spec.slot_bytes / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for b in range(blocks):
                assert io.spill(b, "host", b, b + 1, KEY)
            r["tier_spill"] = blocks * spec.slot_bytes / (time.perf_counter() - t0)
            r["load_over_peak"] = r["tier_load"] / r["peak_htod"]
            r["spill_over_peak"] = r["tier_spill"] / r["peak_dtoh"]
            runs.append(r)
            print(f"rep {rep}: load {r['tier_load'] / 1e9:.1f} GB/s = "
                  f"{r['load_over_peak']:.2f} of HtoD peak {r['peak_htod'] / 1e9:.1f} GB/s; spill "
                  f"{r['tier_spill'] / 1e9:.1f} GB/s = {r['spill_over_peak']:.2f} of DtoH peak",
                  flush=True)
    finally:
        if pinned:
            pool.unregister_host(region)
        del region
        host.close()
        pool.close()
    summary = {k: {"median": statistics.median(r[k] for r in runs),
                   "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
               for k in ("load_over_peak", "spill_over_peak", "tier_load", "peak_htod")}
    out = {"layout": LAYOUT, "slot_bytes": spec.slot_bytes, "blocks": blocks,
           "host_pinned": pinned, "goal": "load_over_peak >= 0.8", "summary": summary,
           "runs": runs, "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    s = summary["load_over_peak"]
    print(f"tier load / link peak: {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}] "
          f"(goal 0.80); host memory pinned: {pinned}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
