"""What one call of the vLLM overhead benchmark's workload costs the daemon, in CPU time.

``bench/vllm_connector.py`` and ``bench/vllm_timeline.py`` measure BlockdConnector inside real
engines, where the daemon shares a CPU with vLLM's engine core (this machine has two) and every
millisecond it computes is one the engine core or, through the shared caches, the worker may
lose. This measures that work alone and precisely: a real daemon (``blockd serve``, the tiny
model's pool, its own process) and one session making, over a StepStream as the connector does,
the Steps of one call of that workload (``--requests`` prompts of ``--length`` new tokens each):

- ``admit``: one Step admitting every prompt (a prefix lookup, then a block for each full block
  of the prompt, evicting cached ones once the pool is full: the steady state the engines run
  in after a few calls);
- ``commit``: the worker's copies reported done (the admit's fence), one Step committing every
  sequence, and the (empty) Step after it, which reports its fence: the daemon indexes the
  blocks then (one ``BlockStored`` event each);
- ``release``: one Step releasing every sequence, and the empty Step reporting its fence, in
  which their blocks become cached (evictable);
- ``step``: an empty Step alone, the floor any Step costs (gRPC, authentication, the session).

The daemon's CPU time is read from the kernel (``/proc/<pid>/task/*/schedstat``, nanoseconds,
every thread) around each phase; each round uses new prompts (never a hit: the overhead
benchmark's calls never hit either). Reported: the median [min, max] over ``--rounds`` rounds of
each phase's CPU milliseconds, and per block, and the blocks evicted per call (read from the
daemon's metrics between rounds, outside the measured windows). Nothing is asserted:
``tests/bench/test_daemon_call_cost.py`` checks the tool.
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
from vllm_rig import POOL, ROOT, daemon_counter, start_blockd, write_run  # noqa: E402

PHASES = ("admit", "commit", "release", "step")
EVICTIONS = "blockd_evictions_total"


def cpu_ns(pid: int) -> int:
    """CPU nanoseconds every live thread of process ``pid`` ran so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total


def layout() -> Any:
    """The pool's layout as a worker declares it at Attach (``POOL``: the tiny model's)."""
    from blockd_gpu import KvLayout

    return KvLayout(**{k: v for k, v in POOL.items() if k != "num_blocks"})


def one_round(session: Any, pid: int, ns: Any, prompts: list[list[int]], tag: str
              ) -> dict[str, float]:
    """The Steps of one call; the daemon's CPU milliseconds of each phase (module docstring;
    ``commit`` and ``release`` are two Steps each, ``admit`` and ``step`` one)."""
    from blockd_client import requests as rq

    t0 = cpu_ns(pid)
    admitted = session.step([rq.admit(p, ns, f"{tag}-{i}") for i, p in enumerate(prompts)])
    t1 = cpu_ns(pid)
    seqs = [r.admit.sequence_id for r in admitted.results]
    if len(seqs) != len(prompts) or not all(seqs):
        raise SystemExit(f"an admit was refused: {admitted.results}")
    session.complete(admitted.fence)  # the worker's copies are done
    committed = session.step([rq.commit(s) for s in seqs])
    session.complete(committed.fence)
    session.step([])  # reports the commit's fence: the blocks are indexed
    t2 = cpu_ns(pid)
    released = session.step([rq.release(s) for s in seqs])
    session.complete(released.fence)
    session.step([])  # reports the release's fence: the blocks become cached
    t3 = cpu_ns(pid)
    session.step([])
    t4 = cpu_ns(pid)
    ms = 1e-6
    return {"admit": (t1 - t0) * ms, "commit": (t2 - t1) * ms, "release": (t3 - t2) * ms,
            "step": (t4 - t3) * ms}


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from blockd_client import Client
    from blockd_client import requests as rq

    pool = dict(POOL, num_blocks=args.num_blocks)
    daemon = start_blockd(work / "daemon", pool)
    pid = daemon.proc.pid
    client = Client(f"unix:{work / 'daemon' / 'blockd.sock'}")
    session = client.attach("default", layout(), map_pool=False, stream=True, tables=False)
    ns = rq.namespace("bench-model")
    rng = random.Random(args.seed)
    rounds: list[dict[str, float]] = []
    try:
        for r in range(args.warmup + args.rounds):
            prompts = [[rng.randrange(1, 32000) for _ in range(args.length)]
                       for _ in range(args.requests)]
            before = daemon_counter(daemon, EVICTIONS)  # (outside the measured windows)
            res = one_round(session, pid, ns, prompts, f"r{r}")
            res["evictions"] = daemon_counter(daemon, EVICTIONS) - before
            if r >= args.warmup:
                rounds.append(res)
    finally:
        client.close()
        daemon.stop()
    blocks = args.requests * (args.length // POOL["block_size"])
    summary: dict[str, Any] = {}
    for phase in PHASES:
        xs = [r[phase] for r in rounds]
        summary[phase] = {"median_ms": statistics.median(xs), "min_ms": min(xs),
                          "max_ms": max(xs)}
    for phase in ("admit", "commit", "release"):
        summary[phase]["us_per_block"] = 1e3 * summary[phase]["median_ms"] / blocks
    summary["call_ms"] = sum(summary[p]["median_ms"] for p in ("admit", "commit", "release"))
    summary["evictions_per_call"] = statistics.median(r["evictions"] for r in rounds)
    return {"pool": pool, "blocks_per_call": blocks, "rounds": rounds, "summary": summary}


def one_line(result: dict[str, Any]) -> str:
    s = result["summary"]
    parts = ", ".join(f"{p} {s[p]['median_ms']:.2f} ms ({s[p]['us_per_block']:.1f} us/block)"
                      for p in ("admit", "commit", "release"))
    return (f"daemon CPU per call of {result['blocks_per_call']} blocks: {parts}; "
            f"{s['call_ms']:.2f} ms in all; an empty Step {s['step']['median_ms'] * 1e3:.0f} us; "
            f"{s['evictions_per_call']:.0f} blocks evicted per call")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(PHASES):
        m = s[p]
        ax.bar(i, m["median_ms"], yerr=[[m["median_ms"] - m["min_ms"]],
                                        [m["max_ms"] - m["median_ms"]]], capsize=4)
    ax.set_xticks(range(len(PHASES)), ["admit\n(1 Step)", "commit, indexing\n(2 Steps)",
                                       "release, freeing\n(2 Steps)", "empty Step"])
    ax.set_ylabel("daemon CPU per call, ms (median, min-max)")
    ax.set_title(f"what one call's Steps cost the daemon ({result['blocks_per_call']} blocks, "
                 f"{len(result['rounds'])} rounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=16,
                    help="rounds not counted (the pool fills with cached blocks: then admits "
                         "evict, as in the engines' steady state)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--length", type=int, default=320)
    ap.add_argument("--num-blocks", type=int, default=POOL["num_blocks"],
                    help="the pool's blocks (the tiny model's pool in the vLLM benchmarks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "bench" / "results" / "daemon_call_cost.json")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "what": __doc__.split("\n")[0],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="blockd-call-cost-") as tmp:
        result.update(run(Path(tmp), args))
    write_run(result, args.out, one_line(result), plot)


if __name__ == "__main__":
    main()
