"""How fast the tiers move blocks, next to this machine's own memcpy and sequential file I/O.

In one run, per repetition and per KV layout (interleaved, the order rotating):

* **memcpy**: ``numpy.copyto`` of one block's bytes at a time, the same bytes the tiers move, out
  of a pool-sized array into a slot-sized one (the copy a tier's spill is made of, without the
  gather over planes, the header or the checksum);
* **spill to host / load from host**: the daemon's own ``PoolTierIO`` between a ``HostPool`` and a
  ``HostTierStore`` (gather the block's runs, write the slot, checksum it; check the slot, scatter
  it back); the first pass over fresh slots is reported apart ("first touch": each page's first
  write faults it in, which ``pool.prefault`` pays at start instead);
* **sequential write / read** of a file in ``--dir`` of the same total size, one block per
  ``pwrite`` / ``pread``, no ``fsync`` (the page cache, as the disk tier writes);
* **spill to disk / load from disk**: ``PoolTierIO`` with a ``DiskTierStore`` in ``--dir``.

Ratios are taken within each repetition (tier / its baseline), then summarised: median, min,
max. Reads come from the page cache (the file was just written): the disk tier's reads of a
slot it wrote recently do too; a cold read is the disk's.

Writes bench/results/tier_copies.json and bench/results/tier_copies.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blockd.core.spec import PoolSpec  # noqa: E402
from blockd.pools.host import HostPool  # noqa: E402
from blockd.runtime.tier_io import PoolTierIO, TierIOStats  # noqa: E402
from blockd.tiers.disk import DiskTierStore  # noqa: E402
from blockd.tiers.host import HostTierStore  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY = bytes(range(16))
#: (name, PoolSpec fields): the daemon's default layout, and an 8B-class model's.
LAYOUTS = {
    "default (64 KiB blocks)": dict(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64,
                                    dtype="float16"),
    "8B-class (2 MiB blocks)": dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128,
                                    dtype="bfloat16"),
}
KINDS = ("memcpy", "spill host (first touch)", "spill host", "load host", "seq write",
         "spill disk", "seq read", "load disk")


def bench_layout(fields: dict, blocks: int, workdir: Path) -> dict[str, float]:
    """Bytes per second of each kind, for ``blocks`` blocks of this layout."""
    spec = PoolSpec(num_blocks=blocks, **fields)
    n = spec.slot_bytes
    pool = HostPool(spec)
    rng = np.random.default_rng(0)
    for b in range(blocks):
        pool.copy_in(b, memoryview(rng.integers(0, 255, n, dtype=np.uint8).tobytes()))
    host = HostTierStore(blocks, n)
    disk = DiskTierStore(str(workdir), "bench", blocks, n)
    io = PoolTierIO(pool, {"host": host, "disk": disk}, TierIOStats(), "bench")
    out: dict[str, float] = {}
    total = blocks * n

    def timed(kind: str, fn) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn()
        out[kind] = total / (time.perf_counter() - t0)

    src = np.frombuffer(pool.map, dtype=np.uint8)
    dst = np.empty(n, dtype=np.uint8)

    def memcpy() -> None:
        for b in range(blocks):
            np.copyto(dst, src[b * n:(b + 1) * n])

    timed("memcpy", memcpy)
    timed("spill host (first touch)", lambda: [io.spill(b, "host", b, b + 1, KEY) or _fail()
                                               for b in range(blocks)])
    timed("spill host", lambda: [io.spill(b, "host", b, b + 1, KEY) or _fail()
                                 for b in range(blocks)])
    timed("load host", lambda: [io.load("host", b, b, b + 1, KEY) or _fail()
                                for b in range(blocks)])
    path = workdir / "sequential.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, total)
    chunk = bytes(rng.integers(0, 255, n, dtype=np.uint8))
    buf = bytearray(n)

    def seq_write() -> None:
        for b in range(blocks):
            os.pwrite(fd, chunk, b * n)

    def seq_read() -> None:
        for b in range(blocks):
            os.preadv(fd, [buf], b * n)

    timed("seq write", seq_write)
    timed("spill disk", lambda: [io.spill(b, "disk", b, b + 1, KEY) or _fail()
                                 for b in range(blocks)])
    timed("seq read", seq_read)
    timed("load disk", lambda: [io.load("disk", b, b, b + 1, KEY) or _fail()
                                for b in range(blocks)])
    os.close(fd)
    path.unlink()
    src = dst = None  # release the views of the pool before it closes
    for closing in (host, disk, pool):
        closing.close()
    return out


def _fail() -> None:
    raise AssertionError("a tier copy failed")


def run(args: argparse.Namespace) -> dict[str, object]:
    names = list(LAYOUTS)
    runs = []
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                fields = LAYOUTS[name]
                spec = PoolSpec(num_blocks=1, **fields)
                blocks = max(8, args.megabytes * 2**20 // spec.slot_bytes)
                rates = bench_layout(fields, blocks, Path(work))
                runs.append({"layout": name, "repetition": rep, "blocks": blocks,
                             "slot_bytes": spec.slot_bytes, "bytes_per_s": rates})
                print(f"rep {rep} {name}: " + ", ".join(
                    f"{k} {v / 1e9:.2f} GB/s" for k, v in rates.items()), flush=True)
    layouts: dict[str, object] = {}
    for name in names:
        mine = [r for r in runs if r["layout"] == name]
        rates = {k: statistics.median(r["bytes_per_s"][k] for r in mine) for k in KINDS}
        ratios = {}
        for tier, base in (("spill host", "memcpy"), ("load host", "memcpy"),
                           ("spill disk", "seq write"), ("load disk", "seq read")):
            xs = [r["bytes_per_s"][tier] / r["bytes_per_s"][base] for r in mine]
            ratios[f"{tier} / {base}"] = {"median": statistics.median(xs), "min": min(xs),
                                          "max": max(xs), "samples": xs}
        layouts[name] = {"slot_bytes": mine[0]["slot_bytes"], "blocks": mine[0]["blocks"],
                         "median_bytes_per_s": rates, "ratios": ratios}
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"config": config, "layouts": layouts, "runs": runs,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform()}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["layouts"]), figsize=(7 * len(result["layouts"]), 4.5))
    for ax, (name, lay) in zip(axes, result["layouts"].items(), strict=True):
        rates = lay["median_bytes_per_s"]
        colors = ["#888888", "#9cc3f0", "#2c7be0", "#0b3d91", "#888888", "#c8641c", "#888888",
                  "#8a3d0a"]
        ax.bar(range(len(KINDS)), [rates[k] / 1e9 for k in KINDS], color=colors)
        ax.set_xticks(range(len(KINDS)), [k.replace(" ", "\n") for k in KINDS], fontsize=8)
        ax.set_ylabel("GB/s (median)")
        r = lay["ratios"]
        ax.set_title(f"{name}\nhost: spill {r['spill host / memcpy']['median']:.2f}x, load "
                     f"{r['load host / memcpy']['median']:.2f}x memcpy; disk: spill "
                     f"{r['spill disk / seq write']['median']:.2f}x write, load "
                     f"{r['load disk / seq read']['median']:.2f}x read", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--megabytes", type=int, default=128, help="bytes moved per kind and run")
    ap.add_argument("--dir", type=Path, default=RESULTS.parent,
                    help="a directory on the disk the disk tier would use")
    ap.add_argument("--out", type=Path, default=RESULTS / "tier_copies.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(result, args.out.with_suffix(".png"))
    for name, lay in result["layouts"].items():
        print(name + ": " + "; ".join(f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
                                      for k, v in lay["ratios"].items()))
    return result


if __name__ == "__main__":
    main()
