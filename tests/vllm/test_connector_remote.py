"""Two nodes share prefixes through a real Redis Cluster: vLLM engines on node A's blockd
compute 24 distinct prompts; a fresh engine on node B's blockd (its own pool and host tier,
another credential of the same tenant) gets at least 90% of their full blocks through the
cluster, token for token what vLLM alone computes.

The connector asks blockd with ``wait_for_remote``: while node B fetches a prompt's prefix, the
admit is answered "pending" and the connector answers vLLM's scheduler ``(n, True)``: the
request waits in ``WAITING_FOR_REMOTE_KVS``, the worker loads the blocks once blockd has them
and reports the request in ``finished_recving``; what the fetch did not bring (a frozen or
flushed cluster) is reported as load errors and vLLM computes it. The roles are driven step by
step first (the exact blocks loaded, the exact blocks recomputed), then real engines.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from connector_driver import Blocks, ask, kv_blocks, request, run_worker, step
from test_connector_faults import _connector
from test_connector_tiers import in_batches, prompts
from vllm_support import (
    Engine,
    connector_config,
    connector_figures,
    daemon_proc,
    retired,
    start_daemon,
)

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


def metric(out: dict, name: str) -> float:
    """A counter of the connector's in an engine's vLLM metrics (``vllm:blockd_<name>``)."""
    return sum(v for k, v in out["metrics"].items()
               if k.removesuffix("_total") == f"vllm:blockd_{name}")


def batches(engine: Engine, work: list[list[int]]) -> dict:
    """``in_batches``, with the engine's metrics after the last batch."""
    out: dict = {"tokens": [], "num_cached": []}
    for i in range(0, len(work), 3):
        got = engine.generate(work[i:i + 3])
        out["tokens"] += got["tokens"]
        out["num_cached"] += got["num_cached"]
        out["metrics"] = got["metrics"]
    return out


def test_node_b_gets_node_a_prefixes_through_the_cluster(tmp_path: Path, model_dir: Path,
                                                         alone: Engine) -> None:
    """Then, with one master killed and the others flushed, node B's fetches of 6 more
    prompts node A computed miss: still answered ``(n, True)``, every promised block comes back
    as a load error and is computed, tokens equal vLLM alone's, no request fails."""
    work, later = prompts(seed=41), prompts(seed=43, n=6)
    with RedisCluster.start(tmp_path / "redis") as cluster:
        a = start_daemon(tmp_path / "a", num_blocks=POOL_BLOCKS,
                         tiers=remote_tiers(tmp_path / "a", cluster))
        b = start_daemon(tmp_path / "b", num_blocks=POOL_BLOCKS,
                         tiers=remote_tiers(tmp_path / "b", cluster))
        with a, b, Engine(model_dir, connector_config(b, "acme", "alice2"), wait=False) as nb:
            # Node A never waits for the cluster (its prompts are new there). Both engines
            # start while vLLM alone computes the expected tokens.
            with Engine(model_dir, connector_config(a, "acme", "alice", remote_wait_s=0),
                        wait=False) as na:
                want = in_batches(alone, work)["tokens"]
                want_later = in_batches(alone, later)["tokens"]
                assert in_batches(na, work)["tokens"] == want
                last = in_batches(na, later)
                assert last["tokens"] == want_later
                retired(a)  # every block node A computed is committed, so queued to publish
            # The write-behind done: node B's promises are made of blocks the cluster holds.
            queued = a.metric("blockd_remote_published_blocks_total")
            written = daemon_proc.wait_metric(a, "blockd_remote_written_values_total", queued)
            assert written >= 30 * 6 * 0.9, (queued, written, connector_figures(last, na))
            out = batches(nb, work)
            assert out["tokens"] == want
            full = sum((len(p) - 1) // 32 * 32 for p in work)
            got = sum(out["num_cached"])
            print(f"node B: {got} of {full} full-block tokens through the cluster")
            assert got >= 0.9 * full, (got, full)
            assert b.metric("blockd_remote_hit_blocks_total") >= 0.9 * 24 * 6
            assert b.metric("blockd_remote_pending_admits_total") >= 1
            assert b.metric("blockd_remote_bad_values_total") == 0
            loads = metric(out, "async_loads")  # requests that waited in WAITING_FOR_REMOTE_KVS
            assert loads >= 1, out["metrics"]
            assert metric(out, "load_failures") == 0
            # Another tenant on node B gets none of them: tests/remote/test_remote_daemons.py
            # (real workers; an engine start here would cost ~35 s for the same check).

            cluster.kill(cluster.ports[0])
            for port in cluster.ports[1:]:
                cluster.cli(port, "flushall")
            out = batches(nb, later)
            assert out["tokens"] == want_later  # recomputed, not failed
            assert metric(out, "async_loads") > loads
            assert metric(out, "load_failures") > 0  # promised blocks vLLM computed
            assert b.metric("blockd_remote_bad_values_total") == 0

def torch_equal(x: Blocks, i: int, y: Blocks, j: int) -> bool:
    import torch

    return all(torch.equal(x.caches[k][i], y.caches[k][j]) for k in x.caches)


def wait_for(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def compute_on_a(sched, worker, prompt: list[int], rid: str, vblocks: list[int]  # type: ignore[no-untyped-def]
                 ) -> None:
    """Node A's roles compute ``prompt``: saved, committed, then published to the cluster."""
    r = request(rid, prompt)
    assert ask(sched, r) == (0, False)
    sched.scheduler.block_ids_of = lambda _: (vblocks,)
    sched.update_state_after_alloc(r, kv_blocks(vblocks), 0)
    sched.update_connector_output(run_worker(worker, sched.build_connector_meta(
        step([(r, vblocks, 0, len(prompt))]))))
    sched.request_finished(r, vblocks)
    sched.build_connector_meta(step([]))  # the commit, behind this step's fence
    assert sched.scheduler.settle()


def wait_in_remote_kvs(sched, worker, r, vblocks: list[int]):  # type: ignore[no-untyped-def]
    """Node B: vLLM's scheduler asks, gets ``(n, True)``, allocates, and steps (nothing of the
    request scheduled) until the connector reports the request loaded; returns (n, the step's
    metadata, the worker's output)."""
    got = sched.get_num_new_matched_tokens(r, 0)
    assert got == (None, False)  # the admit goes with this schedule()'s Step
    deadline = time.monotonic() + 20
    while got[0] is None and time.monotonic() < deadline:
        sched.build_connector_meta(step([]))
        assert sched.scheduler.settle()
        got = sched.get_num_new_matched_tokens(r, 0)
    n, load_async = got
    assert load_async, got
    sched.update_state_after_alloc(r, kv_blocks(vblocks), n)
    while time.monotonic() < deadline:  # WAITING_FOR_REMOTE_KVS: vLLM schedules other work
        meta = sched.build_connector_meta(step([]))
        out = run_worker(worker, meta)
        sched.update_connector_output(out)
        if out.finished_recving:
            assert out.finished_recving == {r.request_id}
            return n, meta, out
        assert not meta.load_vllm and not out.invalid_block_ids
        assert sched.scheduler.settle()
        time.sleep(0.02)
    raise AssertionError("the request was never reported loaded")


def test_a_pending_fetch_is_an_async_load_and_a_failed_one_is_recomputed(
        tmp_path: Path, model_dir: Path) -> None:
    """Node B's connector answers ``(96, True)`` for a prompt node A computed (3 full blocks in
    the cluster, none in B's pool); the step after the fetch landed loads exactly node A's
    bytes into the blocks vLLM allocated and reports the request in ``finished_recving``. With
    the cluster frozen (SIGSTOP: every command runs into the deadline) the same path ends in
    ``finished_recving`` with every promised block a load error: vLLM computes them."""
    with RedisCluster.start(tmp_path / "redis") as cluster:
        a = start_daemon(tmp_path / "a", num_blocks=POOL_BLOCKS,
                         tiers=remote_tiers(tmp_path / "a", cluster))
        b = start_daemon(tmp_path / "b", num_blocks=POOL_BLOCKS,
                         tiers=remote_tiers(tmp_path / "b", cluster))
        with a, b:
            # Node A never waits for the cluster (its prompts are new: their fetch would miss).
            extra_a = connector_config(a, "acme", "alice",
                                       remote_wait_s=0)["kv_connector_extra_config"]
            extra_b = connector_config(b, "acme", "alice2",
                                       remote_wait_s=10.0)["kv_connector_extra_config"]
            sa, wa = _connector(model_dir, extra_a, "SCHEDULER"), _connector(model_dir, extra_a)
            sb, wb = _connector(model_dir, extra_b, "SCHEDULER"), _connector(model_dir, extra_b)
            kv_a, kv_b = Blocks(), Blocks()
            wa.register_kv_caches(kv_a.caches)
            wb.register_kv_caches(kv_b.caches)
            try:
                one, two = list(range(1, 101)), list(range(301, 401))  # 3 full blocks + 4
                compute_on_a(sa, wa, one, "a1", [0, 1, 2, 3])
                compute_on_a(sa, wa, two, "a2", [4, 5, 6, 7])
                assert wait_for(lambda: a.metric("blockd_remote_written_values_total") >= 6)

                vb = [8, 9, 10, 11]
                for t in kv_b.caches.values():
                    t[8:12].zero_()
                sb.scheduler.block_ids_of = lambda _: (vb,)
                r1 = request("b1", one)
                n, meta, out = wait_in_remote_kvs(sb, wb, r1, vb)
                assert n == 96
                assert meta.load_vllm == [8, 9, 10] and not meta.load_failed
                assert not out.invalid_block_ids
                assert all(torch_equal(kv_b, 8 + j, kv_a, j) for j in range(3))
                assert sb.scheduler.counters["async_loads"] == 1
                assert sb.scheduler.counters["async_load_blocks"] == 3
                sb.request_finished(r1, vb)

                cluster.freeze(True)  # node B's fetch of `two` can only time out
                try:
                    r2 = request("b2", two)
                    n, meta, out = wait_in_remote_kvs(sb, wb, r2, [12, 13, 14, 15])
                finally:
                    cluster.freeze(False)
                assert n == 96
                assert not meta.load_vllm and meta.load_failed == [12, 13, 14]
                assert out.invalid_block_ids == {12, 13, 14}  # vLLM recomputes them
                assert sb.scheduler.counters["async_load_missed_blocks"] == 3
                sb.request_finished(r2, [12, 13, 14, 15])
            finally:
                for c in (wa, sa, wb, sb):
                    c.shutdown()
