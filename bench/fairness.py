"""Fairness: tenant A's Step latency alone and beside tenant B's flood, in one daemon, one run.

Starts ``blockd serve`` (4,096 blocks of 16 tokens) with two tenants, "a" and "b", each with the
per-tenant work budget of this run (``tenants.work_units_per_second``, ``work_units_burst``,
below) and the per-call bound ``server.max_work_per_call`` (``--max-work``, default the daemon's
default). Every call waits for its tenant's turn in the daemon's fair gate
(``blockd/runtime/fair_gate.py``). Tenant A runs a normal
worker loop on one session: admit a 64-token prompt, 16 decode Steps of one appended token
(each naming a fence and completing the previous one), release; the latency of every Step is
recorded. Phases, same daemon: A alone, A beside B's client work only (the control, below), A
beside B's flood, A alone again (the "alone" figures are both alone phases together, so a drift
of the machine shows up on both sides).

B's flood, from separate processes (so the flooders' client work does not share A's GIL), each
as fast as it can and ignoring the retry hints: Lookups of long prompts (256k tokens; the
daemon looks at most at the longest possible hit), huge Steps (admits at the per-call bound),
and many sessions (Attach/Detach in a loop). Refusals (rate, work) are counted, not errors.

Placement (``--placement isolated``, the default): the daemon on a core of its own; A's client
and B's flooders on the other, the flooders at SCHED_IDLE (``--flood-sched``), so that they run
when A's client waits, as clients on other machines would never take A's CPU. The control
phase measures what is left of that sharing: the same flooder processes build and serialize
the same requests as fast as they can and send none, so whatever they do to A's latency is the
harness's, not the daemon's (on this 2-vCPU VM the two vCPUs may share a physical core).

Reports, for each of ``--runs`` runs (a fresh daemon each; the 1-minute load average before and
after), A's p50/p99 alone, beside the control and under the flood, the ratios to A alone (the
goal: p99 within 2x under the flood) and B's calls served and refused; then the medians,
minima and maxima over the runs. Writes bench/results/fairness.json and
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


def lower(sched: str, nice: int) -> None:
    """This process at B's flooders' priority: SCHED_IDLE ("idle": it runs only when nothing
    else on its CPU wants to) or ``nice``."""
    if sched == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif nice:
        os.nice(nice)


def control(kind: str, stop: Any, counts: Any, max_work: int, sched: str, nice: int) -> None:
    """One of B's flooders without the daemon (the control phase): it builds the requests
    ``flood`` sends (a copy of the Lookup's bytes, a huge Step's bytes, an AttachRequest), as
    fast as it can, and sends none. What it does to A's latency is the harness's own sharing
    of A's CPU, nothing of the daemon's."""
    lower(sched, nice)
    lookup, ops = requests("b" * 24, 1, max_work)
    n = 0
    while not stop.is_set():
        n += 1
        if kind == "lookup":
            bytearray(lookup)
        elif kind == "steps":
            step_bytes("b" * 24, 1, n, ops)
        else:
            pb.AttachRequest(worker_name="b", tenant_id="b", layout=LAYOUT).SerializeToString()
    counts[kind] = {"built": n}


def requests(session_id: str, epoch: int, max_work: int) -> tuple[bytes, bytes]:
    """B's Lookup of a long prompt, and the operations of its huge Step (eight admits summing
    to just under server.max_work_per_call), serialized once: a flooder sends bytes, as a
    hostile client would, so that its own work per call is small."""
    lookup = pb.LookupRequest(session_id=session_id, epoch=epoch, namespace=NS,
                              token_ids=range(1 << 18)).SerializeToString()
    n = max(1, max_work // 8 - 256 - 8)
    huge = [pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=range(i, i + n)))
            for i in range(8)]
    return lookup, pb.StepRequest(operations=huge).SerializeToString()


def step_bytes(session_id: str, epoch: int, step_id: int, ops: bytes) -> bytes:
    """A StepRequest's bytes: its leading fields, then serialized operations (protobuf merges
    concatenated messages; the session id stays the leading field)."""
    return pb.StepRequest(session_id=session_id, epoch=epoch,
                          step_id=step_id).SerializeToString() + ops


def flood(kind: str, target: str, stop: Any, counts: Any, max_work: int, sched: str,
          nice: int) -> None:
    """One of B's flooders, until ``stop`` is set; outcomes counted in ``counts``."""
    lower(sched, nice)
    got: Counter[str] = Counter()
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 25)]
                               ) as ch:
        stub = pb_grpc.BlockdServiceStub(ch)
        raw_step = ch.unary_unary("/blockd.v1.BlockdService/Step",
                                  response_deserializer=pb.StepResponse.FromString)
        raw_lookup = ch.unary_unary("/blockd.v1.BlockdService/Lookup",
                                    response_deserializer=pb.LookupResponse.FromString)
        att = attach(stub, "b")
        step_id = 0
        lookup, ops = requests(att.session_id, att.epoch, max_work)
        while not stop.is_set():
            try:
                if kind == "lookup":
                    raw_lookup(lookup, metadata=md("b"))
                elif kind == "steps":
                    step_id += 1
                    resp = raw_step(step_bytes(att.session_id, att.epoch, step_id, ops),
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


def one_run(args: argparse.Namespace
            ) -> tuple[list[float], list[float], list[float], dict[str, Any]]:
    """One daemon: A alone, A beside B's client work only (``control``), A beside B's flood,
    A alone again."""
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
                manager = ctx.Manager()
                kinds = args.kinds.split(",")
                low = (args.flood_sched, args.flood_nice)

                def beside(target_fn: Any, extra: tuple[Any, ...]) -> tuple[list[float], Any]:
                    stop, counts = ctx.Event(), manager.dict()
                    procs = [ctx.Process(target=target_fn,
                                         args=(k, *extra, stop, counts, args.max_work, *low))
                             for k in kinds]
                    for p in procs:
                        p.start()
                    time.sleep(1.0)  # the flooders connect and spend their bursts
                    lat = a_phase(stub, att, state, args.seconds)
                    stop.set()
                    for p in procs:
                        p.join(30)
                    return lat, dict(counts)

                controlled, c_counts = beside(control, ())
                flooded, b_counts = beside(flood, (target,))
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
        "a_control": {"steps": len(controlled), "p50_ms": pct(controlled, 0.5),
                      "p99_ms": pct(controlled, 0.99)},
        "b_flood": b_counts,
        "b_control": c_counts,
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
    }
    res["ratio_p50"] = res["a_flooded"]["p50_ms"] / res["a_alone"]["p50_ms"]
    res["ratio_p99"] = res["a_flooded"]["p99_ms"] / res["a_alone"]["p99_ms"]
    res["control_ratio_p99"] = res["a_control"]["p99_ms"] / res["a_alone"]["p99_ms"]
    return alone, controlled, flooded, res


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
    ap.add_argument("--flood-sched", choices=("idle", "nice"), default=None,
                    help="B's flooder processes at SCHED_IDLE (default isolated: they run "
                         "when A's CPU has nothing else to do, as clients on other machines "
                         "would never take it from A) or at --flood-nice (default shared)")
    ap.add_argument("--flood-nice", type=int, default=None,
                    help="niceness of B's flooder processes with --flood-sched nice "
                         "(default: 19 isolated, 0 shared)")
    args = ap.parse_args(argv)
    if args.placement == "isolated" and len(CPUS) < 2:
        ap.error("--placement isolated needs 2 CPUs: use --placement shared")
    if args.flood_sched is None:
        args.flood_sched = "idle" if args.placement == "isolated" else "nice"
    if args.flood_nice is None:
        args.flood_nice = 19 if args.placement == "isolated" else 0
    runs = [one_run(args) for _ in range(args.runs)]
    figures = [r for *_, r in runs]

    def spread(get: Any) -> dict[str, float]:
        xs = [get(r) for r in figures]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    res: dict[str, Any] = {
        "budget": {"work_units_per_second": RATE, "work_units_burst": BURST},
        "max_work_per_call": args.max_work,
        "gil_switch_interval_ms": args.gil_switch_interval_ms,
        "placement": args.placement,
        "keep_awake": args.keep_awake,
        "flood_sched": args.flood_sched,
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
            "a_control_p99_ms": spread(lambda r: r["a_control"]["p99_ms"]),
            "control_ratio_p99": spread(lambda r: r["control_ratio_p99"]),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "fairness" + (f"-{args.tag}" if args.tag else "")
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    plot({"A alone": [x for r in runs for x in r[0]],
          "A beside B's client work only": [x for r in runs for x in r[1]],
          "A beside B's flood": [x for r in runs for x in r[2]]}, res, args.out / f"{name}.png")
    print(json.dumps(res["summary"], indent=1))
    return 0


def plot(phases: dict[str, list[float]], res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, xs in phases.items():
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
