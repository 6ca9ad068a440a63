"""The peers' own block managers next to blockd's core, in one run, on one trace.

vLLM's v1 ``KVCacheManager`` (the installed vllm), SGLang's ``RadixCache`` with its
``PagedTokenToKVPoolAllocator`` (the sglang wheel, ``bench/peers/fetch_sglang.sh``) and
blockd's ``BlockManager`` replay the trace of ``bench/trace.py`` through the same scheduler
loop (``replay`` below): continuous batching, up to ``--max-running`` sequences, a request
admitted when it fits, one output token per running sequence per step, release when its
output is done. Each manager is called as its own scheduler calls it (``bench/peers/``).

Measured: CPU time (``time.process_time``) of each whole replay; repetitions interleave the
managers (the order rotates each repetition) and every ratio is computed within one
repetition, then summarised by median and spread. Counting (``bench/peers/tally.py``): block
operations are blocks newly allocated plus block references released; prefix-hit
acquisitions are reported apart. Nothing here comes from another run.

Writes bench/results/peers_replay.json and bench/results/peers_replay.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace import Arrivals, Request, make_trace, summary  # noqa: E402

from peers import sglang_loader  # noqa: E402
from peers.blockd_driver import BlockdDriver  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("blockd append", "blockd append_batch", "vLLM", "SGLang")
#: (blockd path, peer) pairs whose per-repetition ratio is reported, and their goals.
GOALS = {
    ("blockd append", "vLLM"): 3.0, ("blockd append", "SGLang"): 2.0,
    ("blockd append_batch", "vLLM"): 4.0, ("blockd append_batch", "SGLang"): 2.5,
}


def make_driver(engine: str, trace: list[Request], block_size: int, num_blocks: int,
                max_running: int):  # type: ignore[no-untyped-def]
    if engine.startswith("blockd"):
        return BlockdDriver(trace, block_size, num_blocks, batch=engine.endswith("batch"))
    if engine == "vLLM":
        from peers.vllm_driver import VllmDriver

        return VllmDriver(trace, block_size, num_blocks)
    from peers.sglang_driver import SglangDriver

    return SglangDriver(trace, block_size, num_blocks, max_running)


def replay(trace: list[Request], drv, max_running: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The one scheduler loop every manager runs; returns its tally and CPU seconds."""
    arrivals = Arrivals(trace)
    running: list[int] = []
    admitted: list[int] = []  # this step's

    def admit(i: int) -> bool:
        if not drv.admit(i):
            return False
        admitted.append(i)
        return True

    done_tokens: dict[int, int] = {}
    steps = 0
    gc.collect()
    t0 = time.process_time()
    w0 = time.perf_counter()
    while arrivals.pending() or running:
        steps += 1
        drv.begin_step(steps)
        arrivals.arrive(steps)
        admitted.clear()
        arrivals.admit(max_running - len(running), admit)
        drv.prefill(admitted)
        # Decode: the sequences admitted in earlier steps write one output token each.
        ks = [done_tokens[i] for i in running]
        applied = drv.decode(running, ks)
        still: list[int] = []
        for i, k, ok in zip(running, ks, applied, strict=True):
            if ok:
                k += 1
                done_tokens[i] = k
            if k == len(trace[i].output):
                drv.release(i)
                arrivals.finished[i] = True
                del done_tokens[i]
            else:
                still.append(i)
        for i in admitted:
            done_tokens[i] = 0
        running = still + admitted
    cpu = time.process_time() - t0
    wall = time.perf_counter() - w0
    tally = drv.t.as_dict()
    return {"engine": drv.name, "cpu_s": cpu, "wall_s": wall, "steps": steps, **tally,
            "block_ops_per_cpu_s": tally["ops"] / cpu, "requests_per_cpu_s": len(trace) / cpu}


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "samples": xs}


def run(args: argparse.Namespace) -> dict[str, object]:
    engines = [e for e in ENGINES if e != "SGLang" or not args.no_sglang]
    if "SGLang" in engines and not sglang_loader.available():
        raise SystemExit("sglang wheel not found: run bench/peers/fetch_sglang.sh "
                         "(or pass --no-sglang)")
    trace = make_trace(args.requests, seed=args.seed)
    runs: list[dict[str, object]] = []
    versions: dict[str, str] = {}
    for rep in range(args.repeats):
        order = engines[rep % len(engines):] + engines[:rep % len(engines)]
        for engine in order:
            drv = make_driver(engine, trace, args.block_size, args.num_blocks, args.max_running)
            versions[engine] = getattr(drv, "version", "")
            r = replay(trace, drv, args.max_running)
            r["repetition"] = rep
            runs.append(r)
            del drv
            print(f"rep {rep} {engine:20s} {r['cpu_s']:7.2f} s CPU  "
                  f"{r['block_ops_per_cpu_s']:11,.0f} ops/s  hit {r['hit_rate_tokens']:.3f}",
                  flush=True)
    by = {(r["repetition"], r["engine"]): r for r in runs}
    result: dict[str, object] = {
        "trace": summary(trace),
        "config": {"requests": args.requests, "seed": args.seed, "block_size": args.block_size,
                   "num_blocks": args.num_blocks, "max_running": args.max_running,
                   "repeats": args.repeats},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "versions": {"vllm": versions.get("vLLM", ""), "sglang": versions.get("SGLang", ""),
                     "sglang_stubbed_modules": sorted(sglang_loader.STUBBED)},
        "counting": "block ops = blocks newly allocated + block references released; "
                    "prefix-hit acquisitions in hit_blocks, not in ops",
        "runs": runs,
    }
    per_engine: dict[str, object] = {}
    for e in engines:
        mine = [r for r in runs if r["engine"] == e]
        first = mine[0]
        per_engine[e] = {
            "block_ops_per_cpu_s": spread([r["block_ops_per_cpu_s"] for r in mine]),
            "cpu_s": spread([r["cpu_s"] for r in mine]),
            "cpu_us_per_token": statistics.median(r["cpu_s"] / r["tokens"] * 1e6 for r in mine),
            **{k: first[k] for k in ("ops", "allocated", "released", "hit_blocks",
                                     "hit_tokens", "queried_tokens", "hit_rate_tokens",
                                     "tokens", "requests", "stalls", "steps")},
        }
    result["engines"] = per_engine
    ratios: dict[str, object] = {}
    for (mine, peer), goal in GOALS.items():
        if peer not in engines:
            continue
        ops = [by[(rep, mine)]["block_ops_per_cpu_s"] / by[(rep, peer)]["block_ops_per_cpu_s"]
               for rep in range(args.repeats)]
        cpu = [by[(rep, peer)]["cpu_s"] / by[(rep, mine)]["cpu_s"] for rep in range(args.repeats)]
        ratios[f"{mine} / {peer}"] = {"ops_per_s": spread(ops), "cpu_time": spread(cpu),
                                      "goal": goal,
                                      "meets_goal": statistics.median(ops) >= goal}
    result["ratios"] = ratios
    return result


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = result["engines"]
    names = list(engines)
    colors = {"blockd append": "#7fb0f0", "blockd append_batch": "#2c7be0",
              "vLLM": "#e08a2c", "SGLang": "#5aa55a"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    med = [engines[n]["block_ops_per_cpu_s"]["median"] / 1e3 for n in names]
    ops = [engines[n]["block_ops_per_cpu_s"] for n in names]
    lo = [m - o["min"] / 1e3 for m, o in zip(med, ops, strict=True)]
    hi = [o["max"] / 1e3 - m for m, o in zip(med, ops, strict=True)]
    axes[0].barh(names, med, xerr=[lo, hi], color=[colors[n] for n in names])
    axes[0].set_xlabel("block ops per CPU second (thousands; median, min-max)")
    axes[0].set_title("Same trace, same run, one counting rule")
    for y, v in enumerate(med):
        axes[0].text(v, y, f" {v:,.0f}k", va="bottom")
    ratios = result["ratios"]
    labels = list(ratios)
    for x, lab in enumerate(labels):
        s = ratios[lab]["ops_per_s"]["samples"]
        axes[1].scatter([x] * len(s), s, color="#2c7be0", s=14)
        axes[1].scatter([x], [ratios[lab]["ops_per_s"]["median"]], color="black", marker="_",
                        s=400)
        axes[1].scatter([x], [ratios[lab]["goal"]], color="red", marker="x", s=50)
    axes[1].set_xticks(range(len(labels)), [lab.replace(" / ", "\n/ ") for lab in labels],
                       fontsize=8)
    axes[1].set_ylabel("ratio of block ops/s (per repetition)")
    axes[1].set_title("blockd / peer: dots = repetitions, bar = median, x = goal")
    axes[1].set_ylim(bottom=0)
    axes[2].bar(names, [engines[n]["hit_rate_tokens"] for n in names],
                color=[colors[n] for n in names])
    axes[2].set_ylim(0, 1)
    axes[2].set_ylabel("prefix hit rate (prompt tokens)")
    axes[2].set_title("Hit rate on the trace")
    axes[2].tick_params(axis="x", labelsize=8)
    for x, n in enumerate(names):
        axes[2].text(x, engines[n]["hit_rate_tokens"], f"{engines[n]['hit_rate_tokens']:.3f}",
                     ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=20_000)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-sglang", action="store_true", help="skip SGLang (no wheel here)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "peers_replay.json")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(result, args.out.with_suffix(".png"))
    print(f"trace: {result['trace']}")
    for e, s in result["engines"].items():
        print(f"{e:20s} {s['block_ops_per_cpu_s']['median']:11,.0f} block ops/CPU s "
              f"({s['ops']:,} ops: {s['allocated']:,} allocated + {s['released']:,} released; "
              f"{s['hit_blocks']:,} hit blocks apart)  hit rate {s['hit_rate_tokens']:.3f}  "
              f"{s['cpu_us_per_token']:.2f} us CPU/token")
    for lab, r in result["ratios"].items():
        o, c = r["ops_per_s"], r["cpu_time"]
        print(f"{lab:28s} ops/s ratio {o['median']:.2f}x (min {o['min']:.2f}, max "
              f"{o['max']:.2f}); CPU-time ratio {c['median']:.2f}x; goal {r['goal']}x: "
              f"{'met' if r['meets_goal'] else 'SHORT'}")
    print(f"wrote {args.out}" + ("" if args.no_plot else f" and {args.out.with_suffix('.png')}"))
    return result


if __name__ == "__main__":
    main()
