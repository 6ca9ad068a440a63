"""The load figure of docs/benchmarks.md: ``blockd load`` against a daemon that checks itself.

Starts ``blockd serve`` (32,768 blocks of 16 tokens, the load generator's default layout: a
4 GiB host pool) with ``server.invariant_check_interval_ms`` (every invariant of the block
manager checked between calls, periodically) and, with ``--journal``, crash recovery on
(``state.dir`` on /dev/shm: every Step journalled). Runs ``blockd load`` (8 workers x 256
sequences x 60 s by default) with ``--metrics``, then checks through Stats that no session,
sequence or block is left behind. Writes ``bench/results/load_8x256[_journal].json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import yaml

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime.tenants_file import token_hash
from blockd_apps import loadgen
from blockd_apps.launch import spawn, terminate

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "load-token"
ADMIN = "load-admin"
NUM_BLOCKS = 32_768
LAYOUT = {"block_size": 16, "num_layers": 4, "num_kv_heads": 4, "head_dim": 64,
          "dtype": pb.KV_DTYPE_FLOAT16, "kv_order": pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
          "tp_size": 1}


def config(workdir: Path, check_ms: float, state_dir: Path | None) -> Path:
    tenants = {
        "tenants": [{"id": "load", "quota_blocks": NUM_BLOCKS, "sharing": "private"}],
        "workers": [{"name": "load", "token_sha256": token_hash(TOKEN), "tenants": ["load"]},
                    {"name": "admin", "token_sha256": token_hash(ADMIN), "tenants": [],
                     "admin": True}],
    }
    (workdir / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    cfg: dict[str, Any] = {
        "server": {"unix_socket": str(workdir / "blockd.sock"), "tcp_address": "",
                   "handle_socket": str(workdir / "pool.sock"),
                   "invariant_check_interval_ms": check_ms},
        "metrics": {"address": "127.0.0.1:0"},
        "pool": {"block_size": 16, "num_blocks": NUM_BLOCKS, "num_layers": 4,
                 "num_kv_heads": 4, "head_dim": 64, "dtype": "float16"},
        "lease": {"default_ms": 60_000},
        "tenants": {"file": str(workdir / "tenants.yaml"), "allow_anonymous": False},
        "log": {"level": "WARNING"},
    }
    if state_dir is not None:
        cfg["state"] = {"dir": str(state_dir)}
    path = workdir / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--check-ms", type=float, default=1000.0,
                    help="server.invariant_check_interval_ms")
    ap.add_argument("--journal", action="store_true", help="crash recovery on (state.dir)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="blockd-load-") as tmp:
        workdir = Path(tmp)
        state_dir = Path(tempfile.mkdtemp(prefix="blockd-load-state-", dir=shm)) / "state" \
            if args.journal else None
        launched = spawn(config(workdir, args.check_ms, state_dir), workdir)
        try:
            res = loadgen.run(f"unix:{launched.endpoints['unix']}", TOKEN, "load", args.workers,
                              args.seqs, args.duration, LAYOUT,
                              metrics_url=f"http://{launched.endpoints['metrics']}/metrics")
            with grpc.insecure_channel(f"unix:{launched.endpoints['unix']}") as ch:
                s = pb_grpc.BlockdServiceStub(ch).Stats(
                    pb.StatsRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),))
            res["after"] = {"sessions": s.num_sessions, "sequences": s.num_sequences,
                            "blocks_free": s.blocks_free, "blocks_cached": s.blocks_cached,
                            "blocks_other": s.num_blocks - s.blocks_free - s.blocks_cached}
            res["journal"] = args.journal
            res["invariant_check_interval_ms"] = args.check_ms
        finally:
            terminate(launched.proc)
            if state_dir is not None:
                shutil.rmtree(state_dir.parent, ignore_errors=True)
    name = f"load_{args.workers}x{args.seqs}{'_journal' if args.journal else ''}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / name).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items()}, indent=1))
    ok = (res["workers_finished"] == res["workers"] and not res["errors_by_code"]
          and res.get("invariant_violations") == 0 and res["invariant_checks"] > 0
          and res["after"]["blocks_other"] == 0 and res["after"]["sequences"] == 0)
    print(f"wrote {args.out / name}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
