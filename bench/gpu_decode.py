"""GPU decode benchmark: blockd_gpu's Triton paged decode vs contiguous SDPA on the same K/V.

Times one decode step (32 query heads, 8 KV heads, head_dim 128, bf16, block_size 16, every
sequence at the full context) at 1k/8k/32k context x batch 1/32/128, and reports achieved
memory bandwidth (K/V + block table + q/out bytes / time) as a fraction of the device's peak
HBM bandwidth, next to ``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention
backend) over the same K/V stored contiguously, and ``flash_attn_with_kvcache`` when the
flash-attn package is installed. Target: >= 70% of peak at 8k+ context and within 1.2x of
contiguous attention.

Method: each path is captured in a CUDA graph of ``--iters`` calls and replayed; time per call
= graph time / iters (no Python or launch gaps). Small cases rotate through enough copies of
the data to exceed the L2 cache, so every call reads K/V from HBM. Outputs are checked against
SDPA before timing. Writes ``bench/results/gpu_decode.json``.

Split sweep: for batches up to ``--sweep-max-batch`` (default 4, where ``plan_decode``'s split
heuristic decides most: batch 1 reached only 39-55% of peak on the H200), the paged kernel is
also timed at every split count of ``--sweep-splits`` (each checked against SDPA first), and
each row records the sweep and its fastest split count next to the planner's choice: one GPU
run gives what tuning the planner needs.

    PYTHONPATH=gpu python bench/gpu_decode.py            # exits 0 with a message without a GPU
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "gpu"))  # run from a checkout without installing

import blockd_gpu as bg  # noqa: E402

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
RESULTS = ROOT / "bench" / "results"

# Peak HBM bandwidth, TB/s (vendor datasheets), matched against the device name; first match
# wins, so more specific names come first. Override with --peak-tbps.
PEAK_HBM_TBPS: list[tuple[str, float]] = [
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM5, HBM3
    ("H800", 3.35),
    ("H20", 4.0),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),  # 40 GB
    ("L40S", 0.864),
    ("L4", 0.3),
]
L2_FLUSH_BYTES = 256 << 20  # rotate data copies until each graph touches more than this


def peak_tbps(name: str) -> float | None:
    for key, tbps in PEAK_HBM_TBPS:
        if key.lower() in name.lower():
            return tbps
    return None


class Case:
    """One (context, batch) point: the same K/V as a shuffled paged pool and contiguously."""

    def __init__(self, context: int, batch: int, copies: int, gen: torch.Generator,
                 device: torch.device) -> None:
        self.context, self.batch = context, batch
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = batch * blocks_per_seq
        self.q = torch.randn((batch, NUM_QO_HEADS, HEAD_DIM), generator=gen).to(device, DTYPE)
        self.out = torch.empty_like(self.q)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.paged, self.contiguous, self.tables = [], [], []
        for _ in range(copies):
            # Contiguous K/V [batch, kv_heads, context, head_dim], filled on the device.
            k = torch.randn((batch, NUM_KV_HEADS, context, HEAD_DIM), device=device,
                            dtype=DTYPE)
            v = torch.randn_like(k)
            ids = torch.randperm(num_blocks, generator=gen).to(device)
            shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            k_cache = torch.empty(shape, dtype=DTYPE, device=device)
            v_cache = torch.empty_like(k_cache)
            k_cache[ids] = k.permute(0, 2, 1, 3).reshape(shape)
            v_cache[ids] = v.permute(0, 2, 1, 3).reshape(shape)
            self.paged.append((k_cache, v_cache))
            self.contiguous.append((k, v))
            self.tables.append(ids.view(batch, blocks_per_seq).to(torch.int32))
        self.plan = bg.plan_decode(batch, context, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM,
                                   dtype=DTYPE)
        self.workspace = self.plan.workspace(device)

    @property
    def bytes_per_call(self) -> int:
        kv = 2 * self.batch * self.context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        table = self.batch * (self.context // BLOCK_SIZE) * 4
        q_out = 2 * self.q.numel() * DTYPE.itemsize
        return kv + table + q_out

    def paged_call(self, i: int):
        k_cache, v_cache = self.paged[i]
        return bg.paged_decode_attention(self.q, k_cache, v_cache, self.tables[i], self.seq_lens,
                                         out=self.out, plan=self.plan, workspace=self.workspace,
                                         backend="triton", validate=False)

    def with_plan(self, plan: bg.DecodePlan) -> Case:
        """This case's data under another split plan (the split sweep)."""
        other = copy.copy(self)
        other.plan, other.workspace = plan, plan.workspace(self.q.device)
        return other

    def sdpa_call(self, i: int):
        k, v = self.contiguous[i]
        # The 4 query heads of each KV head as SDPA's query length: no K/V repeat for GQA.
        q = self.q.view(self.batch, NUM_KV_HEADS, NUM_QO_HEADS // NUM_KV_HEADS, HEAD_DIM)
        return F.scaled_dot_product_attention(q, k, v)

    def flash_attn_call(self, i: int):
        from flash_attn import flash_attn_with_kvcache

        k, v = self.contiguous[i]
        # flash-attn wants [batch, seq, heads, dim]; transposed views, not copies.
        return flash_attn_with_kvcache(self.q[:, None], k.transpose(1, 2), v.transpose(1, 2),
                                       cache_seqlens=self.seq_lens)


def sweep_plans(batch: int, context: int, splits: list[int], *,
                num_sms: int | None = None) -> list[bg.DecodePlan]:
    """The plans of the split sweep: one per distinct partition size among ``splits`` (a split
    count whose partitions round to another's is the same kernel launch)."""
    plans: dict[int, bg.DecodePlan] = {}
    for n in sorted(set(splits)):
        if n < 1 or n > max(1, context // 16):
            continue
        plan = bg.plan_decode(batch, context, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM,
                              dtype=DTYPE, num_sms=num_sms, num_splits=n)
        plans.setdefault(plan.partition_size, plan)
    return list(plans.values())


def graph_time_us(call, copies: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` replays of a CUDA graph of ``iters`` calls (rotating copies)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # compile / autotune outside the graph
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    del graph
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--repeats", type=int, default=10, help="graph replays per timing")
    parser.add_argument("--peak-tbps", type=float, default=None, help="override the peak")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_decode.json")
    parser.add_argument("--sweep-splits", type=int, nargs="*",
                        default=[1, 4, 8, 16, 24, 32, 48, 64, 96, 128],
                        help="split counts the sweep times (none: no sweep)")
    parser.add_argument("--sweep-max-batch", type=int, default=4,
                        help="largest batch the split sweep runs at")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device here; nothing to measure (exit 0).")
        return 0

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    peak = args.peak_tbps or peak_tbps(props.name)
    try:
        import flash_attn  # noqa: F401

        have_fa = True
    except ImportError:
        have_fa = False
    print(f"device={props.name} sms={props.multi_processor_count} peak_hbm="
          f"{peak if peak else 'unknown'} TB/s flash_attn={'yes' if have_fa else 'no'}")

    gen = torch.Generator().manual_seed(0)
    results = []
    for context in args.contexts:
        for batch in args.batches:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
            copies = max(1, min(64, math.ceil(L2_FLUSH_BYTES / kv_bytes)))
            case = Case(context, batch, copies, gen, device)
            ref = case.sdpa_call(0).reshape(batch, NUM_QO_HEADS, HEAD_DIM)
            torch.testing.assert_close(case.paged_call(0), ref, atol=1e-2, rtol=1.6e-2)
            row: dict[str, object] = {
                "context": context, "batch": batch, "copies": copies,
                "num_splits": case.plan.num_splits, "partition_size": case.plan.partition_size,
                "bytes_per_call": case.bytes_per_call,
            }
            timings = {"paged": case.paged_call, "sdpa": case.sdpa_call}
            if have_fa:
                timings["flash_attn"] = case.flash_attn_call
            for name, call in timings.items():
                try:
                    us = graph_time_us(call, copies, args.iters, args.repeats)
                except Exception as exc:  # an optional baseline must not sink the run
                    if name == "paged":
                        raise
                    row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                tbps = case.bytes_per_call / us / 1e6
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_tbps"] = round(tbps, 3)
                row[f"{name}_frac_peak"] = round(tbps / peak, 3) if peak else None
            if "sdpa_us" in row:
                row["paged_over_sdpa"] = round(row["paged_us"] / row["sdpa_us"], 3)
            if args.sweep_splits and batch <= args.sweep_max_batch:
                row["sweep"] = sweep(case, ref, args, peak, copies)
                best = min(row["sweep"], key=lambda r: r["us"])
                row["sweep_best_num_splits"] = best["num_splits"]
                row["sweep_best_frac_peak"] = best["frac_peak"]
                print(f"    sweep: best {best['num_splits']} splits ({best['us']}us, "
                      f"{best['frac_peak']} of peak) against the planner's "
                      f"{case.plan.num_splits}", flush=True)
            results.append(row)
            print(f"ctx={context:6d} batch={batch:4d} splits={case.plan.num_splits:3d} "
                  f"paged={row['paged_us']}us ({row['paged_tbps']} TB/s, "
                  f"{row['paged_frac_peak']} of peak) sdpa={row.get('sdpa_us')}us "
                  f"({row.get('sdpa_tbps')} TB/s) paged/sdpa={row.get('paged_over_sdpa')}",
                  flush=True)
            del case
            torch.cuda.empty_cache()

    report = {
        "benchmark": "gpu_decode",
        "device": props.name,
        "peak_hbm_tbps": peak,
        "config": {"dtype": "bfloat16", "num_qo_heads": NUM_QO_HEADS,
                   "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                   "iters_per_graph": args.iters, "graph_replays": args.repeats},
        "versions": {"torch": torch.__version__, "triton": _triton_version()},
        "targets": {"frac_peak_at_8k_plus": 0.7, "max_paged_over_contiguous": 1.2},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def sweep(case: Case, ref: torch.Tensor, args: argparse.Namespace, peak: float | None,
          copies: int) -> list[dict[str, object]]:
    """The paged kernel of ``case`` timed under each plan of the split sweep."""
    out: list[dict[str, object]] = []
    for plan in sweep_plans(case.batch, case.context, args.sweep_splits):
        other = case.with_plan(plan)
        torch.testing.assert_close(other.paged_call(0), ref, atol=1e-2, rtol=1.6e-2)
        us = graph_time_us(other.paged_call, copies, args.iters, args.repeats)
        tbps = case.bytes_per_call / us / 1e6
        out.append({"num_splits": plan.num_splits, "partition_size": plan.partition_size,
                    "us": round(us, 2), "tbps": round(tbps, 3),
                    "frac_peak": round(tbps / peak, 3) if peak else None})
        del other
    return out


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
