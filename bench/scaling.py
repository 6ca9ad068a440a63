"""Does blockd's replay cost per request stay flat as requests and the pool grow?

The scheduler loop of ``bench/peers_replay.py`` (blockd's ``append_batch`` path, fences
completing one step late) over 1k, 10k and 100k requests and pools of 20k, 200k and 1M blocks.
The trace has ``bench/trace.py``'s shape (shared system prompts, unique suffixes, follow-ups
continuing one of the previous 200 requests) but is generated while it is replayed, as packed
uint32 token ids from a seeded RNG: 100k requests of ~1,500 tokens would not fit in memory as
Python lists. Flat cost per request (and per block operation) across a row means the
operations are O(1) in the pool size; down a column, the trace itself changes (a longer trace
has more follow-ups warm in the cache), so compare the cost per block operation there.

Writes bench/results/scaling.json and bench/results/scaling.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
from collections import deque
from pathlib import Path

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = PrefixScope("llama-3-8b", model_revision="main", tokenizer_digest=b"tok-v1")
WINDOW = 200  # a follow-up continues one of the previous WINDOW requests


class StreamingTrace:
    """Requests in arrival order, made on demand; keeps only the follow-up window."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.rng = random.Random(seed)
        rng = self.rng
        self.systems = [rng.randbytes(4 * rng.randint(870, 1270)) for _ in range(6)]
        self.recent: deque[tuple[int, bytes, bytes]] = deque(maxlen=WINDOW)
        self.made = 0
        self.step = 0.0

    def next(self) -> tuple[int, int, bytes, bytes, int]:
        """(index, arrival step, prompt bytes, output bytes, index followed or -1)."""
        rng = self.rng
        i = self.made
        self.made += 1
        self.step += rng.expovariate(1.0)
        output = rng.randbytes(4 * max(1, int(rng.gauss(137, 40))))
        follows = -1
        if self.recent and rng.random() < 0.33:
            j, prompt0, out0 = self.recent[rng.randrange(len(self.recent))]
            prompt = prompt0 + out0 + rng.randbytes(4 * rng.randint(20, 120))
            follows = j
        else:
            system = self.systems[min(int(rng.paretovariate(1.2)) - 1, 5)]
            prompt = system + rng.randbytes(4 * rng.randint(90, 540))
        self.recent.append((i, prompt, output))
        return i, int(self.step), prompt, output, follows


def replay(num_requests: int, num_blocks: int, block_size: int, max_running: int,
           seed: int) -> dict[str, float]:
    m = BlockManager(PoolSpec(block_size=block_size, num_blocks=num_blocks),
                     [TenantPolicy("bench", quota_blocks=num_blocks)], seed=7)
    s = m.open_session("bench")
    trace = StreamingTrace(num_requests, seed)
    finished = bytearray(num_requests)
    pending = trace.next() if num_requests else None
    waiting: deque[tuple[int, int, bytes, bytes, int]] = deque()
    running: list[list] = []  # [seq id, output bytes, tokens written, prompt length]
    B = block_size
    steps = allocated = released = tokens = 0
    gc.collect()
    t0 = time.process_time()
    while pending is not None or waiting or running:
        steps += 1
        if steps > 1:
            m.complete_fence(s, steps - 1, clamp_to_issued=True)
        while pending is not None and pending[1] <= steps:
            waiting.append(pending)
            pending = trace.next() if trace.made < num_requests else None
        admitted = []
        blocked = 0
        while waiting and len(running) + len(admitted) < max_running and blocked < len(waiting):
            req = waiting[0]
            if req[4] >= 0 and not finished[req[4]]:
                waiting.rotate(-1)
                blocked += 1
                continue
            res = m.admit(s, SCOPE, req[2])
            if not hasattr(res, "block_table"):
                break
            waiting.popleft()
            blocked = 0
            allocated += len(res.block_table) - res.num_cached_tokens // B
            tokens += len(req[2]) // 4
            m.commit(s, res.seq_id, steps)
            admitted.append([res.seq_id, req[3], 0, len(req[2]) // 4, req[0]])
        if running:
            out = m.append_batch(s, [r[0] for r in running],
                                 b"".join([r[1][4 * r[2]:4 * r[2] + 4] for r in running]),
                                 fence=steps)
            bad = {j for j, _ in out.errors}
            for _, d in out.deltas:
                allocated += len(d.block_ids)
            still = []
            for j, r in enumerate(running):
                if j not in bad:
                    r[2] += 1
                    tokens += 1
                    if (r[3] + r[2]) % B == 0:
                        m.commit(s, r[0], steps)
                if r[2] * 4 == len(r[1]):
                    released += m.release(s, r[0], steps)
                    finished[r[4]] = 1
                else:
                    still.append(r)
            running = still
        running += admitted
    cpu = time.process_time() - t0
    c = m.counters
    ops = allocated + released
    return {"requests": num_requests, "num_blocks": num_blocks, "cpu_s": cpu, "steps": steps,
            "tokens": tokens, "block_ops": ops, "evictions": c.evictions,
            "hit_rate_tokens": c.hit_tokens / c.queried_tokens if c.queried_tokens else 0.0,
            "cpu_us_per_request": cpu / num_requests * 1e6,
            "cpu_us_per_block_op": cpu / ops * 1e6, "cpu_us_per_token": cpu / tokens * 1e6}


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for n in sorted({c["requests"] for c in cells}):
        row = sorted((c for c in cells if c["requests"] == n), key=lambda c: c["num_blocks"])
        xs = [c["num_blocks"] for c in row]
        axes[0].plot(xs, [c["cpu_us_per_request"] for c in row], marker="o",
                     label=f"{n:,} requests")
        axes[1].plot(xs, [c["cpu_us_per_block_op"] for c in row], marker="o",
                     label=f"{n:,} requests")
    for ax, what in zip(axes, ("CPU µs per request", "CPU µs per block operation"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("pool size (blocks)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.legend()
    axes[0].set_title("blockd replay cost per request (append_batch path)")
    axes[1].set_title("per block operation (allocated + released)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--pools", type=int, nargs="+", default=[20_000, 200_000, 1_000_000])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    args = ap.parse_args(argv)
    cells = []
    for n in args.requests:
        for pool in args.pools:
            c = replay(n, pool, args.block_size, args.max_running, args.seed)
            cells.append(c)
            print(f"{n:>8,} requests  {pool:>9,} blocks  {c['cpu_s']:7.1f} s CPU  "
                  f"{c['cpu_us_per_request']:8.1f} us/request  "
                  f"{c['cpu_us_per_block_op']:6.2f} us/block op  hit {c['hit_rate_tokens']:.3f}  "
                  f"evictions {c['evictions']:,}", flush=True)
    result: dict[str, object] = {
        "config": {"block_size": args.block_size, "max_running": args.max_running,
                   "seed": args.seed},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
