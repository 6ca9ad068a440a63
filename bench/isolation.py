"""What a dedicated partition costs against the shared region, measured in one run.

One daemon serves ``--tenants`` shared tenants and as many dedicated ones, with the same quota
and the same workload each (private prefixes, so the hit rates are comparable). Per tenant:

* attach time: ``Client.attach`` including the handle-socket fetch and the mapping of the
  pool (median and spread over ``--repeats`` attaches, each followed by a detach);
* hit rate: ``--prompts`` prompts sharing a system prefix, each admitted, committed and
  released, then admitted again; hit tokens / queried tokens (the daemon's own Step answers);
* memory: bytes of the mapping the tenant's worker holds, and bytes the daemon allocated for
  the tenant (its partition; a shared tenant's share of the shared region).

Both modes run against the same daemon, interleaved per repeat, so they see the same machine.
Writes bench/results/isolation.json and bench/results/isolation.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

import blockd_client.requests as rq
from blockd.runtime.tenants_file import token_hash
from blockd_apps.launch import spawn, terminate
from blockd_client import Client
from blockd_gpu import KvLayout

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUT = KvLayout(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")


def _config(work: Path, n: int, quota: int) -> Path:
    tenants = []
    workers = []
    for mode in ("shared", "dedicated"):
        for i in range(n):
            tid = f"{mode[0]}{i}"
            tenants.append({"id": tid, "quota_blocks": quota, "isolation": mode})
            workers.append({"name": f"w-{tid}", "token_sha256": token_hash(f"tok-{tid}"),
                            "tenants": [tid]})
    (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants,
                                                       "workers": workers}))
    cfg = {"server": {"unix_socket": str(work / "b.sock"), "tcp_address": "",
                      "handle_socket": str(work / "h.sock")},
           "metrics": {"address": ""},
           "pool": {"block_size": LAYOUT.block_size, "num_blocks": n * quota,
                    "num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads,
                    "head_dim": LAYOUT.head_dim, "dtype": "float16"},
           "tenants": {"file": str(work / "tenants.yaml"), "allow_anonymous": False}}
    path = work / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _workload(session, prompts: int) -> tuple[int, int]:
    ns = rq.namespace("bench", model_revision="r1")
    system = list(range(1, 1 + 4 * LAYOUT.block_size))
    queried = hit = 0
    for rnd in range(2):
        for p in range(prompts):
            tokens = system + [1000 + p * 37 + k for k in range(2 * LAYOUT.block_size + 3)]
            out = session.step([rq.admit(tokens, ns)])
            res = out.results[0].admit
            queried += len(tokens)
            hit += res.num_cached_tokens
            session.complete(out.fence)
            c = session.step([rq.commit(res.sequence_id)])
            session.complete(c.fence)
            session.step([rq.release(res.sequence_id)])
        if rnd == 0:
            queried = hit = 0  # the first round fills the cache; the second is measured
    return hit, queried


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--quota", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        launched = spawn(_config(work, args.tenants, args.quota), work)
        try:
            target = f"unix:{launched.endpoints['unix']}"
            ids = [f"{m}{i}" for i in range(args.tenants) for m in ("s", "d")]
            times: dict[str, list[float]] = {t: [] for t in ids}
            mapped: dict[str, int] = {}
            for _ in range(args.repeats):
                for tid in ids:  # interleaved: both modes see the same noise
                    client = Client(target, token=f"tok-{tid}")
                    t0 = time.perf_counter()
                    s = client.attach(tid, LAYOUT, worker_name="bench")
                    times[tid].append(time.perf_counter() - t0)
                    mapped[tid] = s.pool.num_blocks * LAYOUT.block_bytes
                    s.detach()
                    client.close()
            hits: dict[str, float] = {}
            for tid in ids:
                client = Client(target, token=f"tok-{tid}")
                s = client.attach(tid, LAYOUT, worker_name="bench")
                h, q = _workload(s, args.prompts)
                hits[tid] = h / q if q else 0.0
                s.detach()
                client.close()
        finally:
            terminate(launched.proc)
    shared_bytes = args.tenants * args.quota * LAYOUT.block_bytes
    per = {}
    for tid in ids:
        ms = [1000 * t for t in times[tid]]
        q1, _, q3 = statistics.quantiles(ms, n=4)
        dedicated = tid.startswith("d")
        per[tid] = {"isolation": "dedicated" if dedicated else "shared",
                    "attach_ms_median": statistics.median(ms), "attach_ms_iqr": [q1, q3],
                    "hit_rate": hits[tid], "mapped_bytes": mapped[tid],
                    "allocated_bytes": (args.quota * LAYOUT.block_bytes if dedicated
                                        else shared_bytes // args.tenants)}

    def mode(m: str, key: str) -> float:
        return statistics.median(v[key] for v in per.values() if v["isolation"] == m)

    summary = {m: {k: mode(m, k) for k in ("attach_ms_median", "hit_rate", "mapped_bytes",
                                           "allocated_bytes")}
               for m in ("shared", "dedicated")}
    summary["attach_ratio_dedicated_over_shared"] = (
        summary["dedicated"]["attach_ms_median"] / summary["shared"]["attach_ms_median"])
    out = {"args": vars(args), "python": platform.python_version(),
           "machine": platform.machine(), "per_tenant": per, "summary": summary,
           "command": "python bench/isolation.py " + " ".join(sys.argv[1:])}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "isolation.json").write_text(json.dumps(out, indent=2) + "\n")
    _plot(per)
    print(json.dumps(summary, indent=2))


def _plot(per: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per)
    colors = ["tab:blue" if per[n]["isolation"] == "shared" else "tab:orange" for n in names]
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    med = [per[n]["attach_ms_median"] for n in names]
    err = [[m - per[n]["attach_ms_iqr"][0] for n, m in zip(names, med, strict=True)],
           [per[n]["attach_ms_iqr"][1] - m for n, m in zip(names, med, strict=True)]]
    ax[0].bar(names, med, yerr=err, color=colors)
    ax[0].set_title("attach (ms, median, IQR)")
    ax[1].bar(names, [per[n]["hit_rate"] for n in names], color=colors)
    ax[1].set_title("prefix hit rate (2nd round)")
    ax[2].bar(names, [per[n]["mapped_bytes"] / 2**20 for n in names], color=colors,
              label="mapped by its worker")
    ax[2].plot(names, [per[n]["allocated_bytes"] / 2**20 for n in names], "k_", ms=20,
               label="allocated for it")
    ax[2].set_title("memory per tenant (MiB)")
    ax[2].legend(fontsize=7)
    fig.suptitle("shared (blue) vs dedicated (orange), one daemon, same run")
    fig.tight_layout()
    fig.savefig(RESULTS / "isolation.png", dpi=110)


if __name__ == "__main__":
    main()
