"""A session without local block tables (``Client.attach(tables=False)``), on a real daemon.

A scheduler that launches no kernel (``blockd_vllm``'s) reads block ids from the Step results:
the local tables are then only a cost and a limit. Their upkeep writes a tensor per operation,
each write lets go of the GIL, and a Step made off a thread while another keeps the GIL busy
(vLLM's engine core) waits to get it back after every one; their rows (``max_seqs``) cap the
live sequences a Step's answer can be applied for. Without them the session's Steps apply for
any number of sequences and leave no table behind.
"""

from __future__ import annotations

import pytest
from daemon_proc import LAYOUT as POOL_LAYOUT
from daemon_proc import NS, TOKENS, Daemon

import blockd_client.requests as rq
from blockd_client import Client
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=POOL_LAYOUT.num_layers, num_kv_heads=POOL_LAYOUT.num_kv_heads,
                  head_dim=POOL_LAYOUT.head_dim, block_size=POOL_LAYOUT.block_size,
                  dtype="float16")


def prompts(n: int) -> list[list[int]]:
    return [[k * 100 + i for i in range(6)] for k in range(n)]  # 2 blocks of 4 each


def test_a_session_without_tables_applies_steps_for_more_sequences_than_rows(
        daemon: Daemon) -> None:
    client = Client(f"unix:{daemon.endpoints['unix']}", token=TOKENS["alice"])
    try:
        bare = client.attach("acme", LAYOUT, worker_name="bare", map_pool=False, max_seqs=2,
                             tables=False)
        assert bare.tables is None
        before = client.stats().num_sequences
        out = bare.step([rq.admit(p, NS) for p in prompts(3)])  # 3 sequences, 2 rows
        assert out.ok(), out.results
        seqs = [r.admit.sequence_id for r in out.results]
        assert [len(r.admit.block_table) for r in out.results] == [2, 2, 2]
        assert client.stats().num_sequences == before + 3
        grown = bare.step([rq.append_batch(seqs, [7, 8, 9], [1, 1, 1])])
        assert grown.ok(), grown.results
        assert list(grown.results[0].append_batch.num_tokens) == [7, 7, 7]
        bare.complete(grown.fence)
        done = bare.step([rq.release(s) for s in seqs])
        assert done.ok(), done.results
        assert client.stats().num_sequences == before
        bare.detach()

        # The same first Step on a session with tables of 2 rows cannot be applied locally.
        tabled = client.attach("acme", LAYOUT, worker_name="tabled", map_pool=False,
                               max_seqs=2)
        with pytest.raises(RuntimeError, match="raise max_seqs"):
            tabled.step([rq.admit(p, NS) for p in prompts(3)])
        tabled.detach()
    finally:
        client.close()
