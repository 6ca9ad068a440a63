"""What crash recovery costs: the journal on the Step path, snapshots, and a restart.

Measured in one run:

* Step round-trip latency (p50/p99, microseconds) of decode Steps (one AppendBatchOp appending
  one token to each of 1, 64 or 256 sequences) on a StepStream, against two daemons started
  from the same configuration except ``state.dir``: one without crash recovery (baseline), one
  journalling every Step to a private directory on /dev/shm. Chunks of the two alternate, so
  both see the same machine noise; the ratio journal/baseline is the overhead.
* Journal bytes per Step (file growth over the timed Steps).
* Snapshot cost at scale, in process: a BlockManager of 200,000 blocks holding 2,000 sequences
  of 50 committed, indexed blocks (100,000 blocks and their prefix-index entries): time to
  ``snapshot.dump`` and ``snapshot.load`` (median of 3) and the bytes per block. The daemon
  snapshots when the journal outgrows max(state.snapshot_min_bytes, 2 x the last snapshot), so
  a snapshot's cost is amortised over at least as many journal bytes as it writes.
* Restart: the journalling daemon is killed with SIGKILL and started again; the daemon's own
  "recovered" log line says how many journal records it replayed and how long recovery took.

Writes bench/results/journal_overhead.json and bench/results/journal_overhead.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpc_step as gs  # noqa: E402 (the Step benchmark's client and daemon helpers)

from blockd.core import snapshot  # noqa: E402
from blockd.core.manager import BlockManager  # noqa: E402
from blockd.core.namespace import PrefixScope  # noqa: E402
from blockd.core.spec import PoolSpec  # noqa: E402
from blockd.core.tenants import TenantPolicy  # noqa: E402
from blockd_apps.launch import spawn  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCHES = (1, 64, 256)


def start(workdir: Path, state_dir: Path | None) -> gs.DaemonProc:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = gs.write_config(workdir)
    if state_dir is not None:
        cfg = yaml.safe_load(cfg_path.read_text())
        cfg["state"] = {"dir": str(state_dir)}
        cfg["log"] = {"level": "INFO"}
        cfg_path.write_text(yaml.safe_dump(cfg))
    lines: deque[str] = deque(maxlen=400)
    launched = spawn(cfg_path, workdir, lines=lines)
    return gs.DaemonProc(launched.proc, launched.endpoints, lines)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("journal.*"))


def bench_steps(args: argparse.Namespace, root: Path) -> tuple[dict[str, Any], gs.DaemonProc,
                                                               Path]:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    state_dir = Path(tempfile.mkdtemp(prefix="blockd-bench-state-", dir=shm))
    daemons = {"baseline": start(root / "baseline", None),
               "journal": start(root / "journal", state_dir)}
    rng = random.Random(1)
    clients = {}
    for name, d in daemons.items():
        session = gs.Session(gs.open_channel(d.target), f"bench-{name}")
        seqs = gs.admit_sequences(session, max(BATCHES), rng)
        stream = gs.StepStreamClient(session.stub, timeout=3600)
        clients[name] = (session, seqs, stream)
    out: dict[str, Any] = {}
    for batch in BATCHES:
        samples: dict[str, list[float]] = {n: [] for n in daemons}
        journal_growth, journal_steps = 0, 0
        for r in range(args.rounds):
            order = list(daemons) if r % 2 == 0 else list(reversed(daemons))
            for name in order:
                session, seqs, stream = clients[name]
                template = gs.decode_template(seqs[:batch])
                before = dir_bytes(state_dir) if name == "journal" else 0
                chunk = gs.timed_chunk("stream", lambda q, s=stream: s.round_trip(q), session,
                                       template, args.chunk)
                if r >= 1:  # round 0 warms up
                    samples[name].extend(chunk)
                    if name == "journal":
                        grown = dir_bytes(state_dir) - before
                        if grown > 0:  # a snapshot in the chunk restarts the journal
                            journal_growth += grown
                            journal_steps += args.chunk
        row = {name: gs.summarize(xs) for name, xs in samples.items()}
        row["ratio_p50"] = row["journal"]["p50_us"] / row["baseline"]["p50_us"]
        row["ratio_p99"] = row["journal"]["p99_us"] / row["baseline"]["p99_us"]
        row["journal_bytes_per_step"] = journal_growth / max(1, journal_steps)
        out[str(batch)] = row
    for _, _, stream in clients.values():
        stream.close()
    daemons["baseline"].stop()
    return out, daemons["journal"], state_dir


def bench_restart(d: gs.DaemonProc, root: Path) -> dict[str, Any]:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    t0 = time.perf_counter()
    lines: deque[str] = deque(maxlen=400)
    launched = spawn(root / "journal" / "blockd.yaml", root / "journal", lines=lines)
    ready_s = time.perf_counter() - t0
    restarted = gs.DaemonProc(launched.proc, launched.endpoints, lines)
    line = next((x for x in lines if "recovered epoch" in x), "")
    fields = dict(kv.split("=", 1) for kv in line.split('msg="', 1)[-1].rstrip('"\n').split()
                  if "=" in kv)
    restarted.stop()
    return {"process_start_to_ready_s": ready_s,
            "journal_records_replayed": int(fields.get("journal_records", 0)),
            "recovery_s": float(fields.get("seconds", "nan")),
            "sequences": int(fields.get("sequences", 0)),
            "indexed_blocks": int(fields.get("indexed_blocks", 0))}


def bench_snapshot(num_blocks: int, num_seqs: int, blocks_per_seq: int) -> dict[str, Any]:
    B = 16
    m = BlockManager(PoolSpec(block_size=B, num_blocks=num_blocks),
                     [TenantPolicy("t", quota_blocks=num_blocks)], seed=1)
    m.open_session("t", "s")
    scope = PrefixScope("model", "r1")
    rng = random.Random(2)
    for i in range(num_seqs):
        # 1,000 distinct system prompts of 8 blocks, then a unique rest.
        system = [rng.randrange(32_000) for _ in range(8 * B)] if i < 1000 else None
        prompt = (system or [i % 1000] * (8 * B)) + [rng.randrange(32_000)
                                                     for _ in range((blocks_per_seq - 8) * B)]
        res = m.admit("s", scope, prompt + [1])
        assert not hasattr(res, "reason"), res
        m.commit("s", res.seq_id)  # type: ignore[union-attr]
    dumps, loads, size = [], [], 0
    for _ in range(3):
        t0 = time.perf_counter()
        data = snapshot.dump(m)
        dumps.append(time.perf_counter() - t0)
        size = len(data)
        t0 = time.perf_counter()
        snapshot.load(data)
        loads.append(time.perf_counter() - t0)
    used = num_blocks - m.blocks.num_free
    return {"num_blocks": num_blocks, "blocks_in_use": used, "indexed_blocks": len(m.index),
            "sequences": len(m.sequences), "dump_s": statistics.median(dumps),
            "load_s": statistics.median(loads), "bytes": size,
            "bytes_per_block_in_use": size / used}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(BATCHES))
    steps = results["steps"]
    for k, (name, color) in enumerate((("baseline", "#888"), ("journal", "#1f77b4"))):
        ax.bar([x + k * 0.4 for x in xs], [steps[str(b)][name]["p50_us"] for b in BATCHES],
               0.4, label=f"{name} p50", color=color)
    for x, b in zip(xs, BATCHES, strict=True):
        ax.text(x + 0.2, steps[str(b)]["journal"]["p50_us"], f"{steps[str(b)]['ratio_p50']:.2f}x",
                ha="center", va="bottom")
    ax.set_xticks([x + 0.2 for x in xs], [f"batch {b}" for b in BATCHES])
    ax.set_ylabel("Step round trip p50 (µs), StepStream")
    ax.set_title("Journal overhead on decode Steps (same run, alternating chunks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11, help="alternating chunks (first warms up)")
    ap.add_argument("--chunk", type=int, default=100, help="Steps per chunk")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"machine": {"python": platform.python_version(),
                                           "cpus": os.cpu_count(),
                                           "platform": platform.platform()}}
    with tempfile.TemporaryDirectory(prefix="blockd-bench-") as tmp:
        steps, journaled, state_dir = bench_steps(args, Path(tmp))
        results["steps"] = steps
        results["restart"] = bench_restart(journaled, Path(tmp))
        for p in state_dir.iterdir():
            p.unlink()
        state_dir.rmdir()
    results["snapshot"] = bench_snapshot(200_000, 2_000, 50)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "journal_overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "journal_overhead.png")
    for b in BATCHES:
        r = steps[str(b)]
        print(f"batch {b:>3}: p50 {r['baseline']['p50_us']:7.0f} -> {r['journal']['p50_us']:7.0f}"
              f" us ({r['ratio_p50']:.2f}x), p99 {r['ratio_p99']:.2f}x, "
              f"{r['journal_bytes_per_step']:.0f} journal bytes/step")
    s = results["snapshot"]
    print(f"snapshot of {s['blocks_in_use']} blocks in use ({s['indexed_blocks']} indexed, "
          f"{s['sequences']} sequences): dump {s['dump_s'] * 1e3:.0f} ms, load "
          f"{s['load_s'] * 1e3:.0f} ms, {s['bytes_per_block_in_use']:.0f} B/block")
    r = results["restart"]
    print(f"restart after kill -9: {r['journal_records_replayed']} records replayed, recovery "
          f"{r['recovery_s'] * 1e3:.1f} ms, process start to ready "
          f"{r['process_start_to_ready_s']:.2f} s")
    print(f"wrote {args.out / 'journal_overhead.json'} and {args.out / 'journal_overhead.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
