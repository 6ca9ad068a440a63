"""What a flood of 8-byte replay requests costs the daemon, before and after, in one run.

Issue 28, finding 8: without CURVE the KV-event replay socket answered every 8-byte request
with the whole replay buffer (3.97 MB), also after the sender left. For each source tree given
(``--source NAME=DIR``, as bench/metrics_scrape.py: the daemon runs ``DIR``'s code), this
starts ``blockd serve`` with events and replay on (default limits), fills the replay buffer
with ``--batches`` batches (a group tenant's committed prefixes, ``--seqs`` per Step, one batch
per Step), then a DEALER sends ``--requests`` replay requests from sequence 0 and leaves at
once. It reports the daemon's CPU seconds from the first request until every request was
answered and the process is idle again (``/proc/PID/stat``), the requests answered with
batches and with the end marker only, and the bytes the answers carried (``replay_bytes`` where
the daemon counts them; before, every answer was the whole buffer). Writes
bench/results/replay_flood.json. No timed assertion: the figures are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from source_daemon import LAYOUT, NS, cpu_seconds, daemon, metrics, write_config  # noqa: E402

from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MD = (("authorization", "Bearer tok-g"),)  # worker w-g


def _metrics(address: str) -> dict[str, float]:
    return metrics(address, "blockd_kv_event_")


def _fill(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace) -> None:
    att = stub.Attach(pb.AttachRequest(worker_name="w-g", tenant_id="g", layout=LAYOUT),
                      metadata=MD)
    step_id = fence = 0

    def step(ops: list[pb.Operation], with_fence: bool) -> pb.StepResponse:
        nonlocal step_id, fence
        step_id += 1
        fence += with_fence
        resp: pb.StepResponse = stub.Step(pb.StepRequest(
            session_id=att.session_id, epoch=att.epoch, step_id=step_id,
            fence=fence if with_fence else 0, operations=ops), metadata=MD)
        return resp

    for b in range(args.batches):
        base = 1 + b * args.seqs * 20
        resp = step([pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=list(
            range(base + i * 20, base + i * 20 + 17)))) for i in range(args.seqs)], False)
        seqs = [r.admit.sequence_id for r in resp.results]
        step([pb.Operation(commit=pb.CommitOp(sequence_id=s)) for s in seqs], True)
        stub.Heartbeat(pb.HeartbeatRequest(session_id=att.session_id, epoch=att.epoch,
                                           completed_fence=fence), metadata=MD)
        step([pb.Operation(release=pb.ReleaseOp(sequence_id=s)) for s in seqs], False)


def measure(name: str, source: Path, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = write_config(
            work, [{"id": "g", "quota_blocks": 1024, "sharing": "group", "group": "x",
                    "work_units_per_second": 0}], 2048,
            events={"zmq_endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                    "topic": "kv@bench@model", "batch_ms": 0})
        with daemon(source, cfg, work) as launched:
            ep, pid = launched.endpoints, launched.proc.pid
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)  # the live stream: what the replay buffer holds
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.connect(ep["kv_events"])
            time.sleep(0.3)
            ch = grpc.insecure_channel(f"unix:{ep['unix']}")
            _fill(pb_grpc.BlockdServiceStub(ch), args)
            ch.close()
            sizes: dict[int, int] = {}
            while sub.poll(1000):
                topic, seq, payload = sub.recv_multipart()
                sizes[int.from_bytes(seq, "big")] = len(topic) + len(seq) + len(payload)
            sub.close(linger=0)
            kept = sorted(sizes)[-args.batches:]  # the newest replay_buffer batches
            batches, buffer_bytes = len(kept), sum(sizes[k] for k in kept)
            before = _metrics(ep["metrics"])
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            attacker = ctx.socket(zmq.DEALER)
            attacker.connect(ep["kv_replay"])
            for _ in range(args.requests):
                attacker.send_multipart([b"", bytes(8)])
            attacker.close(linger=5000)  # the sender leaves once its requests are out
            ctx.term()
            answered_key = ("blockd_kv_event_replays_served_total",
                            "blockd_kv_event_replays_limited_total")
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                now = _metrics(ep["metrics"])
                if sum(now.get(k, 0) - before.get(k, 0) for k in answered_key) >= args.requests:
                    break
                time.sleep(0.1)
            last = cpu_seconds(pid)
            while True:  # until the process is idle (the ZMQ I/O thread's sends included)
                time.sleep(0.5)
                cur = cpu_seconds(pid)
                if cur - last < 0.02:
                    break
                last = cur
            cpu_s, wall_s = cur - cpu0, time.perf_counter() - t0
            after = _metrics(ep["metrics"])

    def delta(key: str) -> float | None:
        k = f"blockd_kv_event_{key}_total"
        return after[k] - before.get(k, 0) if k in after else None

    row = {"source": name, "buffer_batches": batches, "buffer_bytes": buffer_bytes,
           "requests": args.requests, "daemon_cpu_seconds": cpu_s, "wall_seconds": wall_s,
           "served": delta("replays_served"), "limited": delta("replays_limited"),
           "truncated": delta("replays_truncated"), "replay_bytes": delta("replay_bytes")}
    if row["replay_bytes"] is None:  # before the fix every served answer was the buffer
        row["replay_bytes_derived"] = (row["served"] or 0) * buffer_bytes
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--batches", type=int, default=10_000, help="the default replay_buffer")
    ap.add_argument("--seqs", type=int, default=2, help="sequences committed per batch")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", default=str(RESULTS / "replay_flood.json"))
    args = ap.parse_args()
    rows = [measure(n, Path(d).resolve(), args)
            for n, _, d in (s.partition("=") for s in args.source)]
    by = {r["source"]: r for r in rows}
    summary = {}
    if "old" in by and "new" in by:
        old_bytes = by["old"].get("replay_bytes_derived") or by["old"]["replay_bytes"]
        summary = {"cpu_old_over_new": (by["old"]["daemon_cpu_seconds"]
                                        / max(by["new"]["daemon_cpu_seconds"], 0.01)),
                   "bytes_old_over_new": old_bytes / max(by["new"]["replay_bytes"] or 1, 1)}
    out = {"args": {k: v for k, v in vars(args).items() if k != "out"},
           "python": platform.python_version(), "cpus": os.cpu_count(), "rows": rows,
           "summary": summary,
           "command": "python bench/replay_flood.py " + " ".join(sys.argv[1:])}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
