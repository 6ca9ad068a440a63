"""Step latency of a real blockd daemon over its Unix socket, next to the transport itself.

What is measured, all in one run against one daemon subprocess (``blockd serve``, started by
``blockd_apps.launch``):

* Round-trip latency (p50/p99, microseconds) of a decode Step appending one token to each of 1,
  64 or 256 sequences, encoded either as that many AppendOps (``append_ops``) or as one packed
  AppendBatchOp (``append_batch``, the decode path workers should use), sent (a) as unary
  ``Step`` and (b) on one long-lived bidirectional ``StepStream`` (send one request, wait for its
  response).
* The same for ``/blockd.bench.Echo/Echo`` (``server.enable_echo``), a generic unary method on the
  same server and event loop that returns its request bytes unchanged, sent the serialized bytes
  of a StepRequest of the same batch size. Echo is the transport baseline: HTTP/2 framing, the
  gRPC core and the asyncio server, with no protobuf parsing and no daemon work.
* ratio = Step / echo, for p50 and p99, unary and stream. The issue's target is a ratio under
  1.5x at batch 256: the daemon's own work (parse, apply 256 appends, build the response) stays
  small next to the cost of getting the bytes there and back.
* The daemon's own mean time per Step, from its Prometheus histogram
  ``blockd_step_duration_seconds`` (sum/count scraped before and after each timed chunk). That
  timer covers session lookup, the operations and building the response message; it excludes
  gRPC (de)serialization, which the round trips include.
* Steps/s with 4 concurrent workers: 4 spawned processes, each its own channel and session with
  64 sequences, streaming batch-64 decode Steps on StepStream as fast as it can for a fixed time.

Why the timed loops look the way they do: the machines this runs on are small and noisy, so the
three modes are interleaved in short chunks (rotating which goes first) instead of run one after
the other, and only medians, p99s and same-run ratios are reported. Requests are built before the
clock starts (a template whose step_id/fence fields are advanced in place); the client's
serialization of the request and parsing of the response are inside the timed region for Step, and
the request's serialization is inside it for echo, because a real worker pays both.

The streaming client is grpc's synchronous API fed by a queue: grpc consumes the request iterator
on its own thread, so each stream round trip includes one thread hand-off on the client. A
synchronous scheduler loop in a worker would pay the same.

Every StepResponse is checked: one result per operation, every status.code == 0 (else it fails).
Writes bench/results/grpc_step.json and bench/results/grpc_step.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime.tenants_file import token_hash
from blockd_apps.launch import spawn, terminate

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "bench-token"
WORKER = "bench"
TENANT = "bench"
BLOCK_SIZE = 16
# 131072 blocks of a one-layer, one-head, head_dim-8 layout: 64 MiB of shared memory, and far
# more blocks than the run can fill (nothing is ever released, so the pool never recycles).
NUM_BLOCKS = 131_072
LAYOUT = pb.KvLayout(block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype=pb.KV_DTYPE_FLOAT16, kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                     tp_size=1)
NAMESPACE = pb.CacheNamespace(model_id="bench-model", model_revision="r1")
METADATA = (("authorization", f"Bearer {TOKEN}"),)
ECHO_METHOD = "/blockd.bench.Echo/Echo"
BATCHES = (1, 64, 256)
MODES = ("unary", "stream", "echo")
CALL_TIMEOUT_S = 30.0  # any single round trip slower than this is a hang, not a measurement
TARGET_RATIO = 1.5


# -- the daemon ------------------------------------------------------------------------------


@dataclass
class DaemonProc:
    proc: subprocess.Popen[str]
    endpoints: dict[str, str]
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))

    @property
    def target(self) -> str:
        return f"unix:{self.endpoints['unix']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.endpoints['metrics']}/metrics"

    def stop(self) -> int:
        return terminate(self.proc)


def write_config(workdir: Path) -> Path:
    """The daemon's YAML and tenants file: one tenant owning the whole pool, one worker."""
    tenants = {
        "tenants": [{"id": TENANT, "quota_blocks": NUM_BLOCKS, "sharing": "private"}],
        "workers": [{"name": WORKER, "token_sha256": token_hash(TOKEN), "tenants": [TENANT]}],
    }
    tenants_path = workdir / "tenants.yaml"
    tenants_path.write_text(yaml.safe_dump(tenants))
    cfg = {
        "server": {"unix_socket": str(workdir / "blockd.sock"), "tcp_address": "",
                   "handle_socket": str(workdir / "pool.sock"), "grace_seconds": 2.0,
                   "check_invariants": False, "enable_echo": True},
        # A rendering per scrape: the server-side histogram is read before and after each chunk.
        "metrics": {"address": "127.0.0.1:0", "cache_ms": 0},
        "pool": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "num_layers": 1,
                 "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"},
        # A long lease and a lazy reaper: nothing expires mid-run and the reaper stays out of
        # the event loop's way.
        "lease": {"default_ms": 300_000, "max_ms": 300_000, "reap_interval_ms": 1000},
        "tenants": {"file": str(tenants_path), "allow_anonymous": False},
        "log": {"level": "WARNING"},
    }
    cfg_path = workdir / "blockd.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    return cfg_path


def start_daemon(workdir: Path) -> DaemonProc:
    """Start ``blockd serve`` and wait for its ``BLOCKD_READY {endpoints}`` line."""
    cfg_path = write_config(workdir)
    lines: deque[str] = deque(maxlen=200)
    launched = spawn(cfg_path, workdir, lines=lines)
    return DaemonProc(launched.proc, launched.endpoints, lines)


def scrape_step_histogram(url: str) -> tuple[float, int]:
    """(sum seconds, count) of blockd_step_duration_seconds."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("blockd_step_duration_seconds_sum "):
            total = float(line.split()[1])
        elif line.startswith("blockd_step_duration_seconds_count "):
            count = int(float(line.split()[1]))
    return total, count


# -- the client side -------------------------------------------------------------------------


def open_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", 16 << 20),
        ("grpc.max_send_message_length", 16 << 20)])


class Session:
    """One attached session; numbers its steps so fences advance and complete one by one."""

    def __init__(self, channel: grpc.Channel, name: str) -> None:
        self.stub = pb_grpc.BlockdServiceStub(channel)
        att = self.stub.Attach(pb.AttachRequest(worker_name=name, tenant_id=TENANT,
                                                layout=LAYOUT), metadata=METADATA,
                               timeout=CALL_TIMEOUT_S)
        self.sid = att.session_id
        self.epoch = att.epoch
        self.step_id = 0

    def advance(self, req: pb.StepRequest) -> pb.StepRequest:
        """Give ``req`` the next step_id; fence = step number, the previous fence completes
        (the "GPU" finished the last step), so nothing stays pending in the daemon."""
        self.step_id += 1
        req.session_id = self.sid
        req.epoch = self.epoch
        req.step_id = self.step_id
        req.fence = self.step_id
        req.completed_fence = self.step_id - 1
        return req

    def step(self, ops: list[pb.Operation]) -> pb.StepResponse:
        req = self.advance(pb.StepRequest(operations=ops))
        resp = self.stub.Step(req, metadata=METADATA, timeout=CALL_TIMEOUT_S)
        check(req, resp)
        return resp

    def detach(self) -> None:
        self.stub.Detach(pb.DetachRequest(session_id=self.sid), metadata=METADATA,
                         timeout=CALL_TIMEOUT_S)


def check(req: pb.StepRequest, resp: pb.StepResponse) -> None:
    """Fail loudly unless every operation of the step succeeded."""
    if resp.step_id != req.step_id or len(resp.results) != len(req.operations):
        raise RuntimeError(f"step {req.step_id}: answered step {resp.step_id} with "
                           f"{len(resp.results)} results for {len(req.operations)} operations")
    for i, result in enumerate(resp.results):
        if result.status.code != 0:
            raise RuntimeError(f"step {req.step_id} operations[{i}]: code {result.status.code} "
                               f"{result.status.message} ({result.status.field})")
        if result.WhichOneof("result") == "append_batch" and result.append_batch.errors:
            e = result.append_batch.errors[0]
            raise RuntimeError(f"step {req.step_id} operations[{i}] entry {e.index}: "
                               f"code {e.status.code} {e.status.message}")


def admit_sequences(session: Session, n: int, rng: random.Random, per_step: int = 64
                    ) -> list[str]:
    """Admit ``n`` sequences with random 16..64-token prompts, ``per_step`` admits per Step."""
    seqs: list[str] = []
    while len(seqs) < n:
        ops = [pb.Operation(admit=pb.AdmitOp(
                   namespace=NAMESPACE,
                   token_ids=[rng.randrange(32_000) for _ in range(rng.randint(16, 64))]))
               for _ in range(min(per_step, n - len(seqs)))]
        seqs.extend(r.admit.sequence_id for r in session.step(ops).results)
    return seqs


ENCODINGS = ("append_ops", "append_batch")


def decode_template(seqs: list[str], encoding: str = "append_batch") -> pb.StepRequest:
    """One decode step appending one token to each sequence (ids are filled by advance):
    one AppendOp per sequence, or one packed AppendBatchOp for all of them."""
    if encoding == "append_batch":
        return pb.StepRequest(operations=[pb.Operation(append_batch=pb.AppendBatchOp(
            sequence_ids=seqs, token_ids=[7] * len(seqs)))])
    return pb.StepRequest(operations=[
        pb.Operation(append=pb.AppendOp(sequence_id=s, token_ids=[7])) for s in seqs])


class StepStreamClient:
    """One long-lived StepStream: a queue feeds grpc's request iterator, one response per put."""

    def __init__(self, stub: pb_grpc.BlockdServiceStub, timeout: float) -> None:
        self._q: queue.Queue[pb.StepRequest | None] = queue.Queue()
        self._responses = stub.StepStream(iter(self._q.get, None), metadata=METADATA,
                                          timeout=timeout)

    def round_trip(self, req: pb.StepRequest) -> pb.StepResponse:
        self._q.put(req)
        return next(self._responses)

    def close(self) -> None:
        """Half-close and drain: the stream must end with OK, not be cancelled."""
        self._q.put(None)
        leftover = list(self._responses)
        if leftover:
            raise RuntimeError(f"StepStream answered {len(leftover)} unrequested responses")


def pct(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    i = min(len(sorted_xs) - 1, max(0, round(q / 100 * len(sorted_xs) + 0.5) - 1))
    return sorted_xs[i]


def summarize(samples_s: list[float]) -> dict[str, float]:
    xs = sorted(x * 1e6 for x in samples_s)
    return {"p50_us": pct(xs, 50), "p99_us": pct(xs, 99), "mean_us": sum(xs) / len(xs),
            "min_us": xs[0], "n": len(xs)}


# -- single-client latency -------------------------------------------------------------------


RoundTrip = Callable[[pb.StepRequest], Any]


def make_round_trips(session: Session, stream: StepStreamClient,
                     echo: grpc.UnaryUnaryMultiCallable) -> dict[str, RoundTrip]:
    """One callable per mode; each times nothing itself and checks after the clock stops."""

    def unary(req: pb.StepRequest) -> Any:
        return session.stub.Step(req, metadata=METADATA, timeout=CALL_TIMEOUT_S)

    def streamed(req: pb.StepRequest) -> Any:
        return stream.round_trip(req)

    def echoed(req: pb.StepRequest) -> Any:
        # Serialized inside the clock, as the Step stub serializes inside its call.
        return echo(req.SerializeToString(), timeout=CALL_TIMEOUT_S)

    return {"unary": unary, "stream": streamed, "echo": echoed}


def timed_chunk(mode: str, call: RoundTrip, session: Session,
                template: pb.StepRequest, n: int) -> list[float]:
    """``n`` round trips of one mode; returns seconds per round trip."""
    out = []
    for _ in range(n):
        # Echo never reaches the daemon's Step, so it must not consume a step_id: the ids the
        # daemon sees stay contiguous and every completed_fence names the previous fence.
        req = template if mode == "echo" else session.advance(template)
        t0 = time.perf_counter()
        resp = call(req)
        out.append(time.perf_counter() - t0)
        if mode == "echo":
            if len(resp) != req.ByteSize():
                raise RuntimeError(f"echo returned {len(resp)} bytes for {req.ByteSize()}")
        else:
            check(req, resp)
    return out


def bench_batch(session: Session, calls: dict[str, RoundTrip], seqs: list[str], batch: int,
                warmup: int, steps: int, chunk: int, metrics_url: str, encoding: str
                ) -> dict[str, Any]:
    """Interleave the three modes in chunks; server-side mean from the histogram deltas."""
    template = decode_template(seqs[:batch], encoding)
    for mode in MODES:
        timed_chunk(mode, calls[mode], session, template, warmup)
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    server = {m: [0.0, 0] for m in ("unary", "stream")}
    rounds = max(1, -(-steps // chunk))
    for r in range(rounds):
        n = min(chunk, steps - r * chunk)
        # Rotate the order so that no mode always runs right after another's burst.
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            before = scrape_step_histogram(metrics_url) if mode != "echo" else None
            samples[mode].extend(timed_chunk(mode, calls[mode], session, template, n))
            if before is not None:
                after = scrape_step_histogram(metrics_url)
                server[mode][0] += after[0] - before[0]
                server[mode][1] += after[1] - before[1]
    out: dict[str, Any] = {m: summarize(samples[m]) for m in MODES}
    for mode, (total, count) in server.items():
        if count != len(samples[mode]):
            raise RuntimeError(f"batch {batch} {mode}: the daemon counted {count} steps, "
                               f"the client sent {len(samples[mode])}")
        out[mode]["server_mean_us"] = total / count * 1e6
    probe = session.advance(template)
    resp = session.stub.Step(probe, metadata=METADATA, timeout=CALL_TIMEOUT_S)
    check(probe, resp)
    out["request_bytes"] = probe.ByteSize()
    out["response_bytes"] = resp.ByteSize()
    for mode in ("unary", "stream"):
        out[f"ratio_{mode}_p50"] = out[mode]["p50_us"] / out["echo"]["p50_us"]
        out[f"ratio_{mode}_p99"] = out[mode]["p99_us"] / out["echo"]["p99_us"]
    return out


def run_latency(daemon: DaemonProc, args: argparse.Namespace) -> dict[str, Any]:
    channel = open_channel(daemon.target)
    stream = None
    try:
        session = Session(channel, "latency")
        seqs = admit_sequences(session, max(BATCHES), random.Random(1))
        echo = channel.unary_unary(ECHO_METHOD, request_serializer=None,
                                   response_deserializer=None)
        stream = StepStreamClient(session.stub, timeout=args.budget_s)
        calls = make_round_trips(session, stream, echo)
        results: dict[str, Any] = {}
        for encoding in ENCODINGS:
            results[encoding] = {}
            for batch in BATCHES:
                steps = args.steps_256 if batch == 256 else args.steps
                t0 = time.monotonic()
                results[encoding][str(batch)] = bench_batch(
                    session, calls, seqs, batch, args.warmup, steps, args.chunk,
                    daemon.metrics_url, encoding)
                print(f"  {encoding} batch {batch:3d}: {time.monotonic() - t0:.1f} s",
                      flush=True)
        stream.close()
        stream = None
        session.detach()
        return results
    finally:
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
        channel.close()


# -- 4 concurrent workers --------------------------------------------------------------------


def worker_main(index: int, target: str, nseq: int, duration_s: float, max_steps: int,
                go: Any, out: Any) -> None:
    """One worker process: attach, admit, then stream decode Steps until time is up."""
    try:
        channel = open_channel(target)
        session = Session(channel, f"worker-{index}")
        seqs = admit_sequences(session, nseq, random.Random(100 + index))
        template = decode_template(seqs, "append_batch")
        stream = StepStreamClient(session.stub, timeout=duration_s + 60)
        check_req = session.advance(template)
        check(check_req, stream.round_trip(check_req))  # the stream is up before the clock
        out.put(("ready", index, None))
        if not go.wait(60):
            raise RuntimeError("never told to start")
        steps = 0
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        while steps < max_steps and time.perf_counter() < deadline:
            req = session.advance(template)
            check(req, stream.round_trip(req))
            steps += 1
        elapsed = time.perf_counter() - t0
        stream.close()
        session.detach()
        channel.close()
        out.put(("done", index, {"steps": steps, "elapsed_s": elapsed}))
    except Exception as exc:  # reported to the parent, which fails the run
        out.put(("error", index, f"{type(exc).__name__}: {exc}"))


def run_concurrent(daemon: DaemonProc, workers: int, batch: int, duration_s: float
                   ) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    out = ctx.Queue()
    max_steps = int(duration_s * 20_000)  # a bound on the loop, far above any real rate
    procs = [ctx.Process(target=worker_main, args=(i, daemon.target, batch, duration_s,
                                                   max_steps, go, out), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        collect(out, "ready", workers, timeout=90)
        before = scrape_step_histogram(daemon.metrics_url)
        go.set()
        done = collect(out, "done", workers, timeout=duration_s + 60)
        after = scrape_step_histogram(daemon.metrics_url)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join()
    per_worker = [done[i]["steps"] / done[i]["elapsed_s"] for i in range(workers)]
    total_steps = sum(done[i]["steps"] for i in range(workers))
    server_s = after[0] - before[0]
    total = sum(per_worker)
    return {"workers": workers, "batch": batch, "duration_s": duration_s,
            "steps_per_s": total, "per_worker_steps_per_s": per_worker,
            "appends_per_s": total * batch, "steps": total_steps,
            "server_mean_us": server_s / max(1, after[1] - before[1]) * 1e6,
            # Share of the wall time the daemon spent inside Step (its one event loop).
            "server_busy_fraction": server_s / duration_s}


def collect(out: Any, kind: str, n: int, timeout: float) -> dict[int, Any]:
    """Wait for ``n`` messages of ``kind`` from the workers; any error fails the run."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"workers: only {len(got)}/{n} {kind} after {timeout:.0f} s")
        try:
            what, index, payload = out.get(timeout=left)
        except queue.Empty:
            continue
        if what == "error":
            raise RuntimeError(f"worker {index} failed: {payload}")
        if what == kind:
            got[index] = payload
    return got


# -- reporting -------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat = results["latency"]["append_batch"]
    batches = [str(b) for b in BATCHES]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.26
    colors = {"unary": "tab:blue", "stream": "tab:orange", "echo": "tab:gray"}
    for k, mode in enumerate(MODES):
        xs = [i + (k - 1) * width for i in range(len(batches))]
        p50 = [lat[b][mode]["p50_us"] for b in batches]
        p99 = [lat[b][mode]["p99_us"] for b in batches]
        ax1.bar(xs, p50, width, color=colors[mode], label=f"{mode} p50")
        ax1.scatter(xs, p99, marker="_", s=300, color="black", zorder=3,
                    label="p99" if k == 0 else None)
        if mode != "echo":
            ax1.scatter(xs, [lat[b][mode]["server_mean_us"] for b in batches], marker="x",
                        color="red", zorder=3, label="daemon mean (histogram)" if k == 0 else None)
    ax1.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax1.set_yscale("log")
    # Head room above the p99 marks for the legend.
    ax1.set_ylim(top=8 * max(lat[b][m]["p99_us"] for b in batches for m in MODES))
    ax1.set_ylabel("round trip, µs")
    ax1.set_title("Step (one AppendBatchOp) vs echo over the Unix socket")
    ax1.legend(fontsize=8, ncol=2, loc="upper left")
    for encoding, style in (("append_batch", "-"), ("append_ops", "--")):
        enc = results["latency"][encoding]
        for mode, marker in (("unary", "o"), ("stream", "s")):
            ax2.plot(batches, [enc[b][f"ratio_{mode}_p50"] for b in batches], style,
                     marker=marker, color=colors[mode], label=f"{encoding} {mode} p50")
    ax2.axhline(TARGET_RATIO, color="red", lw=0.8, ls=":", label=f"target {TARGET_RATIO}x")
    ax2.set_xlabel("appends per Step")
    ax2.set_ylabel("Step / echo")
    ax2.set_title("Daemon overhead relative to the transport")
    ax2.legend(fontsize=8)
    conc = results["concurrent"]
    fig.suptitle(f"blockd gRPC Step, {results['machine']['cpu_count']} CPUs; "
                 f"{conc['workers']} workers x batch {conc['batch']}: "
                 f"{conc['steps_per_s']:.0f} steps/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(results: dict[str, Any]) -> None:
    for encoding in ENCODINGS:
        lat = results["latency"][encoding]
        print(f"\n{encoding}: Step latency over the Unix socket (µs; ratio = Step / echo of the"
              " same request bytes, same run)")
        print(f"{'batch':>5} {'mode':>6} {'p50':>8} {'p99':>8} {'daemon':>8} "
              f"{'r_p50':>6} {'r_p99':>6}")
        for b in map(str, BATCHES):
            for mode in MODES:
                m = lat[b][mode]
                server = f"{m['server_mean_us']:8.0f}" if "server_mean_us" in m else f"{'':8}"
                ratios = (f"{lat[b][f'ratio_{mode}_p50']:6.2f} "
                          f"{lat[b][f'ratio_{mode}_p99']:6.2f}" if mode != "echo" else "")
                print(f"{b:>5} {mode:>6} {m['p50_us']:8.0f} {m['p99_us']:8.0f} {server} "
                      f"{ratios}")
        b = lat["256"]
        verdict = ("met" if max(b["ratio_unary_p50"], b["ratio_stream_p50"]) < TARGET_RATIO
                   else "NOT met")
        print(f"at 256 appends ({encoding}): unary {b['ratio_unary_p50']:.2f}x "
              f"(p99 {b['ratio_unary_p99']:.2f}x), stream {b['ratio_stream_p50']:.2f}x "
              f"(p99 {b['ratio_stream_p99']:.2f}x) of echo; target < {TARGET_RATIO}x at p50: "
              f"{verdict}")
    c = results["concurrent"]
    per = ", ".join(f"{x:.0f}" for x in c["per_worker_steps_per_s"])
    print(f"{c['workers']} workers x batch {c['batch']} on StepStream: {c['steps_per_s']:.0f} "
          f"steps/s ({per} per worker), {c['appends_per_s']:.0f} appends/s; daemon "
          f"{c['server_mean_us']:.0f} µs/step, busy {c['server_busy_fraction']:.0%} in Step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="timed steps per mode, batch 1/64")
    ap.add_argument("--steps-256", type=int, default=300, help="timed steps per mode, batch 256")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--chunk", type=int, default=50, help="steps per interleaved chunk")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--worker-batch", type=int, default=64)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of concurrent steps")
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="deadline of the latency phase's long-lived stream")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    load_before = os.getloadavg()  # context for the noise: other work on the same cores
    with tempfile.TemporaryDirectory(prefix="blockd-bench-") as tmp:
        daemon = start_daemon(Path(tmp))
        try:
            print(f"daemon up at {daemon.target}; single-client latency", flush=True)
            latency = run_latency(daemon, args)
            print(f"{args.workers} concurrent workers for {args.duration:.0f} s", flush=True)
            concurrent = run_concurrent(daemon, args.workers, args.worker_batch, args.duration)
        except BaseException:
            print("daemon output (last lines):\n" + "".join(daemon.lines), file=sys.stderr)
            raise
        finally:
            rc = daemon.stop()
        if rc != 0:
            raise RuntimeError(f"the daemon exited with {rc}:\n" + "".join(daemon.lines))

    results = {
        "benchmark": "grpc_step",
        "description": __doc__.splitlines()[0],
        "config": {"transport": "unix socket", "block_size": BLOCK_SIZE,
                   "num_blocks": NUM_BLOCKS, "batches": list(BATCHES), "steps": args.steps,
                   "steps_256": args.steps_256, "warmup": args.warmup, "chunk": args.chunk,
                   "tokens_per_append": 1, "check_invariants": False,
                   "stream_client": "grpc sync API, queue-fed request iterator",
                   "workers": args.workers, "worker_batch": args.worker_batch,
                   "duration_s": args.duration},
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "grpcio": grpc.__version__,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "latency": latency,
        "concurrent": concurrent,
        # The daemon logs at WARNING: anything it said (errors, cancelled calls) is a finding.
        "daemon_log": [line.rstrip() for line in daemon.lines
                       if not line.startswith("BLOCKD_READY ")],
        "wall_s": time.monotonic() - t_start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grpc_step.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "grpc_step.png")
    print_summary(results)
    if results["daemon_log"]:
        print(f"daemon logged {len(results['daemon_log'])} lines (see the JSON):")
        print("\n".join(results["daemon_log"][-5:]))
    print(f"\nwrote {args.out / 'grpc_step.json'} and {args.out / 'grpc_step.png'} "
          f"({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
