"""Two nodes share prefixes through a real Redis Cluster: vLLM engines on node A's blockd
compute 24 distinct prompts; a fresh engine on node B's blockd (its own pool and host tier,
another credential of the same tenant) gets at least 90% of their full blocks through the
cluster, token for token what vLLM alone computes.

The connector asks blockd with ``wait_for_remote``: while node B fetches a prompt's prefix, the
admit is answered "pending" and the connector answers vLLM's scheduler None (it skips the
request this step and asks again), so the scheduler never waits on the cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path

from test_connector_tiers import in_batches, prompts
from vllm_support import Engine, connector_config, start_daemon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "remote"))

from redis_support import RedisCluster, needs_redis  # noqa: E402

pytestmark = needs_redis

POOL_BLOCKS = 48
SECRET = b"k" * 48


def remote_tiers(workdir: Path, cluster: RedisCluster) -> dict[str, object]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "cluster.secret").write_bytes(SECRET)
    return {"host_bytes": 64 << 20, "redis_nodes": cluster.nodes,
            "cluster_secret_file": str(workdir / "cluster.secret")}


def test_node_b_gets_node_a_prefixes_through_the_cluster(tmp_path: Path, model_dir: Path,
                                                         alone: Engine) -> None:
    work = prompts(seed=41)
    want = in_batches(alone, work)["tokens"]
    with RedisCluster.start(tmp_path / "redis") as cluster:
        a = start_daemon(tmp_path / "a", num_blocks=POOL_BLOCKS,
                         tiers=remote_tiers(tmp_path / "a", cluster))
        b = start_daemon(tmp_path / "b", num_blocks=POOL_BLOCKS,
                         tiers=remote_tiers(tmp_path / "b", cluster))
        with a, b, Engine(model_dir, connector_config(b, "acme", "alice2"), wait=False) as nb:
            with Engine(model_dir, connector_config(a, "acme", "alice")) as na:
                assert in_batches(na, work)["tokens"] == want
            written = a.metric("blockd_remote_written_values_total")
            assert written >= 24 * 6 * 0.9
            out = in_batches(nb, work)
            assert out["tokens"] == want
            full = sum((len(p) - 1) // 32 * 32 for p in work)
            got = sum(out["num_cached"])
            print(f"node B: {got} of {full} full-block tokens through the cluster")
            assert got >= 0.9 * full, (got, full)
            assert b.metric("blockd_remote_hit_blocks_total") >= 0.9 * 24 * 6
            assert b.metric("blockd_remote_pending_admits_total") >= 1
            assert b.metric("blockd_remote_bad_values_total") == 0
            # Another tenant on node B gets none of them: tests/remote/test_remote_daemons.py
            # (real workers; an engine start here would cost ~35 s for the same check).
