"""`blockd load` against a real daemon that checks its invariants after every call."""

import json
import subprocess
import sys

from daemon_proc import TOKENS, md, start

from blockd.api.v1 import blockd_pb2 as pb


def test_load_generator_runs_clean_under_pool_pressure(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Small: appends run out and preempt. The daemon checks every invariant after every call
    # and, besides, every 50 ms (what the 8x256 figure in docs/benchmarks.md runs with).
    d = start(tmp_path / "load", num_blocks=160,
              extra={"server": {"invariant_check_interval_ms": 50}})
    try:
        layout = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "dtype": pb.KV_DTYPE_FLOAT16, "kv_order": pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                  "tp_size": 1}
        out = subprocess.run(
            [sys.executable, "-m", "blockd_apps", "load", "--target", f"unix:{d.endpoints['unix']}",
             "--token", TOKENS["carol"], "--tenant", "initech", "--workers", "2", "--seqs",
             "16", "--duration", "3", "--layout", json.dumps(layout), "--json",
             "--metrics", d.metrics_url],
            capture_output=True, text=True, timeout=180)
        res = json.loads(out.stdout)
        assert out.returncode == 0, out.stderr
        assert res["workers_finished"] == 2 and res["steps"] > 50
        assert res["errors_by_code"] == {}  # no INTERNAL: invariants held after every call
        assert res["invariant_checks"] >= 10 and res["invariant_violations"] == 0
        stats = d.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
        assert stats.num_sequences == 0 and stats.num_sessions == 0
        assert stats.blocks_free + stats.blocks_cached == 160
        assert stats.prefix_hit_tokens_total > 0
    finally:
        d.stop()
