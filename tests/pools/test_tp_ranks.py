"""Tensor parallelism: one session, one pool of ``tp_size`` shards, one worker process per rank.

A vLLM engine with ``tensor_parallel_size=2`` has one scheduler (one blockd session, attached
with ``tp_size=2``) and two worker processes, each holding half of every layer's KV heads. Here
the scheduler is this test and the ranks are two real processes running the connector's worker
side (``tp_rank.py``) against a real daemon: each rank's saves land in its own shard and come
back from it, and a step's fence is done for blockd only once *both* ranks published it (the
fence page's slot per rank: ``blockd.wire.read_fences``), so the blocks a release frees are never
reused while one rank may still copy them. The last rank to retire is the one that detaches.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_proc import TOKENS, start

import blockd_client.requests as rq
from blockd_client import BlockdError, Client
from blockd_client.pool import open_pool
from blockd_gpu import KvLayout

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tp_rank  # noqa: E402

TP = 2
LAYOUT = KvLayout(num_layers=tp_rank.LAYERS, num_kv_heads=tp_rank.H, head_dim=tp_rank.D,
                  block_size=tp_rank.B, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")
SEEDS = (11, 22)


class Rank:
    def __init__(self, session: Any, rank: int) -> None:
        spec = {"rank": rank, "seed": SEEDS[rank], "tp_size": TP,
                "session_id": session.session_id, "epoch": session.epoch,
                "handle_socket": session.state.attach.pool.handle_socket_path,
                "fetch_secret": session.fetch_secret}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "tp_rank.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer and answer[0] == "ok", (line, answer, self.proc.poll())
        return answer[1]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def pending(d: Any) -> int:
    with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["admin"]) as c:
        return c.stats().blocks_pending


def settled_pending(d: Any, seconds: float = 1.0) -> int:
    """Blocks waiting for a fence once the daemon's fence poll (every few ms) had ``seconds``
    to retire what it can."""
    time.sleep(seconds)
    return pending(d)


def csv(xs: list[int]) -> str:
    return ",".join(map(str, xs))


def test_each_rank_has_its_shard_and_a_fence_needs_every_rank(tmp_path: Path) -> None:
    d = start(tmp_path, num_blocks=32, extra={"pool": {"tp_size": TP}})
    ranks: list[Rank] = []
    try:
        with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"]) as c:
            s = c.attach("acme", LAYOUT, tp_size=TP, map_pool=False, lease_ms=120_000)
            out = s.step([rq.admit(list(range(100, 112)), NS)])  # 3 full blocks, new
            table = list(out.results[0].admit.block_table)
            seq = out.results[0].admit.sequence_id
            ranks = [Rank(s, r) for r in range(TP)]
            vllm = [3, 5, 7]
            for r in ranks:
                assert r.ask(f"save {out.fence} {csv(vllm)} {csv(table)}") == "saved"
            # Each shard holds its own rank's K/V, token-major (read by a third process: here).
            pool = open_pool(s.state.attach.pool.handle_socket_path, s.session_id,
                             s.fetch_secret)
            assert pool.tp_size == TP
            for rank, seed in enumerate(SEEDS):
                kv, shard = tp_rank.caches(seed), pool.kv_pool(rank)
                for name, t in kv.items():
                    layer = int(name.split(".")[2])
                    for vb, bb in zip(vllm, table, strict=True):
                        x = t[vb].permute(1, 0, 2)  # [B, H, 2D]
                        assert torch.equal(shard[layer, 0, bb], x[..., :tp_rank.D])
                        assert torch.equal(shard[layer, 1, bb], x[..., tp_rank.D:])
            # ...and each rank loads its own shard back (another rank's would differ).
            for r in ranks:
                assert r.ask(f"load {csv(vllm)} {csv(table)}") == "same"
            # A release: its blocks wait for the step's fence of every rank.
            rel = s.step([rq.release(seq)])
            assert pending(d) == len(table)
            assert int(ranks[0].ask(f"fence {rel.fence}")) == rel.fence
            assert settled_pending(d) == len(table)  # rank 1 may still copy them
            ranks[1].ask(f"fence {rel.fence}")
            deadline = time.monotonic() + 10
            while pending(d) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert pending(d) == 0
            # Shutdown: the first rank to retire leaves the detach to the last one.
            assert [r.ask("retire") for r in ranks] == ["not-last", "last"]
            pool.close()
            s.detach()
    finally:
        for r in ranks:
            r.close()
        d.stop()


def test_a_tensor_parallel_session_on_a_pool_of_other_shards_is_refused(tmp_path: Path
                                                                        ) -> None:
    """tp_size is part of the layout: an engine of 2 ranks on a 1-shard pool is told so."""
    d = start(tmp_path, num_blocks=16)
    try:
        with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"]) as c:
            with pytest.raises(BlockdError, match="tp_size") as refused:
                c.attach("acme", LAYOUT, tp_size=TP, map_pool=False)
            assert refused.value.status.name == "FAILED_PRECONDITION"
            assert c.stats().num_sessions == 0
    finally:
        d.stop()
