"""Full-hit prefix lookup of a 1,500-token prompt: blockd's core next to SGLang's RadixCache.

Issue 17's goal: blockd's full-hit lookup no slower than SGLang's ``match_prefix`` with its key
prebuilt. Both run in one process on the same prompt (block/page size 16, 93 full blocks), in
two shapes:

* ``one piece``: the prompt was cached at once. blockd's 93 blocks are consecutive ids (one run
  of its chain verification); SGLang's tree holds it in one node.
* ``7 pieces``: the prompt was cached in 7 growing turns, as multi-turn traffic caches it.
  blockd's chain is 7 runs of block ids (what ``bench/peers_replay.py``'s trace gives: 7.1 runs
  of ~11 blocks per verified hit); SGLang's path is 7 nodes.

Timed: blockd ``BlockManager.lookup`` from packed uint32 bytes (what the server has) and from a
list of ints; SGLang ``RadixCache.match_prefix(MatchPrefixParams(key))`` with the ``RadixKey``
built before the clock starts, and with it built from a list per call. CPU time per call
(``time.process_time`` over a batch), repetitions interleaved (the order rotates), every ratio
computed within one repetition; medians and spread. No figure from another run.

    python bench/lookup_peers.py      # writes bench/results/lookup_peers.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from peers import sglang_loader  # noqa: E402

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = PrefixScope("llama-3-8b", model_revision="main", tokenizer_digest=b"tok-v1")
B = 16


def pieces(n_blocks: int, k: int) -> list[int]:
    """Block counts of ``k`` growing turns ending at ``n_blocks``."""
    return [n_blocks * (i + 1) // k for i in range(k)]


def blockd_setup(tokens: list[int], k: int):  # type: ignore[no-untyped-def]
    """A manager whose index holds the prompt, cached in ``k`` turns; returns its lookup."""
    m = BlockManager(PoolSpec(block_size=B, num_blocks=4096),
                     [TenantPolicy("bench", quota_blocks=4096)], seed=11)
    s = m.open_session("bench")
    n_blocks = (len(tokens) - 1) // B
    for upto in pieces(n_blocks, k):
        # The turn's sequence stays alive: its partial last block sits between this turn's
        # blocks and the next turn's, so the chain has one run per turn.
        r = m.admit(s, SCOPE, array("I", tokens[:upto * B + 1]).tobytes())
        m.commit(s, r.seq_id)
    raw = array("I", tokens).tobytes()
    assert m.lookup(s, SCOPE, raw) == n_blocks * B
    return (lambda: m.lookup(s, SCOPE, raw)), (lambda: m.lookup(s, SCOPE, tokens))


def sglang_setup(sg, tokens: list[int], k: int):  # type: ignore[no-untyped-def]
    import torch

    alloc = sg.PagedTokenToKVPoolAllocator(4096 * B, B, torch.int64, "cpu", None, False)
    r2t = sg.ReqToTokenPool(4, 4096, "cpu", False)
    tree = sg.RadixCache(sg.CacheInitParams(disable=False, req_to_token_pool=r2t,
                                            token_to_kv_pool_allocator=alloc, page_size=B))
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    n_blocks = (len(tokens) - 1) // B
    slots = torch.arange(B, (n_blocks + 1) * B, dtype=torch.int64)
    for upto in pieces(n_blocks, k):
        tree.insert(InsertParams(key=sg.RadixKey(array("q", tokens[:upto * B])),
                                 value=slots[:upto * B]))
    key = sg.RadixKey(array("q", tokens[:n_blocks * B]))
    got = tree.match_prefix(sg.MatchPrefixParams(key=key)).device_prefix_len
    assert got == n_blocks * B, got
    prebuilt = sg.MatchPrefixParams(key=key)
    return ((lambda: tree.match_prefix(prebuilt)),
            (lambda: tree.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey(
                array("q", tokens)))))), tree


def per_call_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls * 1e6


def spread(xs: list[float]) -> dict[str, object]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def run(args: argparse.Namespace) -> dict[str, object]:
    if not sglang_loader.available():
        raise SystemExit("sglang wheel not found: run bench/peers/fetch_sglang.sh")
    sg = sglang_loader.load()
    rng = random.Random(5)
    tokens = [rng.randrange(128_000) for _ in range(args.prompt_tokens)]
    shapes: dict[str, object] = {}
    for shape, k in (("one piece", 1), ("7 pieces", 7)):
        b_bytes, b_list = blockd_setup(tokens, k)
        (s_pre, s_list), _tree = sglang_setup(sg, tokens, k)
        fns = {"blockd lookup (packed bytes)": b_bytes, "blockd lookup (list of ints)": b_list,
               "SGLang match_prefix (key prebuilt)": s_pre,
               "SGLang match_prefix (key from a list)": s_list}
        names = list(fns)
        for fn in fns.values():  # warm up
            per_call_us(fn, 50)
        samples: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.repeats):
            for n in names[rep % len(names):] + names[:rep % len(names)]:
                samples[n].append(per_call_us(fns[n], args.calls))
        ratio = [s / b for s, b in zip(samples["SGLang match_prefix (key prebuilt)"],
                                       samples["blockd lookup (packed bytes)"], strict=True)]
        shapes[shape] = {
            "turns": k,
            "us_per_call": {n: spread(samples[n]) for n in names},
            "sglang_prebuilt_over_blockd_bytes": spread(ratio),
            "meets_goal": statistics.median(ratio) >= 1.0,
        }
    return {"prompt_tokens": args.prompt_tokens, "block_size": B,
            "blocks": (args.prompt_tokens - 1) // B, "calls_per_sample": args.calls,
            "repeats": args.repeats, "sglang": sg.version,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()},
            "shapes": shapes}


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(13, 4.2), sharex=True)
    for ax, (shape, r) in zip(axes, shapes.items(), strict=True):
        names = list(r["us_per_call"])
        med = [r["us_per_call"][n]["median"] for n in names]
        lo = [m - r["us_per_call"][n]["min"] for m, n in zip(med, names, strict=True)]
        hi = [r["us_per_call"][n]["max"] - m for m, n in zip(med, names, strict=True)]
        colors = ["#2c7be0" if n.startswith("blockd") else "#5aa55a" for n in names]
        ax.barh(names, med, xerr=[lo, hi], color=colors)
        for y, v in enumerate(med):
            ax.text(v, y, f" {v:.1f}", va="bottom")
        rt = r["sglang_prebuilt_over_blockd_bytes"]["median"]
        ax.set_title(f"{shape}: SGLang prebuilt / blockd bytes = {rt:.2f}x")
        ax.set_xlabel("CPU µs per full-hit lookup (median, min-max)")
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(f"Full-hit lookup, {result['prompt_tokens']} tokens, {result['blocks']} blocks "
                 "of 16, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "lookup_peers.json")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(result, args.out.with_suffix(".png"))
    print(f"load average {result['machine']['load_average']}")
    for shape, r in result["shapes"].items():
        for n, s in r["us_per_call"].items():
            print(f"{shape:10s} {n:40s} {s['median']:7.2f} us (min {s['min']:.2f}, "
                  f"max {s['max']:.2f})")
        rt = r["sglang_prebuilt_over_blockd_bytes"]
        print(f"{shape:10s} SGLang prebuilt / blockd bytes: {rt['median']:.2f}x (min "
              f"{rt['min']:.2f}, max {rt['max']:.2f}): goal >= 1: "
              f"{'met' if r['meets_goal'] else 'SHORT'}")
    print(f"wrote {args.out}" + ("" if args.no_plot else f" and {args.out.with_suffix('.png')}"))
    return result


if __name__ == "__main__":
    main()
