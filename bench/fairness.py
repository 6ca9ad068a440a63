"""Fairness: tenant A's Step latency alone and beside tenant B's flood, in one daemon, one run.

Starts ``blockd serve`` (4,096 blocks of 16 tokens) with two tenants, "a" and "b", each with the
per-tenant work budget of this run (``tenants.work_units_per_second``, ``work_units_burst``,
below) and the per-call bound ``server.max_work_per_call`` (``--max-work``, default the daemon's
default). Every call waits for its tenant's turn in the daemon's fair gate
(``blockd/runtime/fair_gate.py``). Tenant A runs a normal
worker loop on one session: admit a 64-token prompt, 16 decode Steps of one appended token
(each naming a fence and completing the previous one), release; the latency of every Step is
recorded. Phases, same daemon: A alone, A beside B's flood, A alone again (the "alone" figures
are both alone phases together, so a drift of the machine shows up on both sides).

B's flood, from separate processes (so the flooders' client work does not share A's GIL), each
as fast as it can and ignoring the retry hints: Lookups of long prompts (256k tokens; the
daemon looks at most at the longest possible hit), huge Steps (admits at the per-call bound),
sized to the per-call bound), and many sessions (Attach/Detach in a loop). Refusals (rate,
work) are counted, not errors.

Step, StepStream and Lookup requests are parsed in their tenant's turn, their bytes charged to
its budget first (``blockd/server/servicer.py``), so B's refused floods cost no parsing.

Reports, for each of ``--runs`` runs (a fresh daemon each; the 1-minute load average before and
after, since the flooders, A and the daemon share the host's cores), A's p50/p99 alone and under
the flood and their ratios (the goal: p99 within 2x) and B's calls served and refused; then the
medians, minima and maxima over the runs. Writes bench/results/fairness.json and
bench/results/fairness.png (the latencies of every run; ``--tag`` adds a suffix).
No timed assertion: the figures are the result.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import yaml

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime.tenants_file import token_hash
from blockd_apps.launch import spawn, terminate

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = {"a": "fair-a", "b": "fair-b"}
NUM_BLOCKS = 4096
LAYOUT = pb.KvLayout(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64,
                     dtype=pb.KV_DTYPE_FLOAT16, kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                     tp_size=1)
NS = pb.CacheNamespace(model_id="bench", model_revision="r1")
#: The CPUs this benchmark may use (``--placement`` divides them).
CPUS = os.sched_getaffinity(0)
#: The per-tenant budget of this run: a tenth of what one core of the daemon can do each.
RATE = 1_000_000
BURST = 200_000


def md(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),)


def config(workdir: Path, max_work: int, switch_ms: float | None = None) -> Path:
    tenants = {
        "tenants": [{"id": t, "quota_blocks": NUM_BLOCKS // 2, "sharing": "private"}
                    for t in TOKENS],
        "workers": [{"name": t, "token_sha256": token_hash(tok), "tenants": [t]}
                    for t, tok in TOKENS.items()],
    }
    (workdir / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    cfg = {
        "server": {"unix_socket": str(workdir / "blockd.sock"), "tcp_address": "",
                   "handle_socket": "", "max_sessions": 100_000,
                   "max_work_per_call": max_work,
                   **({} if switch_ms is None else {"gil_switch_interval_ms": switch_ms})},
        "metrics": {"address": ""},
        "pool": {"block_size": 16, "num_blocks": NUM_BLOCKS, "num_layers": 4,
                 "num_kv_heads": 4, "head_dim": 64, "dtype": "float16"},
        "lease": {"default_ms": 60_000},
        "tenants": {"file": str(workdir / "tenants.yaml"), "allow_anonymous": False,
                    "work_units_per_second": RATE, "work_units_burst": BURST},
        "log": {"level": "WARNING"},
    }
    path = workdir / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def attach(stub: pb_grpc.BlockdServiceStub, who: str) -> pb.AttachResponse:
    return stub.Attach(pb.AttachRequest(worker_name=who, tenant_id=who, layout=LAYOUT),
                       metadata=md(who))


def a_phase(stub: pb_grpc.BlockdServiceStub, att: pb.AttachResponse, state: dict[str, int],
            seconds: float) -> list[float]:
    """A's worker loop for ``seconds``: the latency of every Step, milliseconds."""
    out: list[float] = []
    end = time.perf_counter() + seconds
    sid, epoch = att.session_id, att.epoch

    def step(ops: list[pb.Operation], fence: int, done: int) -> pb.StepResponse:
        state["step"] += 1
        req = pb.StepRequest(session_id=sid, epoch=epoch, step_id=state["step"], fence=fence,
                             completed_fence=done, operations=ops)
        t0 = time.perf_counter()
        resp = stub.Step(req, metadata=md("a"))
        out.append((time.perf_counter() - t0) * 1000)
        assert all(r.status.code == 0 for r in resp.results), resp
        return resp

    while time.perf_counter() < end:
        base = state["step"] * 7 % 50_000
        prompt = list(range(base, base + 64))
        f = state["fence"]
        resp = step([pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=prompt))], f + 1, f)
        seq = resp.results[0].admit.sequence_id
        f += 1
        for i in range(16):
            step([pb.Operation(append=pb.AppendOp(sequence_id=seq, token_ids=[i]))], f + 1, f)
            f += 1
        step([pb.Operation(release=pb.ReleaseOp(sequence_id=seq))], f + 1, f)
        state["fence"] = f + 1
    return out


def flood(kind: str, target: str, stop: Any, counts: Any, max_work: int, nice: int) -> None:
    """One of B's flooders, until ``stop`` is set; outcomes counted in ``counts``."""
    if nice:
        os.nice(nice)
    got: Counter[str] = Counter()
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 25)]
                               ) as ch:
        stub = pb_grpc.BlockdServiceStub(ch)
        att = attach(stub, "b")
        step_id = 0
        lookup = pb.LookupRequest(session_id=att.session_id, epoch=att.epoch, namespace=NS,
                                  token_ids=range(1 << 18))
        # Eight admits summing to just under server.max_work_per_call.
        n = max(1, max_work // 8 - 256 - 8)
        huge = [pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=range(i, i + n)))
                for i in range(8)]
        while not stop.is_set():
            try:
                if kind == "lookup":
                    stub.Lookup(lookup, metadata=md("b"))
                elif kind == "steps":
                    step_id += 1
                    resp = stub.Step(pb.StepRequest(session_id=att.session_id, epoch=att.epoch,
                                                    step_id=step_id, operations=huge),
                                     metadata=md("b"))
                    seqs = [r.admit.sequence_id for r in resp.results if r.status.code == 0]
                    if seqs:
                        step_id += 1
                        stub.Step(pb.StepRequest(
                            session_id=att.session_id, epoch=att.epoch, step_id=step_id,
                            operations=[pb.Operation(release=pb.ReleaseOp(sequence_id=s))
                                        for s in seqs]), metadata=md("b"))
                else:
                    s = attach(stub, "b")
                    stub.Detach(pb.DetachRequest(session_id=s.session_id), metadata=md("b"))
                got["ok"] += 1
            except grpc.RpcError as err:
                detail = (err.details() or "").split(":")[0]
                got[f"{err.code().name}:{detail}"] += 1
    counts[kind] = dict(got)


def spawn_placed(cfg: Path, cwd: Path, placement: str) -> Any:
    """The daemon, on a core of its own when ``placement`` is "isolated": it inherits CPU 0
    (every thread it starts does), and this process (A's client), with B's flooders started
    from it, then keeps to the other cores. "shared": everything on every core."""
    if placement == "shared":
        os.sched_setaffinity(0, CPUS)
        return spawn(cfg, cwd)
    os.sched_setaffinity(0, {min(CPUS)})
    try:
        launched = spawn(cfg, cwd)
    finally:
        os.sched_setaffinity(0, CPUS - {min(CPUS)})
    return launched


def spin(cpu: int, stop: Any) -> None:
    """Keep one CPU from idling (``--keep-awake``), at the lowest priority there is
    (SCHED_IDLE: it runs only when nothing else on that CPU wants to)."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while not stop.is_set():
        for _ in range(100_000):
            pass


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000)[int(q * 1000) - 1] if len(xs) > 1 else xs[0]


def one_run(args: argparse.Namespace) -> tuple[list[float], list[float], dict[str, Any]]:
    """One daemon: A alone, A beside B's flood, A alone again."""
    ctx = mp.get_context("spawn")
    load_before = os.getloadavg()
    awake = ctx.Event()
    spinners = [ctx.Process(target=spin, args=(c, awake)) for c in CPUS] if args.keep_awake \
        else []
    for sp in spinners:
        sp.start()
    with tempfile.TemporaryDirectory(prefix="blockd-fair-") as tmp:
        launched = spawn_placed(config(Path(tmp), args.max_work, args.gil_switch_interval_ms),
                                Path(tmp), args.placement)
        target = f"unix:{launched.endpoints['unix']}"
        try:
            with grpc.insecure_channel(target) as ch:
                stub = pb_grpc.BlockdServiceStub(ch)
                att = attach(stub, "a")
                state = {"step": 0, "fence": 0}
                a_phase(stub, att, state, 1.0)  # warm-up
                alone = a_phase(stub, att, state, args.seconds / 2)
                stop = ctx.Event()
                manager = ctx.Manager()
                counts = manager.dict()
                procs = [ctx.Process(target=flood, args=(k, target, stop, counts,
                                                         args.max_work, args.flood_nice))
                         for k in args.kinds.split(",")]
                for p in procs:
                    p.start()
                time.sleep(1.0)  # the flooders connect and spend their bursts
                flooded = a_phase(stub, att, state, args.seconds)
                stop.set()
                for p in procs:
                    p.join(30)
                b_counts = dict(counts)
                manager.shutdown()
                alone += a_phase(stub, att, state, args.seconds / 2)
        except grpc.RpcError:
            print("the daemon's last log lines:\n" + "".join(launched.lines[-40:]),
                  file=sys.stderr)
            raise
        finally:
            terminate(launched.proc)
            awake.set()
            for sp in spinners:
                sp.join(10)
    res: dict[str, Any] = {
        "a_alone": {"steps": len(alone), "p50_ms": pct(alone, 0.5), "p99_ms": pct(alone, 0.99)},
        "a_flooded": {"steps": len(flooded), "p50_ms": pct(flooded, 0.5),
                      "p99_ms": pct(flooded, 0.99)},
        "b_flood": b_counts,
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
    }
    res["ratio_p50"] = res["a_flooded"]["p50_ms"] / res["a_alone"]["p50_ms"]
    res["ratio_p99"] = res["a_flooded"]["p99_ms"] / res["a_alone"]["p99_ms"]
    return alone, flooded, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each phase")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--max-work", type=int, default=1 << 17,
                    help="server.max_work_per_call of the run (default: the daemon's)")
    ap.add_argument("--runs", type=int, default=3, help="runs (a fresh daemon each)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--kinds", default="lookup,steps,sessions",
                    help="B's flooders, comma-separated (lookup, steps, sessions)")
    ap.add_argument("--keep-awake", action=argparse.BooleanOptionalAction, default=True,
                    help="keep every CPU from idling with a SCHED_IDLE spinner (default): on "
                         "this VM a halted vCPU takes milliseconds to wake, which inflates the "
                         "quiet phases (A alone) and not the flooded one")
    ap.add_argument("--gil-switch-interval-ms", type=float, default=None,
                    help="server.gil_switch_interval_ms of the run (default: the daemon's)")
    ap.add_argument("--placement", choices=("isolated", "shared"), default="isolated",
                    help="isolated (default): the daemon on a core of its own, A and B's "
                         "flooders on the others, the flooders at --flood-nice, as clients on "
                         "other machines would be; shared: all of them on every core")
    ap.add_argument("--flood-nice", type=int, default=None,
                    help="niceness of B's flooder processes (default: 19 isolated, 0 shared)")
    args = ap.parse_args(argv)
    if args.placement == "isolated" and len(CPUS) < 2:
        ap.error("--placement isolated needs 2 CPUs: use --placement shared")
    if args.flood_nice is None:
        args.flood_nice = 19 if args.placement == "isolated" else 0
    runs = [one_run(args) for _ in range(args.runs)]
    figures = [r for _, _, r in runs]

    def spread(get: Any) -> dict[str, float]:
        xs = [get(r) for r in figures]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    res: dict[str, Any] = {
        "budget": {"work_units_per_second": RATE, "work_units_burst": BURST},
        "max_work_per_call": args.max_work,
        "gil_switch_interval_ms": args.gil_switch_interval_ms,
        "placement": args.placement,
        "keep_awake": args.keep_awake,
        "flood_nice": args.flood_nice,
        "flood_kinds": args.kinds.split(","),
        "cpus": os.cpu_count(),
        "runs": figures,
        "summary": {
            "a_alone_p50_ms": spread(lambda r: r["a_alone"]["p50_ms"]),
            "a_alone_p99_ms": spread(lambda r: r["a_alone"]["p99_ms"]),
            "a_flooded_p50_ms": spread(lambda r: r["a_flooded"]["p50_ms"]),
            "a_flooded_p99_ms": spread(lambda r: r["a_flooded"]["p99_ms"]),
            "ratio_p50": spread(lambda r: r["ratio_p50"]),
            "ratio_p99": spread(lambda r: r["ratio_p99"]),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "fairness" + (f"-{args.tag}" if args.tag else "")
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    alone = [x for a, _, _ in runs for x in a]
    flooded = [x for _, f, _ in runs for x in f]
    plot(alone, flooded, res, args.out / f"{name}.png")
    print(json.dumps(res["summary"], indent=1))
    return 0


def plot(alone: list[float], flooded: list[float], res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for xs, label in ((alone, "A alone"), (flooded, "A beside B's flood")):
        s = sorted(xs)
        ax.plot(s, [i / len(s) for i in range(len(s))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("A's Step latency (ms)")
    ax.set_ylabel("fraction of Steps")
    r = res["summary"]
    ax.set_title(f"max_work_per_call {res['max_work_per_call']}, {len(res['runs'])} runs: "
                 f"p50 x{r['ratio_p50']['median']:.2f}, p99 x{r['ratio_p99']['median']:.2f} "
                 "(medians) under the flood", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
