"""``blockd load``: N concurrent workers streaming Steps at a daemon, for a fixed time.

Each worker is its own process with its own channel and session. It keeps ``--seqs`` sequences
running: prompts share a few system prompts (so prefix hits happen), every Step decodes one token
for every running sequence (one AppendBatchOp), commits blocks as they fill, and releases a
finished sequence and admits a new one in its place, all on one long-lived StepStream. Fences
advance every step; the worker publishes completion through Heartbeat-free ``completed_fence``.

Bounded in count and time, loopback or Unix socket only. While it runs it prints a progress
line to stderr every ``--progress`` seconds (elapsed time, workers running, steps done, steps/s
since the last line, errors so far); at the end a summary (``--json``: the result as JSON) with
steps/s, p50/p99 Step latency and every non-OK status. With ``--metrics URL`` it also reads
the daemon's invariant-check counters before and after the run (a daemon started with
``server.invariant_check_interval_ms`` checks every invariant periodically, between calls;
``server.check_invariants`` checks after every call) and reports how many checks ran during
the load and how many failed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from typing import Any, TextIO

from blockd import options
from blockd_apps.ctl import default_target, unreachable

#: How often each worker tells the parent how far it got, seconds.
WORKER_REPORT_S = 0.5


def _worker(index: int, args: dict[str, Any], out: Any) -> None:
    """One worker process: its run, or the status that ended it, reported to the parent."""
    import grpc

    try:
        _work(index, args, out)
    except grpc.RpcError as err:
        out.put(("failed", index, f"{err.code().name}: {err.details()}"))
    except Exception as exc:  # reported, not a traceback on the parent's terminal
        out.put(("failed", index, f"{type(exc).__name__}: {exc}"))


def _work(index: int, args: dict[str, Any], out: Any) -> None:
    import grpc

    from blockd.api.v1 import blockd_pb2 as pb
    from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

    rng = random.Random(1000 + index)
    md = (("authorization", f"Bearer {args['token']}"),) if args["token"] else ()
    channel = grpc.insecure_channel(args["target"])
    stub = pb_grpc.BlockdServiceStub(channel)
    layout = pb.KvLayout(**args["layout"])
    att = stub.Attach(pb.AttachRequest(worker_name=f"load-{index}", tenant_id=args["tenant"],
                                       layout=layout), metadata=md, timeout=30)
    B = att.pool.layout.block_size
    ns = pb.CacheNamespace(model_id="load", model_revision="1")
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(2, 6) * B)] for _ in range(4)]
    requests: queue.Queue[pb.StepRequest | None] = queue.Queue()
    responses = stub.StepStream(iter(requests.get, None), metadata=md,
                                timeout=args["duration"] + 120)
    step = 0
    errors: dict[str, int] = {}
    latencies: list[float] = []
    # Pool pressure is not an error: like an engine, a worker preempts a sequence whose append
    # does not fit (releases it; it would be re-admitted later) and retries an admission.
    pressure = {"preempted": 0, "admission_waits": 0}
    preempt: list[str] = []
    exhausted = 8  # RESOURCE_EXHAUSTED

    def run(ops: list[Any]) -> Any:
        nonlocal step
        step += 1
        req = pb.StepRequest(session_id=att.session_id, epoch=att.epoch, step_id=step,
                             fence=step, completed_fence=step - 1, operations=ops)
        t0 = time.perf_counter()
        requests.put(req)
        resp = next(responses)
        latencies.append(time.perf_counter() - t0)
        for op, r in zip(ops, resp.results, strict=True):
            if r.status.code == exhausted and op.WhichOneof("op") == "admit":
                pressure["admission_waits"] += 1
            elif r.status.code:
                errors[str(r.status.code)] = errors.get(str(r.status.code), 0) + 1
            if r.WhichOneof("result") == "append_batch":
                ids = op.append_batch.sequence_ids
                for e in r.append_batch.errors:
                    if e.status.code == exhausted:
                        preempt.append(ids[e.index])
                    else:
                        errors[str(e.status.code)] = errors.get(str(e.status.code), 0) + 1
        return resp

    def prompt() -> list[int]:
        return rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randint(1, 40))]

    live: dict[str, list[int]] = {}  # seq id -> [tokens, budget]

    def admit(n: int) -> None:
        resp = run([pb.Operation(admit=pb.AdmitOp(namespace=ns, token_ids=prompt()))
                    for _ in range(n)])
        for r in resp.results:
            if r.status.code == 0:
                live[r.admit.sequence_id] = [r.admit.num_tokens, rng.randint(8, 200)]

    for _ in range(0, args["seqs"], 64):
        admit(min(64, args["seqs"] - len(live)))
    out.put(("ready", index, None))
    deadline = time.monotonic() + args["duration"]
    latencies.clear()
    steps = 0
    next_report = time.monotonic() + WORKER_REPORT_S
    while (now := time.monotonic()) < deadline and steps < args["max_steps"]:
        if now >= next_report:
            out.put(("progress", index, {"steps": steps, "errors": sum(errors.values())}))
            next_report = now + WORKER_REPORT_S
        ids = list(live)
        ops = [pb.Operation(append_batch=pb.AppendBatchOp(
            sequence_ids=ids, token_ids=[rng.randrange(50_000) for _ in ids]))] if ids else []
        done = []
        for sid in ids:
            st = live[sid]
            st[0] += 1
            st[1] -= 1
            if st[0] % B == 0:
                ops.append(pb.Operation(commit=pb.CommitOp(sequence_id=sid)))
            if st[1] <= 0:
                done.append(sid)
        ops += [pb.Operation(release=pb.ReleaseOp(sequence_id=sid)) for sid in done]
        run(ops)
        for sid in done:
            del live[sid]
        if preempt:
            victims = [s for s in set(preempt) if s in live and s not in done]
            preempt.clear()
            if victims:
                run([pb.Operation(release=pb.ReleaseOp(sequence_id=s)) for s in victims])
                for s in victims:
                    del live[s]
                pressure["preempted"] += len(victims)
        if len(live) < args["seqs"]:
            admit(min(64, args["seqs"] - len(live)))
        steps += 1
    if live:
        run([pb.Operation(release=pb.ReleaseOp(sequence_id=sid)) for sid in live])
    requests.put(None)
    list(responses)
    stub.Detach(pb.DetachRequest(session_id=att.session_id), metadata=md, timeout=30)
    channel.close()
    out.put(("done", index, {"steps": steps, "latencies": latencies, "errors": errors,
                             **pressure}))


def scrape_counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Values of the named (unlabelled) metrics in a Prometheus text exposition."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


INVARIANT_COUNTERS = ("blockd_invariant_checks_total", "blockd_invariant_violations_total")


class Progress:
    """The progress lines of a run: where the workers are, every ``interval`` seconds."""

    def __init__(self, workers: int, interval: float, stream: TextIO) -> None:
        self.workers = workers
        self.interval = interval
        self.stream = stream
        self.t0 = self.last_t = time.monotonic()
        self.next_t = self.t0 + interval
        self.last_steps = 0
        self.ready: set[int] = set()
        self.done: set[int] = set()
        #: Each worker's latest report: steps done and errors so far.
        self.seen: dict[int, dict[str, int]] = {}

    def note(self, kind: str, index: int, payload: Any) -> None:
        if kind == "ready":
            self.ready.add(index)
        elif kind == "progress":
            self.seen[index] = payload
        elif kind == "failed":
            self.done.add(index)
            print(f"blockd load: worker {index} stopped: {payload}", file=self.stream,
                  flush=True)
        elif kind == "done":
            self.done.add(index)
            self.seen[index] = {"steps": payload["steps"],
                                "errors": sum(payload["errors"].values())}

    def tick(self) -> None:
        """Print a line if one is due."""
        now = time.monotonic()
        if not self.interval or now < self.next_t:
            return
        steps = sum(r["steps"] for r in self.seen.values())
        errors = sum(r["errors"] for r in self.seen.values())
        rate = (steps - self.last_steps) / (now - self.last_t)
        running = len(self.ready - self.done)
        state = (f"{running}/{self.workers} workers running" if self.ready
                 else f"starting {self.workers} workers")
        print(f"blockd load: {now - self.t0:.0f} s, {state}, {steps} steps, {rate:.0f} steps/s, "
              f"{errors} errors", file=self.stream, flush=True)
        self.last_t, self.last_steps = now, steps
        self.next_t = now + self.interval


def run(target: str, token: str, tenant: str, workers: int, seqs: int, duration: float,
        layout: dict[str, int], max_steps: int = 10**7, metrics_url: str = "",
        progress: float = 0.0, progress_stream: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the load; ``progress`` > 0: a progress line every that many seconds."""
    before = scrape_counters(metrics_url, INVARIANT_COUNTERS) if metrics_url else {}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = {"target": target, "token": token, "tenant": tenant, "seqs": seqs,
            "duration": duration, "layout": layout, "max_steps": max_steps}
    procs = [ctx.Process(target=_worker, args=(i, args, out), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failed: dict[int, str] = {}
    t0 = time.monotonic()
    limit = duration + 300
    shown = Progress(workers, progress, progress_stream)
    while len(results) + len(failed) < workers and time.monotonic() - t0 < limit:
        shown.tick()
        try:
            kind, index, payload = out.get(timeout=min(1.0, progress or 1.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
            continue
        shown.note(kind, index, payload)
        if kind == "done":
            results[index] = payload
        elif kind == "failed":
            failed[index] = payload
    for i, p in enumerate(procs):
        p.join(10)
        if p.is_alive():
            p.terminate()
        if i not in results and i not in failed:  # died without a word, or ran out of time
            failed[i] = (f"exited with code {p.exitcode} before reporting"
                         if p.exitcode is not None else "did not finish in time (terminated)")
    lat = sorted(x for r in results.values() for x in r["latencies"])
    errors: dict[str, int] = {}
    for r in results.values():
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    steps = sum(r["steps"] for r in results.values())
    preempted = sum(r["preempted"] for r in results.values())
    waits = sum(r["admission_waits"] for r in results.values())
    checks: dict[str, Any] = {}
    if metrics_url:
        after = scrape_counters(metrics_url, INVARIANT_COUNTERS)
        checks = {"invariant_checks": int(after.get(INVARIANT_COUNTERS[0], 0)
                                          - before.get(INVARIANT_COUNTERS[0], 0)),
                  "invariant_violations": int(after.get(INVARIANT_COUNTERS[1], 0)
                                              - before.get(INVARIANT_COUNTERS[1], 0))}
    return {**checks,
        "workers": workers, "workers_finished": len(results), "seqs_per_worker": seqs,
        "duration_s": duration, "steps": steps, "steps_per_s": steps / duration,
        "step_p50_ms": statistics.median(lat) * 1e3 if lat else None,
        "step_p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else None,
        "errors_by_code": errors, "preempted": preempted, "admission_waits": waits,
        "workers_failed": {str(i): why for i, why in sorted(failed.items())},
    }


def _failures(failed: dict[str, str]) -> str:
    """``; N workers failed: REASON (xK), ...``: each distinct reason once, with its count."""
    if not failed:
        return ""
    counts: dict[str, int] = {}
    for why in failed.values():
        counts[why] = counts.get(why, 0) + 1
    reasons = ", ".join(why if n == 1 else f"{why} (x{n})" for why, n in counts.items())
    return f"; {len(failed)} workers failed: {reasons}"


def main(argv: list[str] | None = None) -> int:
    p = options.Parser(prog="blockd load", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None,
                   help="unix:PATH or 127.0.0.1:PORT (default: blockctl's: $BLOCKD_TARGET, else "
                        "the daemon's default socket)")
    p.add_argument("--token", default=os.environ.get("BLOCKD_TOKEN", ""),
                   help="bearer token (default: $BLOCKD_TOKEN; none: anonymous)")
    p.add_argument("--token-file", default=None,
                   help="read the bearer token from this file, e.g. a mounted Secret "
                        "(overrides --token)")
    p.add_argument("--tenant", default="default")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seqs", type=int, default=256, help="running sequences per worker")
    p.add_argument("--duration", type=float, default=60.0, help="seconds (bounded)")
    p.add_argument("--layout", default='{"block_size": 16, "num_layers": 4, "num_kv_heads": 4, '
                   '"head_dim": 64, "dtype": 2, "kv_order": 1, "tp_size": 1}',
                   help="the pool's KvLayout as JSON (proto field names and enum numbers)")
    p.add_argument("--metrics", default="",
                   help="the daemon's metrics URL: report its invariant checks during the run")
    p.add_argument("--progress", type=float, default=5.0,
                   help="seconds between progress lines on stderr (0: none; default "
                        "%(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if args.token_file:
        from blockd_client.retry import read_token_file

        try:
            args.token = read_token_file(args.token_file)
        except ValueError as exc:
            p.error(str(exc))
    target = args.target or default_target()
    host = target.removeprefix("unix:") if target.startswith("unix:") else target.split(":")[0]
    if not (target.startswith("unix:") or host in ("127.0.0.1", "localhost", "[::1]")):
        p.error("--target must be a Unix socket or a loopback address")
    if target.startswith("unix:") and not os.path.exists(target.removeprefix("unix:")):
        print(unreachable(target, "no socket there").replace("blockctl:", "blockd load:"),
              file=sys.stderr)
        return 2
    res = run(target, args.token, args.tenant, args.workers, args.seqs,
              min(args.duration, 3600.0), json.loads(args.layout), metrics_url=args.metrics,
              progress=max(0.0, args.progress))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f} ms"

        print(f"{res['workers_finished']}/{res['workers']} workers x {res['seqs_per_worker']} "
              f"sequences for {res['duration_s']:.0f} s: {res['steps_per_s']:.0f} steps/s, "
              f"Step p50 {ms(res['step_p50_ms'])}, p99 {ms(res['step_p99_ms'])}; "
              f"preempted {res['preempted']}, admission waits {res['admission_waits']}; "
              f"errors {res['errors_by_code'] or 'none'}"
              + _failures(res["workers_failed"])
              + (f"; invariant checks {res['invariant_checks']}, violations "
                 f"{res['invariant_violations']}" if "invariant_checks" in res else ""))
    ok = (res["workers_finished"] == res["workers"] and not res["errors_by_code"]
          and not res["workers_failed"]
          and not res.get("invariant_violations"))
    return 0 if ok else 1
