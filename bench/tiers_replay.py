"""Tiered prefix caches on one trace: device pool alone against device pool + host tier.

The trace (``make_tier_trace``): requests made of one of ``--prompts`` shared system prompts,
picked at random, and a unique user message. By default the prompts add up to 4x the device
pool (64 x 16 blocks against 256): an LRU pool of ``--num-blocks`` cannot keep them between
visits, the pool plus a host tier of ``--host-blocks`` (default 4x the pool) can hold them. Note
that SGLang's and vLLM's host tiers are inclusive (what is computed is copied down and stays
there while also on device, unique user messages included), so at 4x they keep less than
pool + tier; ``--prompts 48`` (3x) is a trace they nearly fully serve. The JSON gives the
ceiling: the prompt tokens an unbounded cache would hit on the same trace.

It replays through the one scheduler loop of bench/peers_replay.py (``replay``) with:

* ``blockd``: blockd's core without tiers (bench/peers/blockd_driver.py, ``append_batch``);
* ``SGLang``: SGLang's ``RadixCache``, no host tier (bench/peers/sglang_driver.py);
* ``SGLang HiCache``: SGLang's hierarchical cache, device pool + host pool
  (bench/peers/sglang_hicache_driver.py);
* ``vLLM``: vLLM's ``KVCacheManager`` alone (bench/peers/vllm_driver.py);
* ``vLLM + CPU offload``: the same with vLLM's CPU offloading connector
  (bench/peers/vllm_offload_driver.py);
* with ``--blockd-tiered``: blockd with its host tier, from bench/peers/blockd_tier_driver.py
  (``BlockdTierDriver(trace, block_size, num_blocks, host_blocks)``, the driver interface of
  bench/peers with a ``TierTally``); skipped, with a message, while that module does not exist.

Per engine: the hit rate over prompt tokens from all tiers and from the device pool alone,
tokens served by the host tier, blocks loaded back and stored down, CPU seconds
(``time.process_time`` of the whole replay, with torch on one intra-op thread unless
``--torch-threads`` says otherwise). Repetitions interleave the engines, the order rotating
each time; CPU time is reported as median and spread (the hit counts do not vary).
Counting: bench/peers/tally.py and bench/peers/tier_tally.py.

Writes bench/results/tiers_replay.json and bench/results/tiers_replay.png.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace import Request, summary  # noqa: E402

from peers import sglang_loader  # noqa: E402
from peers_replay import replay  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("blockd", "SGLang", "SGLang HiCache", "vLLM", "vLLM + CPU offload")
BLOCKD_TIERED = "blockd tiered"
TIERED = {"SGLang HiCache", "vLLM + CPU offload", BLOCKD_TIERED}
SGLANG = {"SGLang", "SGLang HiCache"}


def make_tier_trace(num_requests: int = 600, seed: int = 0, num_prompts: int = 64,
                    prompt_tokens: int = 256, user_tokens: tuple[int, int] = (16, 64),
                    output_tokens: tuple[int, int] = (8, 24), arrivals_per_step: float = 0.25,
                    vocab: int = 128_000) -> list[Request]:
    """Requests = one of ``num_prompts`` shared system prompts, picked uniformly at random,
    followed by a unique user message; deterministic for a seed. The prompts come back at
    random distances, so a pool that holds only a few of them keeps missing them."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(num_prompts)]
    out: list[Request] = []
    step = 0.0
    for _ in range(num_requests):
        step += rng.expovariate(arrivals_per_step)
        system = systems[rng.randrange(num_prompts)]
        user = [rng.randrange(vocab) for _ in range(rng.randint(*user_tokens))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(*output_tokens))]
        out.append(Request(int(step), system + user, output, -1))
    return out


def hit_ceiling(trace: list[Request], block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache would hit: for each request, the longest
    block-aligned prefix it shares with any earlier request (the same ids, block by block)."""
    seen: set[int] = set()
    total = 0
    for r in trace:
        h, hit, matching = 0, 0, True
        for b in range(len(r.prompt) // block_size):
            h = hash((h, tuple(r.prompt[b * block_size:(b + 1) * block_size])))
            if matching and h in seen:
                hit += block_size
            else:
                matching = False
            seen.add(h)
        total += hit
    return total


def blockd_tier_available() -> bool:
    return importlib.util.find_spec("peers.blockd_tier_driver") is not None


def make_driver(engine: str, trace: list[Request], args: argparse.Namespace):  # type: ignore[no-untyped-def]
    B, N, M = args.block_size, args.num_blocks, args.host_blocks
    if engine == "blockd":
        from peers.blockd_driver import BlockdDriver

        import blockd

        drv = BlockdDriver(trace, B, N, batch=True)
        drv.name, drv.version = "blockd", blockd.__version__
        return drv
    if engine == "SGLang":
        from peers.sglang_driver import SglangDriver

        return SglangDriver(trace, B, N, args.max_running)
    if engine == "SGLang HiCache":
        from peers.sglang_hicache_driver import SglangHiCacheDriver

        return SglangHiCacheDriver(trace, B, N, M, args.max_running,
                                   write_policy=args.sglang_write_policy)
    if engine == "vLLM":
        from peers.vllm_driver import VllmDriver

        return VllmDriver(trace, B, N)
    if engine == "vLLM + CPU offload":
        from peers.vllm_offload_driver import VllmOffloadDriver

        return VllmOffloadDriver(trace, B, N, M)
    if engine == BLOCKD_TIERED:
        module = importlib.import_module("peers.blockd_tier_driver")
        return module.BlockdTierDriver(trace, B, N, M)
    raise ValueError(engine)


def tier_fields(r: dict[str, object]) -> dict[str, object]:
    """An untiered tally has one tier: its hits are all device hits."""
    r.setdefault("hit_tokens_device", r["hit_tokens"])
    r.setdefault("hit_tokens_host", 0)
    r.setdefault("loaded_blocks", 0)
    r.setdefault("stored_blocks", 0)
    r.setdefault("hit_rate_device", r["hit_rate_tokens"])
    r.setdefault("hit_rate_host", 0.0)
    return r


def spread(xs: list[float]) -> dict[str, object]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def engines_for(args: argparse.Namespace) -> list[str]:
    engines = [e for e in ENGINES if not (args.no_sglang and e in SGLANG)]
    if any(e in SGLANG for e in engines) and not sglang_loader.available():
        raise SystemExit("sglang wheel not found: run bench/peers/fetch_sglang.sh "
                         "(or pass --no-sglang)")
    if args.blockd_tiered:
        if blockd_tier_available():
            engines.append(BLOCKD_TIERED)
        else:
            print("skipping blockd tiered: bench/peers/blockd_tier_driver.py does not exist "
                  "yet (it is to provide BlockdTierDriver(trace, block_size, num_blocks, "
                  "host_blocks))", flush=True)
    return engines


KEYS = ("requests", "tokens", "queried_tokens", "hit_tokens", "hit_tokens_device",
        "hit_tokens_host", "hit_rate_tokens", "hit_rate_device", "hit_rate_host", "hit_blocks",
        "loaded_blocks", "stored_blocks", "allocated", "released", "ops", "stalls", "steps")


def run(args: argparse.Namespace) -> dict[str, object]:
    engines = engines_for(args)
    import torch

    # SGLang's tree and allocator run many tiny tensor ops: with more than one intra-op thread
    # the OpenMP workers add CPU time that depends on the rest of the machine, not the cache.
    torch.set_num_threads(args.torch_threads)
    trace = make_tier_trace(args.requests, args.seed, args.prompts, args.prompt_tokens,
                            tuple(args.user_tokens), tuple(args.output_tokens),
                            args.arrival_rate)
    runs: list[dict[str, object]] = []
    about: dict[str, dict[str, object]] = {}
    for rep in range(args.repeats):
        order = engines[rep % len(engines):] + engines[:rep % len(engines)]
        for engine in order:
            drv = make_driver(engine, trace, args)
            r = tier_fields(replay(trace, drv, args.max_running))
            r["engine"] = engine
            r["repetition"] = rep
            runs.append(r)
            about.setdefault(engine, {
                "driver": type(drv).__module__ + "." + type(drv).__name__,
                "version": getattr(drv, "version", ""),
                **({"write_policy": drv.write_policy} if hasattr(drv, "write_policy") else {}),
                **({"cpu_eviction_policy": drv.eviction_policy}
                   if hasattr(drv, "eviction_policy") else {}),
                **({"tier_counts_tokens": drv.tier_counts()}
                   if hasattr(drv, "tier_counts") else {}),
                **({"deferred_admissions": drv.deferred} if hasattr(drv, "deferred") else {}),
                **({"copy_op_stood_in": drv.copy_op_stood_in}
                   if hasattr(drv, "copy_op_stood_in") else {}),
            })
            del drv
            print(f"rep {rep} {engine:20s} {r['cpu_s']:7.2f} s CPU  hit {r['hit_rate_tokens']:.3f}"
                  f" (device {r['hit_rate_device']:.3f}, host {r['hit_rate_host']:.3f})",
                  flush=True)
    per_engine: dict[str, object] = {}
    for e in engines:
        mine = [r for r in runs if r["engine"] == e]
        first = mine[0]
        for r in mine[1:]:  # the replay is deterministic: only the clock may differ
            for k in KEYS:
                if r[k] != first[k]:
                    raise AssertionError(f"{e}: {k} differs between repetitions")
        per_engine[e] = {"cpu_s": spread([r["cpu_s"] for r in mine]),
                         "cpu_us_per_token": statistics.median(
                             r["cpu_s"] / r["tokens"] * 1e6 for r in mine),
                         **{k: first[k] for k in KEYS}, **about[e]}
    prompt_blocks = args.prompt_tokens // args.block_size
    queried = sum(len(r.prompt) for r in trace)
    ceiling = hit_ceiling(trace, args.block_size)
    return {
        "trace": {**summary(trace), "ceiling_hit_tokens": ceiling,
                  "ceiling_hit_rate": ceiling / queried, "system_prompts": args.prompts,
                  "system_prompt_tokens": args.prompt_tokens,
                  "working_set_blocks": args.prompts * prompt_blocks,
                  "working_set_over_device_pool": args.prompts * prompt_blocks / args.num_blocks,
                  "working_set_over_host_tier": (args.prompts * prompt_blocks / args.host_blocks
                                                 if args.host_blocks else None)},
        "config": {k: getattr(args, k) for k in (
            "requests", "seed", "block_size", "num_blocks", "host_blocks", "max_running",
            "prompts", "prompt_tokens", "user_tokens", "output_tokens", "arrival_rate",
            "repeats", "sglang_write_policy", "torch_threads")},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python_hash_seed": os.environ.get("PYTHONHASHSEED")},
        "stubbed_sglang_modules": sorted(sglang_loader.STUBBED),
        "counting": "hit_rate_tokens: prompt tokens served by any tier / prompt tokens; "
                    "hit_rate_device: by the device pool alone; hit_tokens_host: served by "
                    "the host tier (a load back first); loaded_blocks: host->device copies; "
                    "stored_blocks: device->host copies; hit_blocks include both tiers, so "
                    "released == allocated + hit_blocks",
        "engines_order": engines,
        "engines": per_engine,
        "runs": runs,
    }


COLORS = {"blockd": "#2c7be0", BLOCKD_TIERED: "#0b3d91", "SGLang": "#8fd18f",
          "SGLang HiCache": "#2e8b2e", "vLLM": "#f2b27a", "vLLM + CPU offload": "#c8641c"}


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = result["engines"]
    names = list(engines)
    x = range(len(names))
    colors = [COLORS.get(n, "#888888") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    dev = [engines[n]["hit_rate_device"] for n in names]
    host = [engines[n]["hit_rate_host"] for n in names]
    axes[0].bar(x, dev, color=colors, label="device pool")
    axes[0].bar(x, host, bottom=dev, color=colors, alpha=0.45, hatch="//", label="host tier")
    for i, n in enumerate(names):
        axes[0].text(i, dev[i] + host[i], f"{engines[n]['hit_rate_tokens']:.3f}", ha="center",
                     va="bottom")
    tr = result["trace"]
    axes[0].axhline(tr["ceiling_hit_rate"], color="black", linestyle="--", linewidth=1,
                    label=f"unbounded cache ({tr['ceiling_hit_rate']:.3f})")
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("prefix hit rate over prompt tokens")
    axes[0].set_title(f"Hit rate: device (solid) + host tier (hatched)\nworking set "
                      f"{tr['working_set_over_device_pool']:.1f}x the device pool")
    axes[0].legend(loc="upper left")
    med = [engines[n]["cpu_s"]["median"] for n in names]
    lo = [m - engines[n]["cpu_s"]["min"] for m, n in zip(med, names, strict=True)]
    hi = [engines[n]["cpu_s"]["max"] - m for m, n in zip(med, names, strict=True)]
    axes[1].bar(x, med, yerr=[lo, hi], color=colors, capsize=4)
    axes[1].set_ylabel("CPU seconds per replay (median, min-max)")
    axes[1].set_title(f"CPU time, {result['config']['repeats']} interleaved repetitions")
    width = 0.4
    axes[2].bar([i - width / 2 for i in x], [engines[n]["stored_blocks"] for n in names],
                width, color="#999999", label="stored (device -> host)")
    axes[2].bar([i + width / 2 for i in x], [engines[n]["loaded_blocks"] for n in names],
                width, color="#444444", label="loaded (host -> device)")
    axes[2].set_ylabel("blocks")
    axes[2].set_title("Host-tier traffic")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(list(x), [n.replace(" + ", "\n+ ").replace(" Hi", "\nHi") for n in names],
                      fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=256, help="device pool, in blocks")
    ap.add_argument("--host-blocks", type=int, default=None,
                    help="host tier, in blocks (default: 4 x --num-blocks)")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64,
                    help="distinct shared system prompts (64 x 16 blocks = 4x the default pool)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="tokens per system prompt")
    ap.add_argument("--user-tokens", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    ap.add_argument("--output-tokens", type=int, nargs=2, default=[8, 24],
                    metavar=("LO", "HI"))
    ap.add_argument("--arrival-rate", type=float, default=0.25, help="requests per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sglang-write-policy", default=None,
                    choices=["write_through", "write_through_selective", "write_back"],
                    help="HiCache write policy (default: SGLang's, write_through)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for every engine (see run())")
    ap.add_argument("--no-sglang", action="store_true", help="skip SGLang (no wheel here)")
    ap.add_argument("--blockd-tiered", action="store_true",
                    help="also run bench/peers/blockd_tier_driver.py when it exists")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "tiers_replay.json")
    args = ap.parse_args(argv)
    if args.host_blocks is None:
        args.host_blocks = 4 * args.num_blocks
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(result, args.out.with_suffix(".png"))
    tr = result["trace"]
    print(f"trace: {tr['requests']} requests, {tr['system_prompts']} system prompts x "
          f"{tr['system_prompt_tokens']} tokens = {tr['working_set_blocks']} blocks = "
          f"{tr['working_set_over_device_pool']:.1f}x the device pool "
          f"({args.num_blocks} blocks; host tier {args.host_blocks} blocks); an unbounded "
          f"cache would hit {tr['ceiling_hit_rate']:.3f}")
    print(f"{'engine':20s} {'hit all':>8s} {'device':>8s} {'host tok':>9s} {'loaded':>7s} "
          f"{'stored':>7s} {'stalls':>6s} {'CPU s (median, min-max)':>26s}")
    for e, s in result["engines"].items():
        c = s["cpu_s"]
        print(f"{e:20s} {s['hit_rate_tokens']:8.3f} {s['hit_rate_device']:8.3f} "
              f"{s['hit_tokens_host']:9,d} {s['loaded_blocks']:7,d} {s['stored_blocks']:7,d} "
              f"{s['stalls']:6d} {c['median']:10.2f} ({c['min']:.2f}-{c['max']:.2f})")
    print(f"wrote {args.out}" + ("" if args.no_plot else f" and {args.out.with_suffix('.png')}"))
    return result


if __name__ == "__main__":
    # vLLM walks SchedulerOutput.finished_req_ids, a set of request-id strings, when finished
    # requests refresh the CPU tier's LRU: that order, hence which chunks the tier evicts,
    # follows Python's string hashing, which changes with every process unless pinned (vLLM's
    # engine varies the same way from run to run). Pin it, unless the caller did, so that a
    # run can be repeated exactly.
    if "PYTHONHASHSEED" not in os.environ:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    main()
