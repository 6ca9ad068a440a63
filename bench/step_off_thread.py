"""A Step made off a thread while the process's main thread keeps the GIL busy, with and
without the client's local block tables (``Client.attach(tables=False)``).

This is BlockdConnector's scheduler side inside vLLM's engine core: the main thread runs Python
almost all the time (scheduling, output processing, polling its worker's queue) and the
connector's Steps go out on its outbox thread. Each time that thread lets go of the GIL (the
blocking call itself; every tensor write of the local tables' upkeep, one per operation of the
answer) it waits to get it back, up to the switch interval (5 ms by default) per wait.

One real daemon (``blockd serve``, started by ``blockd_apps.launch``), one process, two sessions
(one with tables, one without). Per repetition, in a rotating order, four cells: each session
with the main thread idle (asleep) and busy (a pure-Python loop until the calls end). A cell is
``--calls`` Steps of ``--admits`` admits of ``--length`` random tokens each, made on a second
thread; each is timed (round trip plus applying the answer, as ``Session.step`` does), then its
fence completed and its sequences released. Reported per cell: p50, p90, p99 and max in ms per
repetition, their medians with [min, max], and per repetition the ratios tables / none of p50 and
p99 with the main thread busy. Every answer must be a success (else exit 1). JSON to
``bench/results/step_off_thread.json``, plot to ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "apps"))

from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd_apps.launch import spawn  # noqa: E402
from blockd_client import Client  # noqa: E402
from blockd_client import requests as rq  # noqa: E402
from blockd_gpu import KvLayout  # noqa: E402

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32")
NS = pb.CacheNamespace(model_id="bench-model", model_revision="r1")
CELLS = [(tables, busy) for tables in (True, False) for busy in (False, True)]


def cell_name(tables: bool, busy: bool) -> str:
    return f"{'tables' if tables else 'no_tables'}_{'busy' if busy else 'idle'}"


def quantiles(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": statistics.median(s), "p90": at(0.9), "p99": at(0.99), "max": s[-1]}


def run_cell(session: Any, args: argparse.Namespace, busy: bool, rnd: random.Random
             ) -> list[float]:
    """``args.calls`` timed admit Steps on a second thread; the main thread spins if ``busy``."""
    times: list[float] = []
    failed: list[str] = []

    def calls() -> None:
        try:
            steps()
        except Exception as err:  # noqa: BLE001 - reported by the main thread, exit 1
            failed.append(repr(err))

    def steps() -> None:
        for _ in range(args.calls):
            ops = [rq.admit([rnd.randrange(1 << 20) for _ in range(args.length)], NS)
                   for _ in range(args.admits)]
            t0 = time.perf_counter()
            out = session.step(ops)
            times.append((time.perf_counter() - t0) * 1000)
            if not out.ok():
                failed.append(str(out.results))
                return
            session.complete(out.fence)
            session.complete(session.step(
                [rq.release(r.admit.sequence_id) for r in out.results]).fence)
            time.sleep(args.gap_ms / 1000)

    worker = threading.Thread(target=calls)
    worker.start()
    x = 0
    while busy and worker.is_alive():
        for i in range(200):  # pure Python: the GIL is let go only when the interpreter must
            x += i
    worker.join()
    if failed:
        raise SystemExit(f"a Step failed: {failed[0][:2000]}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--admits", type=int, default=20)
    ap.add_argument("--length", type=int, default=320)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                    "step_off_thread.json")
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="blockd-offthread-") as tmp:
        work = Path(tmp)
        cfg = {"server": {"unix_socket": str(work / "blockd.sock"), "tcp_address": "127.0.0.1:0",
                          "handle_socket": str(work / "pool.sock")},
               "metrics": {"address": "127.0.0.1:0"},
               # One session waits while the other's cells run (minutes when busy): no lease
               # may end under it.
               "lease": {"default_ms": 3_600_000},
               "pool": {"block_size": 32, "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
                        "dtype": "float32", "num_blocks": 4096}}
        (work / "blockd.yaml").write_text(yaml.safe_dump(cfg))
        daemon = spawn(work / "blockd.yaml", work)
        client = Client(f"unix:{work / 'blockd.sock'}")
        try:
            sessions = {t: client.attach("default", LAYOUT, map_pool=False, tables=t,
                                         worker_name=f"bench-{t}") for t in (True, False)}
            for rep in range(args.repeats):
                rnd = random.Random(rep)
                order = CELLS[rep % len(CELLS):] + CELLS[:rep % len(CELLS)]
                row: dict[str, Any] = {"order": [cell_name(*c) for c in order]}
                for tables, busy in order:
                    row[cell_name(tables, busy)] = quantiles(
                        run_cell(sessions[tables], args, busy, rnd))
                row["ratio_tables_over_none_busy"] = {
                    q: row["tables_busy"][q] / row["no_tables_busy"][q] for q in ("p50", "p99")}
                rows.append(row)
                print(json.dumps({"rep": rep, **{k: v for k, v in row.items() if k != "order"}}),
                      flush=True)
        finally:
            client.close()
            daemon.stop()
    summary: dict[str, Any] = {}
    for c in CELLS:
        name = cell_name(*c)
        summary[name] = {q: {"median": statistics.median(r[name][q] for r in rows),
                             "min": min(r[name][q] for r in rows),
                             "max": max(r[name][q] for r in rows)}
                         for q in ("p50", "p90", "p99", "max")}
    ratios = {q: [r["ratio_tables_over_none_busy"][q] for r in rows] for q in ("p50", "p99")}
    summary["ratio_tables_over_none_busy"] = {
        q: {"median": statistics.median(v), "min": min(v), "max": max(v)}
        for q, v in ratios.items()}
    result = {"what": __doc__.splitlines()[0], "args": {k: str(v) for k, v in vars(args).items()},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(),
                          "switch_interval_s": sys.getswitchinterval()},
              "started": started, "repetitions": rows,
              "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(summary, args.out.with_suffix(".png"))
    s = summary
    print(f"Step of {args.admits} admits off a thread, main thread busy: with tables p50 "
          f"{s['tables_busy']['p50']['median']:.1f} ms p99 {s['tables_busy']['p99']['median']:.1f}"
          f" ms; without p50 {s['no_tables_busy']['p50']['median']:.1f} ms p99 "
          f"{s['no_tables_busy']['p99']['median']:.1f} ms; ratio p99 "
          f"{s['ratio_tables_over_none_busy']['p99']['median']:.2f}x "
          f"[{s['ratio_tables_over_none_busy']['p99']['min']:.2f}, "
          f"{s['ratio_tables_over_none_busy']['p99']['max']:.2f}]; main thread idle: p99 "
          f"{s['tables_idle']['p99']['median']:.1f} / {s['no_tables_idle']['p99']['median']:.1f}"
          f" ms")


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [cell_name(*c) for c in CELLS]
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, q in enumerate(("p50", "p99", "max")):
        med = [summary[n][q]["median"] for n in names]
        lo = [m - summary[n][q]["min"] for m, n in zip(med, names, strict=True)]
        hi = [summary[n][q]["max"] - m for m, n in zip(med, names, strict=True)]
        ax.bar([i + (k - 1) * 0.27 for i in range(len(names))], med, 0.27, yerr=[lo, hi],
               label=q, capsize=3)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("Step round trip, ms (median of repetitions, [min, max])")
    ax.set_title("A Step off a thread: local block tables or none, main thread idle or busy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
