"""The admit's latency through a real daemon with the tiers copying, and without tiers.

A workload whose shared prompts are 4x the pool, through ``blockd serve`` (``blockd_apps.launch``)
over its Unix socket: each request is one Step admitting its prompt (timed, round trip), one
committing its full blocks (their K/V counted as written), a Heartbeat completing the fence and
one Step releasing it. Three configurations, a fresh daemon each, interleaved per repetition
(the order rotating): ``no tiers``; ``host tier`` (4x the pool); ``host + disk`` (a host tier of
the pool's size over a disk tier of 4x, so that host evictions demote to disk). The admits of a
tiered daemon evict and so spill (copy) pool blocks, and load the revisited prompts' blocks
back: those copies happen inside the timed Step.

Reported per configuration: admit latency p50/p99 (microseconds), the prompt tokens served from
the cache (every tier), and per repetition the ratio of each tiered p99 and p50 to the untiered
one of the same repetition (median, min, max).

Writes bench/results/tier_admit.json and bench/results/tier_admit.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "apps"))

from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc  # noqa: E402
from blockd_apps.launch import spawn  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: ``prefault``: pages (the pool's and the host tier's) are touched at start, so the timed
#: admits see the steady state, not each page's first fault.
POOL = {"block_size": 16, "num_blocks": 256, "num_layers": 4, "num_kv_heads": 4,
        "head_dim": 64, "dtype": "float16", "prefault": True}
SLOT = 16 * 2 * 4 * 4 * 64 * 2  # 64 KiB
LAYOUT = pb.KvLayout(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64,
                     dtype=pb.KV_DTYPE_FLOAT16, kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                     tp_size=1)
NS = pb.CacheNamespace(model_id="bench", model_revision="r1")
CONFIGS = ("no tiers", "host tier", "host + disk")


def tiers_for(name: str, disk: Path) -> dict[str, object]:
    pool = POOL["num_blocks"] * SLOT
    if name == "host tier":
        return {"host_bytes": 4 * pool}
    if name == "host + disk":
        return {"host_bytes": pool, "disk_path": str(disk), "disk_bytes": 4 * pool}
    return {}


def workload(seed: int, n: int, prompts: int, prompt_tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50_000) for _ in range(prompt_tokens)] for _ in range(prompts)]
    return [systems[rng.randrange(prompts)] + [rng.randrange(1, 50_000)
                                               for _ in range(rng.randint(8, 40))]
            for _ in range(n)]


def run_config(name: str, work: list[list[int]], warmup: int, tmp: Path) -> dict[str, object]:
    wd = tmp / name.replace(" ", "-").replace("+", "")
    (wd / "disk").mkdir(parents=True)
    cfg = {"server": {"unix_socket": str(wd / "b.sock"), "tcp_address": "",
                      "handle_socket": str(wd / "p.sock")},
           "metrics": {"address": ""}, "pool": POOL,
           "tiers": tiers_for(name, wd / "disk"),
           "log": {"level": "WARNING"}}
    (wd / "blockd.yaml").write_text(yaml.safe_dump(cfg))
    d = spawn(wd / "blockd.yaml", wd)
    try:
        ch = grpc.insecure_channel(f"unix:{d.endpoints['unix']}")
        stub = pb_grpc.BlockdServiceStub(ch)
        att = stub.Attach(pb.AttachRequest(worker_name="bench", tenant_id="default",
                                           layout=LAYOUT, lease_ms=300_000))  # no heartbeats
        sid, epoch = att.session_id, att.epoch
        step_id = 0
        lat: list[float] = []
        cached = queried = 0

        def step(*ops: pb.Operation, f: int = 0) -> pb.StepResponse:
            nonlocal step_id
            step_id += 1
            return stub.Step(pb.StepRequest(session_id=sid, epoch=epoch, step_id=step_id,
                                            fence=f, operations=list(ops)))

        for i, tokens in enumerate(work):
            fence = i + 1
            op = pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=tokens))
            t0 = time.perf_counter()
            resp = step(op, f=fence)
            dt = time.perf_counter() - t0
            res = resp.results[0]
            if res.status.code:
                raise RuntimeError(f"{name}: admit refused: {res.status}")
            seq = res.admit.sequence_id
            if i >= warmup:
                lat.append(dt)
                cached += res.admit.num_cached_tokens
                queried += len(tokens)
            step(pb.Operation(commit=pb.CommitOp(sequence_id=seq)))
            stub.Heartbeat(pb.HeartbeatRequest(session_id=sid, epoch=epoch,
                                               completed_fence=fence))
            step(pb.Operation(release=pb.ReleaseOp(sequence_id=seq)))
        stats = stub.Stats(pb.StatsRequest())
        ch.close()
    finally:
        d.stop()
    lat.sort()
    return {"p50_us": 1e6 * lat[len(lat) // 2], "p99_us": 1e6 * lat[int(0.99 * (len(lat) - 1))],
            "mean_us": 1e6 * statistics.fmean(lat), "admits": len(lat),
            "hit_rate_tokens": cached / queried,
            "tiers": [{"tier": t.tier, "hit_tokens": t.hit_tokens_total,
                       "stored_blocks": t.stored_blocks_total,
                       "loaded_blocks": t.loaded_blocks_total} for t in stats.tiers]}


def run(args: argparse.Namespace) -> dict[str, object]:
    work = workload(args.seed, args.requests + args.warmup, args.prompts, args.prompt_tokens)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.repeats):
            order = CONFIGS[rep % 3:] + CONFIGS[:rep % 3]
            for name in order:
                r = run_config(name, work, args.warmup, Path(tmp) / f"rep{rep}")
                r.update(config=name, repetition=rep)
                runs.append(r)
                print(f"rep {rep} {name:12s} admit p50 {r['p50_us']:7.0f} us  p99 "
                      f"{r['p99_us']:7.0f} us  hit {r['hit_rate_tokens']:.3f}", flush=True)
    out: dict[str, object] = {}
    for name in CONFIGS:
        mine = [r for r in runs if r["config"] == name]
        entry: dict[str, object] = {
            k: statistics.median(r[k] for r in mine) for k in ("p50_us", "p99_us", "mean_us")}
        entry["hit_rate_tokens"] = mine[0]["hit_rate_tokens"]
        entry["tiers"] = mine[0]["tiers"]
        if name != "no tiers":
            for q in ("p50_us", "p99_us"):
                xs = [r[q] / base[q] for r in mine
                      for base in runs if base["config"] == "no tiers"
                      and base["repetition"] == r["repetition"]]
                entry[f"{q[:3]} ratio"] = {"median": statistics.median(xs), "min": min(xs),
                                           "max": max(xs), "samples": xs}
        out[name] = entry
    return {"configs": out, "runs": runs,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "pool": POOL, "slot_bytes": SLOT,
            "working_set_over_pool": args.prompts * (args.prompt_tokens // 16)
            / POOL["num_blocks"],
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform()}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["configs"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(cfg))
    w = 0.38
    axes[0].bar([i - w / 2 for i in x], [c["p50_us"] for c in cfg.values()], w, label="p50")
    axes[0].bar([i + w / 2 for i in x], [c["p99_us"] for c in cfg.values()], w, label="p99")
    axes[0].set_xticks(list(x), list(cfg))
    axes[0].set_ylabel("admit Step round trip, us (median of repetitions)")
    axes[0].legend()
    axes[0].set_title(f"working set {result['working_set_over_pool']:.0f}x the pool")
    axes[1].bar(list(x), [c["hit_rate_tokens"] for c in cfg.values()], color="#2c7be0")
    axes[1].set_xticks(list(x), list(cfg))
    axes[1].set_ylim(0, 1)
    axes[1].set_ylabel("prompt tokens served from the cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=RESULTS.parent)
    ap.add_argument("--out", type=Path, default=RESULTS / "tier_admit.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(result, args.out.with_suffix(".png"))
    for name, c in result["configs"].items():
        extra = "".join(f"; {k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
                        for k, v in c.items() if k.endswith("ratio"))
        print(f"{name:12s} p50 {c['p50_us']:.0f} us, p99 {c['p99_us']:.0f} us, hit "
              f"{c['hit_rate_tokens']:.3f}{extra}")
    return result


if __name__ == "__main__":
    main()
