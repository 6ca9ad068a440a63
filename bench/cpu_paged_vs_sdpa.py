"""CPU decode: blockd_gpu's paged torch path vs contiguous SDPA on the same K/V.

The price of indirection on the CPU execution path (the reference worker): for each context
length and batch size, time one decode step of ``paged_decode_attention(backend="torch")`` over a
shuffled block table, and ``torch.nn.functional.scaled_dot_product_attention`` over the same
K/V stored contiguously, and report medians and their ratio (paged / contiguous).

Setup: fp32, 32 query heads, 8 KV heads (GQA), head_dim 128, block_size 16, every sequence at the
full context. The contiguous baseline folds the 4 query heads of a KV head into SDPA's query
length, so K/V are not repeated for GQA (the fastest contiguous formulation on CPU; SDPA's
``enable_gqa`` would copy K/V). Writes ``bench/results/cpu_paged_vs_sdpa.{json,png}``.

One torch thread by default: on a small shared machine, multi-threaded runs of the paged path
(many small ops per step) stall whenever another process holds a core and an OpenMP worker is
descheduled, so ratios swing 2-19x from run to run; one thread per path gives reproducible
numbers. ``--threads 0`` uses torch's default to measure scaling on a quiet machine.

    PYTHONPATH=gpu .venv/bin/python bench/cpu_paged_vs_sdpa.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "gpu"))  # run from a checkout without installing

import blockd_gpu as bg  # noqa: E402

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.float32
RESULTS = ROOT / "bench" / "results"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved_ms(fns: dict[str, object], repeats: int) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, alternating between them so that load from other
    processes on a shared machine hits both sides alike; one warm-up call each first."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def run_case(context: int, batch: int, repeats: int, gen: torch.Generator) -> dict[str, object]:
    # Contiguous K/V: [batch, kv_heads, context, head_dim]; random content tiled from 1k tokens
    # (filling gigabytes with randn would dominate the run; values do not affect timing).
    tile = min(context, 1024)
    base_k = torch.randn((1, NUM_KV_HEADS, tile, HEAD_DIM), generator=gen, dtype=DTYPE)
    base_v = torch.randn((1, NUM_KV_HEADS, tile, HEAD_DIM), generator=gen, dtype=DTYPE)
    k = base_k.repeat(batch, 1, context // tile, 1)
    v = base_v.repeat(batch, 1, context // tile, 1)
    q = torch.randn((batch, NUM_QO_HEADS, HEAD_DIM), generator=gen, dtype=DTYPE)

    # The same K/V in a paged pool under a shuffled block table.
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    ids = torch.randperm(num_blocks, generator=gen)
    table = ids.view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.empty((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    k_cache[ids] = k.permute(0, 2, 1, 3).reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache[ids] = v.permute(0, 2, 1, 3).reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    out = torch.empty_like(q)

    group = NUM_QO_HEADS // NUM_KV_HEADS
    q_folded = q.view(batch, NUM_KV_HEADS, group, HEAD_DIM)  # GQA group as query length

    def contiguous():
        return F.scaled_dot_product_attention(q_folded, k, v)

    def paged():
        return bg.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, out=out,
                                         backend="torch", validate=False)

    # Same numbers first, then time.
    torch.testing.assert_close(paged(), contiguous().reshape(batch, NUM_QO_HEADS, HEAD_DIM),
                               atol=1e-4, rtol=1e-4)
    times = interleaved_ms({"paged": paged, "contiguous": contiguous}, repeats)
    paged_ms = statistics.median(times["paged"])
    contiguous_ms = statistics.median(times["contiguous"])
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    return {
        "context": context,
        "batch": batch,
        "repeats": repeats,
        "paged_ms": round(paged_ms, 3),
        "contiguous_ms": round(contiguous_ms, 3),
        "ratio": round(paged_ms / contiguous_ms, 3),
        "paged_min_ms": round(min(times["paged"]), 3),
        "contiguous_min_ms": round(min(times["contiguous"]), 3),
        "kv_mib": round(kv_bytes / 2**20, 1),
        "contiguous_gbps": round(kv_bytes / contiguous_ms / 1e6, 2),
        "paged_gbps": round(kv_bytes / paged_ms / 1e6, 2),
    }


def plot(results: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in results}):
        rows = [r for r in results if r["batch"] == batch]
        ctx = [r["context"] for r in rows]
        ax_t.plot(ctx, [r["paged_ms"] for r in rows], "o-", label=f"paged, batch {batch}")
        ax_t.plot(ctx, [r["contiguous_ms"] for r in rows], "x--",
                  label=f"contiguous SDPA, batch {batch}")
        ax_r.plot(ctx, [r["ratio"] for r in rows], "o-", label=f"batch {batch}")
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("decode step, median ms")
    ax_t.legend(fontsize=7)
    ax_r.axhline(1.0, color="gray", lw=0.8)
    ax_r.set_ylabel("paged / contiguous")
    ax_r.legend(fontsize=8)
    fig.suptitle(f"CPU decode, fp32, {NUM_QO_HEADS}q/{NUM_KV_HEADS}kv heads, d={HEAD_DIM}, "
                 f"block {BLOCK_SIZE}, {torch.get_num_threads()} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed repeats per case (fewer for >1 GiB of K/V)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    gen = torch.Generator().manual_seed(0)
    results = []
    for context in args.contexts:
        for batch in args.batches:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
            repeats = args.repeats if kv_bytes < 2**30 else max(3, args.repeats // 3)
            row = run_case(context, batch, repeats, gen)
            results.append(row)
            print(f"context={context:6d} batch={batch:3d} paged={row['paged_ms']:9.2f}ms "
                  f"contiguous={row['contiguous_ms']:9.2f}ms ratio={row['ratio']:.2f}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "cpu_paged_vs_sdpa",
        "config": {
            "dtype": "float32", "num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
            "paged": "blockd_gpu.paged_decode_attention(backend='torch'), shuffled blocks",
            "contiguous": "F.scaled_dot_product_attention, GQA folded into query length",
            "statistic": "median ms of interleaved timed repeats after one warm-up each",
        },
        "machine": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            # Other processes on a shared machine skew timings; recorded so readers can judge.
            "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "results": results,
    }
    (args.out / "cpu_paged_vs_sdpa.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out / "cpu_paged_vs_sdpa.png")
    print(f"wrote {args.out / 'cpu_paged_vs_sdpa.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
