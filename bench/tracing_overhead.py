"""What tracing (``tracing.*``, #28 finding 10) costs a Step, measured against the same
daemon configuration with tracing off, in one run.

Three real daemons (``blockd serve``) run side by side on the same configuration but for
``tracing``: ``off``; ``sampled`` (``sampling_ratio: 1.0``, every Step a span exported to a
real OTLP/gRPC receiver, opentelemetry-proto's TraceService, in a child process); and
``unsampled`` (``sampling_ratio: 0``: the interceptor runs, no span is recorded). One client
session on each, 16 sequences, sends unary decode Steps (one packed AppendBatchOp of 16
tokens) over the Unix socket. The modes are interleaved in chunks of ``--chunk`` Steps,
rotating which goes first, ``--reps`` times; a chunk's p50 round trip is compared with the
``off`` chunk of the same repetition (ratio per repetition), and medians [min, max] of those
ratios are reported. At the end the sampled daemon must have exported one span per call it
served (``blockd_trace_spans_exported_total``), none dropped.

Writes bench/results/tracing_overhead.json and .png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpc_step as gs  # noqa: E402 (the Step benchmark's session, config and helpers)

from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd_apps.launch import spawn, terminate  # noqa: E402

MODES = ("off", "sampled", "unsampled")
RESULTS = Path(__file__).resolve().parent / "results"


def receiver(port_out: Any, stop: Any) -> None:
    """A child process: an OTLP/gRPC trace receiver that takes every export."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

    class Service(otlp_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            return otlp.ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(2))
    otlp_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


def start(workdir: Path, mode: str, otlp_port: int) -> gs.DaemonProc:
    workdir.mkdir(parents=True)
    cfg = yaml.safe_load(gs.write_config(workdir).read_text())
    if mode != "off":
        cfg["tracing"] = {"otlp_endpoint": f"127.0.0.1:{otlp_port}", "insecure": True,
                          "sampling_ratio": 1.0 if mode == "sampled" else 0.0,
                          "schedule_delay_ms": 1000}
    path = workdir / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lines: deque[str] = deque(maxlen=200)
    launched = spawn(path, workdir, lines=lines)
    return gs.DaemonProc(launched.proc, launched.endpoints, lines)


def metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def chunk(session: gs.Session, template: pb.StepRequest, n: int) -> list[float]:
    out = []
    for _ in range(n):
        req = session.advance(template)
        t0 = time.perf_counter()
        resp = session.stub.Step(req, metadata=gs.METADATA, timeout=gs.CALL_TIMEOUT_S)
        out.append(time.perf_counter() - t0)
        gs.check(req, resp)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--chunk", type=int, default=300)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULTS / "tracing_overhead.json")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    recv = ctx.Process(target=receiver, args=(port_q, stop), daemon=True)
    recv.start()
    otlp_port = port_q.get(timeout=60)
    rng = random.Random(0)
    daemons: dict[str, gs.DaemonProc] = {}
    calls = dict.fromkeys(MODES, 0)
    p50: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        with tempfile.TemporaryDirectory(prefix="blockd-trace-bench-") as tmp:
            sessions, templates = {}, {}
            for mode in MODES:
                daemons[mode] = start(Path(tmp) / mode, mode, otlp_port)
                sessions[mode] = gs.Session(gs.open_channel(daemons[mode].target), gs.WORKER)
                calls[mode] += 1  # the Attach
                seqs = gs.admit_sequences(sessions[mode], args.sequences, rng)
                calls[mode] += -(-args.sequences // 64)
                templates[mode] = gs.decode_template(seqs)
                chunk(sessions[mode], templates[mode], 50)  # warm-up
                calls[mode] += 50
            for rep in range(args.reps):
                order = MODES[rep % 3:] + MODES[:rep % 3]
                for mode in order:
                    lat = chunk(sessions[mode], templates[mode], args.chunk)
                    calls[mode] += args.chunk
                    p50[mode].append(statistics.median(lat) * 1e6)
            url = daemons["sampled"].metrics_url
            deadline = time.monotonic() + 30
            while (metric(url, "blockd_trace_spans_exported_total") < calls["sampled"]
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            spans = {k: metric(url, f"blockd_trace_spans_{k}_total")
                     for k in ("exported", "dropped", "failed")}
            unsampled = metric(daemons["unsampled"].metrics_url,
                               "blockd_trace_spans_exported_total")
    finally:
        for d in daemons.values():
            terminate(d.proc)
        stop.set()
        recv.join(10)

    def ratios(mode: str) -> list[float]:
        return [a / b for a, b in zip(p50[mode], p50["off"], strict=True)]

    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    results = {
        "what": "unary decode Step round trip (p50 per chunk, us) with tracing off, sampled "
                "(every Step a span exported over OTLP/gRPC) and unsampled (ratio 0)",
        "machine": {"python": platform.python_version(), "cpus": mp.cpu_count()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "p50_us": {m: spread(p50[m]) for m in MODES},
        "p50_us_per_rep": p50,
        "ratio_vs_off": {m: spread(ratios(m)) for m in ("sampled", "unsampled")},
        "ratio_vs_off_per_rep": {m: ratios(m) for m in ("sampled", "unsampled")},
        "sampled_calls": calls["sampled"], "sampled_spans": spans,
        "unsampled_spans_exported": unsampled,
    }
    ok = spans["exported"] == calls["sampled"] and spans["dropped"] == 0 and unsampled == 0
    results["spans_accounted"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    for m in MODES:
        s = results["p50_us"][m]
        print(f"{m:>10}: p50 {s['median']:.0f} us [{s['min']:.0f}, {s['max']:.0f}]")
    for m in ("sampled", "unsampled"):
        r = results["ratio_vs_off"][m]
        print(f"{m:>10} / off: x{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")
    print(f"sampled daemon: {calls['sampled']} calls, spans {spans}; unsampled exported "
          f"{unsampled}; accounted: {ok}")
    return 0 if ok else 1


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    per = results["p50_us_per_rep"]
    a.boxplot([per[m] for m in MODES], tick_labels=list(MODES))
    a.set_ylabel("Step round trip p50 per chunk (us)")
    a.set_title("tracing off / sampled / unsampled")
    rr = results["ratio_vs_off_per_rep"]
    for i, m in enumerate(("sampled", "unsampled")):
        b.plot(range(len(rr[m])), rr[m], "o-", label=f"{m} / off", color=f"C{i + 1}")
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_xlabel("repetition")
    b.set_ylabel("p50 ratio vs off, same repetition")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
