"""What /metrics scrapers cost a daemon with many live sequences, before and after, in one run.

Issue 28, finding 7: with 131k live sequences a scrape held the event loop for milliseconds and
four scrapers in a loop multiplied an admit's p50. This starts ``blockd serve`` from each source
tree given (``--source NAME=DIR``: e.g. ``old=<git archive of the base>``, ``new=<of the fix>``;
the daemon process gets ``DIR`` first on its ``PYTHONPATH``, the client side is this tree's),
one after the other in the same run, and for each:

* fills ``--sequences`` live sequences of ``--blocks`` blocks each (two tenants, admits batched
  in Steps, nothing released);
* times ``--scrapes`` sequential GET /metrics on the otherwise idle daemon (median latency, the
  client's HTTP work included, the same for every source);
* lets ``--scrapers`` scraper processes GET /metrics as fast as they can for
  ``--scrape-seconds`` and reads the daemon's CPU time meanwhile (``/proc/PID/stat``): the
  daemon's milliseconds per scrape, and the share of a core the scrapers took (the event loop
  is the daemon's one busy thread, so this is loop time);
* times ``--admits`` admit+release pairs of a third tenant (the admit Step's p50 and p99), alone,
  then beside ``--scrapers`` scraper processes that GET /metrics as fast as they can (separate
  processes: their client work does not share the timing client's GIL);
* reports the p50 ratio (beside the scrapers / alone) and the scrapes per second they got.

Placement (``--placement isolated``, the default), as bench/fairness.py does it: the daemon on
CPU 0, this client and the scrapers on CPU 1, the scrapers at SCHED_IDLE, so that they run when
the timing client waits and do not take the daemon's core (scrapers on other machines would
not); ``shared`` leaves all to the scheduler.

``--extra NAME=YAML`` adds a ``metrics`` section to that source's daemon (e.g. ``cache_ms: 0``:
the fix's rendering on every scrape, to show a rendering's own cost). Writes
bench/results/metrics_scrape.json. No timed assertion: the figures are the result.

    git archive <base> | tar -x -C /tmp/old; git archive HEAD | tar -x -C /tmp/new
    python bench/metrics_scrape.py --source old=/tmp/old --source new=/tmp/new \\
        --source new-nocache=/tmp/new --extra 'new-nocache={cache_ms: 0}'
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from source_daemon import (  # noqa: E402
    Session,
    admit,
    cpu_seconds,
    daemon,
    ms,
    release,
    write_config,
)

from blockd.api.v1 import blockd_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TENANTS = ("fill-a", "fill-b", "probe")
#: A scraper process: GET /metrics in a loop for ``seconds``, then print how many it did.
SCRAPER = """
import http.client, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
n, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/metrics"); c.getresponse().read(); c.close(); n += 1
print(n)
"""


def _config(work: Path, args: argparse.Namespace, metrics: dict[str, Any]) -> Path:
    n_blocks = args.sequences * args.blocks
    return write_config(work, [{"id": t, "quota_blocks": n_blocks + 4096,
                                "max_sequences": args.sequences, "work_units_per_second": 0}
                               for t in TENANTS], n_blocks + 4096,
                        metrics={"address": "127.0.0.1:0", **metrics})


def _fill(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace) -> float:
    sessions = [Session(stub, t) for t in TENANTS[:2]]
    length = args.blocks * 4 - 1  # `blocks` blocks, the last one partial
    t0 = time.perf_counter()
    done = 0
    while done < args.sequences:
        chunk = range(done, min(args.sequences, done + 400))
        ops = [admit([1 + i * length + k for k in range(length)]) for i in chunk]
        resp = sessions[(done // 400) % 2].step(ops)
        bad = [r.status for r in resp.results if r.status.code != 0]
        if bad:
            raise SystemExit(f"filling failed at {done}: {bad[0]}")
        done += len(ops)
    return time.perf_counter() - t0


def _idle_on_cpu1() -> None:
    os.sched_setaffinity(0, {1})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _scrapers(args: argparse.Namespace, host: str, port: int) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", SCRAPER, host, str(port),
                              str(args.scrape_seconds)], stdout=subprocess.PIPE, text=True,
                             preexec_fn=_idle_on_cpu1 if args.placement == "isolated" else None)
            for _ in range(args.scrapers)]


def _collect(procs: list[subprocess.Popen[str]], probe: Session) -> list[int]:
    """Each scraper's count; the probe's lease is renewed while they run (on a loaded machine an
    idle-class scraper can take far longer than its --scrape-seconds to start and finish)."""
    while any(p.poll() is None for p in procs):
        probe.heartbeat()
        time.sleep(1.0)
    return [int(p.communicate()[0].strip() or 0) for p in procs]


def _scrape(host: str, port: int) -> float:
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/metrics")
    c.getresponse().read()
    c.close()
    return time.perf_counter() - t0


def _admits(probe: Session, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        resp = probe.step([admit([7, 7, 7, 10_000_000 + i])])
        out.append(time.perf_counter() - t0)
        seq = resp.results[0].admit.sequence_id
        probe.step([release(seq)])
    return out


def measure(name: str, source: Path, args: argparse.Namespace, metrics: dict[str, Any]
            ) -> dict[str, Any]:
    """One daemon of the tree ``source`` (``metrics``: its extra metrics settings)."""
    with tempfile.TemporaryDirectory() as tmp:
        pin = (lambda: os.sched_setaffinity(0, {0})) if args.placement == "isolated" else None
        with daemon(source, _config(Path(tmp), args, metrics), Path(tmp), preexec_fn=pin
                    ) as launched:
            return _run(name, launched.proc.pid, launched.endpoints, args, metrics)


def _run(name: str, pid: int, endpoints: dict[str, str], args: argparse.Namespace,
         metrics: dict[str, Any]) -> dict[str, Any]:
    ch = grpc.insecure_channel(f"unix:{endpoints['unix']}")
    stub = pb_grpc.BlockdServiceStub(ch)
    fill_s = _fill(stub, args)
    host, _, port_text = endpoints["metrics"].rpartition(":")
    port = int(port_text)
    scrapes = [_scrape(host, port) for _ in range(args.scrapes)]
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    procs = _scrapers(args, host, port)
    flood = sum(int(p.communicate()[0].strip() or 0) for p in procs)
    cpu_s, wall_s = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    probe = Session(stub, "probe")
    _admits(probe, 50)  # warm-up
    alone = _admits(probe, args.admits)
    procs = _scrapers(args, host, port)
    time.sleep(0.5)
    t0 = time.perf_counter()
    beside = _admits(probe, args.admits)
    beside_s = time.perf_counter() - t0
    counts = _collect(procs, probe)
    alone_again = _admits(probe, args.admits)
    ch.close()
    alone_all = alone + alone_again
    row = {"source": name, "metrics": metrics, "fill_seconds": fill_s,
           "scrape_ms_p50": ms(scrapes, 0.5), "scrape_ms_p90": ms(scrapes, 0.9),
           "flood_scrapes_per_second": flood / wall_s,
           "daemon_cpu_ms_per_scrape": 1000 * cpu_s / max(1, flood),
           "daemon_cpu_share_under_scrapers": cpu_s / wall_s,
           "admit_ms_p50_alone": ms(alone_all, 0.5), "admit_ms_p99_alone": ms(alone_all, 0.99),
           "admit_ms_p50_scraped": ms(beside, 0.5), "admit_ms_p99_scraped": ms(beside, 0.99),
           "admits_scraped_within_s": beside_s,
           "scrapes_per_second": sum(counts) / args.scrape_seconds}
    row["admit_p50_ratio"] = row["admit_ms_p50_scraped"] / row["admit_ms_p50_alone"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=YAML")
    ap.add_argument("--sequences", type=int, default=131_072)
    ap.add_argument("--blocks", type=int, default=4, help="blocks per live sequence")
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--admits", type=int, default=300)
    ap.add_argument("--scrapers", type=int, default=4)
    ap.add_argument("--scrape-seconds", type=float, default=8.0)
    ap.add_argument("--placement", choices=("isolated", "shared"), default="isolated")
    ap.add_argument("--out", default=str(RESULTS / "metrics_scrape.json"))
    args = ap.parse_args()
    if args.placement == "isolated":
        os.sched_setaffinity(0, {1})  # this client (and what it starts) off the daemon's CPU
    extra = {k: yaml.safe_load(v) for k, _, v in (e.partition("=") for e in args.extra)}
    rows = []
    for spec in args.source:
        name, _, where = spec.partition("=")
        rows.append(measure(name, Path(where).resolve(), args, extra.get(name) or {}))
    by = {r["source"]: r for r in rows}
    summary: dict[str, Any] = {n: {k: r[k] for k in ("scrape_ms_p50", "daemon_cpu_ms_per_scrape",
                                                      "daemon_cpu_share_under_scrapers",
                                                      "admit_ms_p50_alone",
                                                      "admit_ms_p50_scraped", "admit_p50_ratio",
                                                      "scrapes_per_second")}
                               for n, r in by.items()}
    if "old" in by and "new" in by:
        summary["old_over_new"] = {
            "scrape_ms_p50": by["old"]["scrape_ms_p50"] / by["new"]["scrape_ms_p50"],
            "daemon_cpu_ms_per_scrape": (by["old"]["daemon_cpu_ms_per_scrape"]
                                         / by["new"]["daemon_cpu_ms_per_scrape"]),
            "admit_ms_p50_scraped": (by["old"]["admit_ms_p50_scraped"]
                                     / by["new"]["admit_ms_p50_scraped"]),
            "admit_p50_ratio": by["old"]["admit_p50_ratio"] / by["new"]["admit_p50_ratio"]}
    out = {"args": {k: v for k, v in vars(args).items() if k != "out"},
           "python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "loadavg_after": os.getloadavg(), "rows": rows,
           "summary": summary,
           "command": "python bench/metrics_scrape.py " + " ".join(sys.argv[1:])}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
