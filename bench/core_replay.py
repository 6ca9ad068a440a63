"""In-process replay of a synthetic serving trace through blockd's core BlockManager.

Continuous batching, one scheduler iteration per "step": admit waiting requests while they fit
(prefix lookup + allocation), decode one token per running sequence (append, commit of blocks
that filled, with the step's fence), release finished sequences under the step's fence, and
complete the previous step's fence (the GPU finished it).

Writes bench/results/core_replay.json and bench/results/core_replay.png.

Block operations are counted symmetrically: every block that enters a block table (newly
allocated or acquired through a prefix hit) and every block reference that leaves one (release,
copy-on-write). NOTE: this counting rule differs from the peers' (a prefix-hit block entering a
table counts here); no figure of another run or machine appears in this script's ratios. The
same-run baseline is a straightforward object-per-block manager in the style of nano-vllm
(``bench/naive_manager.py``) replaying the same trace in the same process; comparisons with
vLLM's and SGLang's own managers belong in a same-run benchmark of their code (issue 17).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace import Arrivals, Request, make_trace, summary  # noqa: E402

from naive_manager import NaiveBlockManager  # noqa: E402

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = PrefixScope("llama-3-8b", model_revision="main", tokenizer_digest=b"tok-v1")


def replay(trace: list[Request], engine: str, block_size: int, num_blocks: int,
           max_running: int) -> dict[str, object]:
    """Run the trace; returns counts, timings and per-step series."""
    if engine == "blockd":
        m = BlockManager(PoolSpec(block_size=block_size, num_blocks=num_blocks),
                         [TenantPolicy("bench", quota_blocks=num_blocks)], seed=7)
        session = m.open_session("bench")
    else:
        m = NaiveBlockManager(block_size, num_blocks)
        session = "bench"
    prompts = [array("I", r.prompt).tobytes() for r in trace]  # as a server gets packed ids
    outputs = [array("I", [t]).tobytes() for r in trace for t in r.output]
    out_offsets = []
    pos = 0
    for r in trace:
        out_offsets.append(pos)
        pos += len(r.output)
    arrivals = Arrivals(trace)
    running: dict[str, list[int]] = {}  # seq id -> [request index, tokens generated]
    steps = 0
    table_entries = 0
    released = 0
    preempt_waits = 0
    free_series: list[int] = []
    hit_series: list[float] = []

    def admit(i: int) -> bool:
        nonlocal table_entries, preempt_waits
        res = m.admit(session, SCOPE, prompts[i])
        if not hasattr(res, "block_table"):
            preempt_waits += 1
            return False
        table_entries += len(res.block_table)
        # The prompt's K/V is written this step; its full blocks become shareable after it.
        m.commit(session, res.seq_id, fence)
        running[res.seq_id] = [i, 0]
        return True

    t0 = time.perf_counter()
    while arrivals.pending() or running:
        steps += 1
        fence = steps
        if steps > 1:
            m.complete_fence(session, steps - 1)
        arrivals.arrive(steps)
        arrivals.admit(max_running - len(running), admit)
        # Decode: one token per running sequence.
        done = []
        for seq_id, st in running.items():
            i, k = st
            res = m.append(session, seq_id, outputs[out_offsets[i] + k], fence)
            if not hasattr(res, "block_ids"):
                continue  # stalls this step (a real engine would preempt)
            table_entries += len(res.block_ids)
            if res.copy is not None:
                released += 1
            st[1] = k + 1
            if (len(trace[i].prompt) + k + 1) % block_size == 0:
                m.commit(session, seq_id, fence)
            if st[1] == len(trace[i].output):
                done.append(seq_id)
        for seq_id in done:
            i = running.pop(seq_id)[0]
            released += m.release(session, seq_id, fence)
            arrivals.finished[i] = True
        if steps % 16 == 0:
            free_series.append(m.blocks.num_free if engine == "blockd" else m.num_free)
            c = m.counters
            hit_series.append(c.hit_tokens / c.queried_tokens if c.queried_tokens else 0.0)
    elapsed = time.perf_counter() - t0
    c = m.counters
    ops = table_entries + released
    return {
        "engine": engine,
        "seconds": elapsed,
        "steps": steps,
        "requests_per_s": len(trace) / elapsed,
        "block_ops": ops,
        "block_ops_per_s": ops / elapsed,
        "hit_rate_tokens": c.hit_tokens / c.queried_tokens,
        "admission_waits": preempt_waits,
        "evictions": c.evictions,
        "free_series": free_series,
        "hit_series": hit_series,
    }


def time_lookup(block_size: int, prompt_len: int = 1500, repeats: int = 2000
                ) -> dict[str, float]:
    """Median µs of a full-hit prefix lookup (hash + match) of a ~1,500-token prompt."""
    import random

    m = BlockManager(PoolSpec(block_size=block_size, num_blocks=4096),
                     [TenantPolicy("bench", quota_blocks=4096)], seed=11)
    s = m.open_session("bench")
    rng = random.Random(5)
    tokens = [rng.randrange(128_000) for _ in range(prompt_len)]
    raw = array("I", tokens).tobytes()
    r = m.admit(s, SCOPE, raw)
    m.commit(s, r.seq_id)
    assert m.lookup(s, SCOPE, raw) == (prompt_len - 1) // block_size * block_size

    def med(fn) -> float:  # type: ignore[no-untyped-def]
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(repeats // 5):
                fn()
            samples.append((time.perf_counter() - t) / (repeats // 5) * 1e6)
        return statistics.median(samples)

    return {
        "prompt_tokens": prompt_len,
        "blocks": prompt_len // block_size,
        "lookup_us_from_bytes": med(lambda: m.lookup(s, SCOPE, raw)),
        "lookup_us_from_int_list": med(lambda: m.lookup(s, SCOPE, tokens)),
    }


def metadata_bytes(block_size: int, num_blocks: int = 200_000) -> dict[str, float]:
    """tracemalloc: manager bytes per block when fresh, and extra bytes per indexed block."""
    import gc
    import tracemalloc

    per_seq = 64
    prompts = [array("I", range(i * per_seq * block_size, (i + 1) * per_seq * block_size))
               .tobytes() + b"\0\0\0\0" for i in range(num_blocks // (per_seq + 1))]
    seqs: list[str] = []
    gc.collect()
    tracemalloc.start()
    m = BlockManager(PoolSpec(block_size=block_size, num_blocks=num_blocks),
                     [TenantPolicy("bench", quota_blocks=num_blocks)], seed=3)
    fresh, _ = tracemalloc.get_traced_memory()
    s = m.open_session("bench")
    for p in prompts:
        r = m.admit(s, SCOPE, p, cache=False)
        seqs.append(r.seq_id)
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    m2_blocks = 0
    # Index everything: admit with caching, commit, release (blocks stay cached).
    for sid in seqs:
        m.release(s, sid)
    gc.collect()
    base, _ = tracemalloc.get_traced_memory()
    for p in prompts:
        r = m.admit(s, SCOPE, p)
        m2_blocks += m.commit(s, r.seq_id)
        m.release(s, r.seq_id)
    gc.collect()
    indexed, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "num_blocks": num_blocks,
        "fresh_bytes_per_block": fresh / num_blocks,
        "held_bytes_per_block": held / num_blocks,
        "indexed_blocks": m2_blocks,
        "extra_bytes_per_indexed_block": (indexed - base) / max(1, m2_blocks),
    }


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = result["runs"]
    best = {e: max((r for r in runs if r["engine"] == e), key=lambda r: r["block_ops_per_s"])
            for e in ("blockd", "naive")}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    names = ["naive (same run)", "blockd (same run)"]
    values = [result["naive"]["block_ops_per_s_median"],
              result["blockd"]["block_ops_per_s_median"]]
    colors = ["#e08a2c", "#2c7be0"]
    axes[0].barh(names, values, color=colors)
    axes[0].set_xlabel("block operations / s (median)")
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v / 1000:.0f}k"))
    axes[0].set_title("Trace replay throughput")
    for y, v in enumerate(values):
        axes[0].text(v, y, f" {v/1000:.0f}k", va="center")
    b = best["blockd"]
    xs = [16 * (i + 1) for i in range(len(b["free_series"]))]
    axes[1].plot(xs, b["free_series"], color="#2c7be0")
    axes[1].set_xlabel("scheduler step")
    axes[1].set_ylabel("free blocks (never used or evicted)")
    axes[1].set_title("Free blocks over the replay (blockd; the rest is live or cached)")
    axes[2].plot(xs, b["hit_series"], color="#2c7be0", label="blockd")
    axes[2].plot(xs[: len(best["naive"]["hit_series"])], best["naive"]["hit_series"],
                 color="#e08a2c", linestyle="--", label="naive")
    axes[2].set_ylim(0, 1)
    axes[2].set_xlabel("scheduler step")
    axes[2].set_ylabel("cumulative prefix hit rate (tokens)")
    axes[2].legend()
    axes[2].set_title("Prefix hit rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=20_000)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "core_replay.json")
    args = ap.parse_args()

    trace = make_trace(args.requests)
    runs = []
    for _ in range(args.repeats):
        for engine in ("blockd", "naive"):
            runs.append(replay(trace, engine, args.block_size, args.num_blocks,
                               args.max_running))
    result: dict[str, object] = {
        "trace": summary(trace),
        "config": {"block_size": args.block_size, "num_blocks": args.num_blocks,
                   "max_running": args.max_running, "repeats": args.repeats},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "runs": runs,
    }
    for engine in ("blockd", "naive"):
        mine = [r for r in runs if r["engine"] == engine]
        result[engine] = {
            "block_ops_per_s_median": statistics.median(r["block_ops_per_s"] for r in mine),
            "requests_per_s_median": statistics.median(r["requests_per_s"] for r in mine),
            "hit_rate_tokens": mine[0]["hit_rate_tokens"],
            "steps": mine[0]["steps"],
        }
    blockd = result["blockd"]["block_ops_per_s_median"]
    result["ratios"] = {
        "blockd_vs_naive_same_run": blockd / result["naive"]["block_ops_per_s_median"],
    }
    result["lookup"] = time_lookup(args.block_size)
    result["metadata"] = metadata_bytes(args.block_size)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r.pop("free_series_full", None)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    b, n, lk = result["blockd"], result["naive"], result["lookup"]
    print(f"trace: {result['trace']}")
    print(f"blockd: {b['block_ops_per_s_median']:,.0f} block ops/s, "
          f"{b['requests_per_s_median']:,.1f} req/s, hit rate {b['hit_rate_tokens']:.3f}")
    print(f"naive : {n['block_ops_per_s_median']:,.0f} block ops/s, "
          f"{n['requests_per_s_median']:,.1f} req/s, hit rate {n['hit_rate_tokens']:.3f}")
    print("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    print(f"lookup ({lk['prompt_tokens']} tokens, {lk['blocks']} blocks): "
          f"{lk['lookup_us_from_bytes']:.1f} us from bytes, "
          f"{lk['lookup_us_from_int_list']:.1f} us from a list of ints")
    md = result["metadata"]
    print(f"metadata: {md['fresh_bytes_per_block']:.1f} B/block fresh, "
          f"{md['held_bytes_per_block']:.1f} B/block with the pool held by live sequences, "
          f"+{md['extra_bytes_per_indexed_block']:.0f} B per indexed block")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB; wrote {args.out} and "
          f"{args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
