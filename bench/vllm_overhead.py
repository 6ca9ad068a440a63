"""What one trio of engines (vLLM alone, a do-nothing connector, BlockdConnector) costs on the
same work, for bench/vllm_connector.py: repetitions in a mirrored order and their summary; with
a second do-nothing engine (``CONTROL``) when the caller starts one, whose ratio to the first
says how far two identical engines differ in the same run.

Each repetition makes two passes over the engines, the second in the reverse order of the
first (A B C, then C B A), each pass with its own new prompts, the same for every engine: a
machine that slows down or speeds up over a repetition weighs on every engine alike, and no
engine ever sees a prompt twice (BlockdConnector would hit its own first pass). The engines not
measured are stopped during a call (``vllm_measured.alone``), and BlockdConnector's engine
finishes its commits and releases before the next call. An engine's figures are the means of
its two calls; the ratios are taken per repetition.
"""

from __future__ import annotations

import json
import random
import statistics
from itertools import permutations
from typing import Any

from vllm_measured import Measured, connector_stats, prompts_of, summary
from vllm_rig import daemon_counter, retired

OVERHEAD = ("alone", "noop", "blockd")
#: A second do-nothing engine, when the caller starts one: the same engine twice, so the run
#: shows how far two identical engines' walls differ (the ratios' noise floor).
CONTROL = "noop2"
STEPS = "blockd_step_duration_seconds_count"


def repetitions(engines: dict[str, Measured], daemon: Any, repeats: int, requests: int,
                length: int, max_tokens: int, seed: str) -> list[dict[str, Any]]:
    """``repeats`` mirrored repetitions of ``requests`` new ``length``-token prompts per call
    (``max_tokens`` generated each) on ``engines`` (keys ``OVERHEAD``, and ``CONTROL`` when
    given; ``daemon`` BlockdConnector's blockd), the first pass's order rotating through the
    permutations of the engines."""
    names = tuple(engines)
    orders = list(permutations(names))
    reps = []
    for rep in range(repeats):
        passes = [prompts_of(random.Random(f"{seed}-{rep}-{p}"), requests, length)
                  for p in range(2)]
        order = orders[rep % len(orders)]
        calls: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for i, name in enumerate((*order, *reversed(order))):
            before = daemon_counter(daemon, STEPS) if name == "blockd" else 0.0
            call = engines[name].call(passes[i // len(order)], max_tokens,
                                      daemon_pid=daemon.proc.pid if name == "blockd" else None,
                                      others=[m for n, m in engines.items() if n != name])
            if name == "blockd":
                call["daemon_steps"] = daemon_counter(daemon, STEPS) - before
                # Its last commits and releases are done before the next call (untimed): it
                # is stopped during the others' calls, and would finish them in its next one.
                retired(daemon)
            calls[name].append(call)
        rec: dict[str, Any] = {"order": list(order)}
        rec.update({name: merged(calls[name]) for name in names})
        tokens = {n: rec[n].pop("tokens") for n in names}
        rec["same_tokens"] = all(t == tokens["alone"] for t in tokens.values())
        b = rec["blockd"]
        if b["engine_steps"]:
            b["daemon_steps_per_engine_step"] = b["daemon_steps"] / b["engine_steps"]
        rec["time_ratio"] = {
            "blockd_over_noop": b["wall_s"] / rec["noop"]["wall_s"],
            "noop_over_alone": rec["noop"]["wall_s"] / rec["alone"]["wall_s"],
            "blockd_over_alone": b["wall_s"] / rec["alone"]["wall_s"]}
        if CONTROL in rec:  # two identical engines: what the other ratios' noise is
            rec["time_ratio"]["noop2_over_noop"] = rec[CONTROL]["wall_s"] / rec["noop"]["wall_s"]
        rec["tokens_per_s_ratio"] = {
            "blockd_over_noop": b["tokens_per_s"] / rec["noop"]["tokens_per_s"],
            "noop_over_alone": rec["noop"]["tokens_per_s"] / rec["alone"]["tokens_per_s"],
            "blockd_over_alone": b["tokens_per_s"] / rec["alone"]["tokens_per_s"]}
        reps.append(rec)
        print(json.dumps({f"{seed}_rep": rep, "order": rec["order"],
                          "wall_s": {n: round(rec[n]["wall_s"], 3) for n in names},
                          "time_ratio": {k: round(v, 3) for k, v in rec["time_ratio"].items()},
                          "daemon_steps": b["daemon_steps"], "engine_steps": b["engine_steps"],
                          "same_tokens": rec["same_tokens"]}), flush=True)
    return reps


def merged(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's calls of a repetition as one record: per-call means of its times, steps
    and CPU seconds (so a ratio of two engines' is the ratio of their totals), sums of its
    tokens, every TTFT and connector figure; ``tokens`` every call's, in order."""
    n = len(calls)
    out: dict[str, Any] = {"calls_wall_s": [c["wall_s"] for c in calls]}
    for key in ("wall_s", "engine_steps", "engine_cpu_s", "daemon_cpu_s", "daemon_steps"):
        if key in calls[0]:
            out[key] = sum(c[key] or 0.0 for c in calls) / n
    for key in ("output_tokens", "prompt_tokens", "cached_tokens"):
        out[key] = sum(c[key] for c in calls)
    out["tokens_per_s"] = out["output_tokens"] / sum(c["wall_s"] for c in calls)
    out["ttft_ms"] = [t for c in calls for t in c["ttft_ms"]]
    out["ttft_p50_ms"] = statistics.median(out["ttft_ms"])
    counters: dict[str, float] = {}
    for c in calls:
        for k, v in c["connector_counters"].items():
            counters[k] = counters.get(k, 0.0) + v
    out["connector_counters"] = counters
    out["connector_log"] = [i for c in calls for i in c["connector_log"]]
    out["tokens"] = [t for c in calls for t in c["tokens"]]
    return out


def overhead_summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians with [min, max] over the repetitions."""
    names = [n for n in (*OVERHEAD, CONTROL) if n in reps[0]]
    return {
        **{f"{n}_wall_s": summary([r[n]["wall_s"] for r in reps]) for n in names},
        **{f"{n}_tokens_per_s": summary([r[n]["tokens_per_s"] for r in reps])
           for n in names},
        **{f"time_{k}": summary([r["time_ratio"][k] for r in reps])
           for k in reps[0]["time_ratio"]},
        **{f"tokens_per_s_{k}": summary([r["tokens_per_s_ratio"][k] for r in reps])
           for k in reps[0]["tokens_per_s_ratio"]},
        "blockd_daemon_steps": summary([r["blockd"]["daemon_steps"] for r in reps]),
        **{f"{n}_engine_cpu_s": summary([r[n]["engine_cpu_s"] for r in reps])
           for n in names},
        "blockd_daemon_cpu_s": summary([r["blockd"]["daemon_cpu_s"] for r in reps]),
        "blockd_cached_tokens": sum(r["blockd"]["cached_tokens"] for r in reps),
        "all_tokens_equal": all(r["same_tokens"] for r in reps),
        "blockd_connector_stats": connector_stats(
            [i for r in reps for i in r["blockd"]["connector_log"]]),
        **({"blockd_daemon_steps_per_engine_step": summary(
            [r["blockd"]["daemon_steps_per_engine_step"] for r in reps])}
           if all("daemon_steps_per_engine_step" in r["blockd"] for r in reps) else {}),
    }
