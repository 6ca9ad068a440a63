"""The cuda pool across a daemon restart: a new epoch, as decided in docs/decisions.md ("The CUDA
pool starts a new epoch").

A CUDA VMM allocation dies with the daemon that created it, unless a worker still holds its
exported handle. The daemon does not take a worker's handle back, so with ``pool.backend: cuda``
it ignores ``state.dir``, and every start is a new epoch. The test runs a real daemon on the
real driver with ``state.dir`` set, writes K/V into a committed prefix on the GPU, ``kill -9``s
the daemon and starts it again on the same configuration. Then it checks:

- the old session's next call raises ``EpochChanged``, and the session has re-attached;
- nothing of the old epoch is left: no sequence, no cached block, no hit;
- the new pool is a new allocation, zeroed, while the worker's old mapping still reads what it
  wrote (its own handle keeps that memory alive, and nobody else sees it);
- the new epoch serves, and its stream-ordered fences retire blocks.

It needs a GPU and is skipped without one (``scripts/gpu_check.sh`` runs it).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from daemon_proc import TOKENS, kill9, restart, start

import blockd_client.requests as rq
from blockd.pools.cuda import cuda_unavailable_reason
from blockd_client import Client, EpochChanged
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")
PROMPT = list(range(100, 112))  # three full blocks


@pytest.fixture
def gpu() -> None:
    reason = cuda_unavailable_reason()
    if reason is None and not torch.cuda.is_available():
        reason = f"torch {torch.__version__} cannot use CUDA (a CPU-only build or no device)"
    if reason is not None:
        pytest.skip(reason)


def admin_stats(d: Any) -> Any:
    with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["admin"]) as c:
        return c.stats()


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gpu_a_restarted_daemon_on_the_cuda_pool_starts_a_new_epoch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    d = start(tmp_path / "d", num_blocks=32,
              extra={"pool": {"backend": "cuda"}, "state": {"dir": str(state)}})
    client = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], reconnect_s=30)
    try:
        assert any("cannot outlive the daemon" in line for line in d.lines), d.log_text()
        session = client.attach("acme", LAYOUT, worker_name="alice")
        old_epoch = session.epoch
        out = session.step([rq.admit(PROMPT, NS)])
        seq = out.results[0].admit.sequence_id
        table = list(out.results[0].admit.block_table)
        old_kv = session.pool.kv_pool()
        assert old_kv.is_cuda
        old_kv[:, :, table] = 7.0  # the prefill's K/V, written by a kernel on the stream
        session.complete_on_stream(out.fence, torch.cuda.current_stream())
        done = session.step([rq.commit(seq)])
        session.complete_on_stream(done.fence, torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert session.lookup(NS, PROMPT) == len(PROMPT)  # cached before the crash

        kill9(d)
        d = restart(d)
        assert any("cannot outlive the daemon" in line for line in d.lines), d.log_text()

        with pytest.raises(EpochChanged):
            session.step([rq.admit(PROMPT, NS)])
        assert session.epoch != old_epoch  # re-attached, on the new epoch
        s = admin_stats(d)
        assert s.epoch == session.epoch
        assert s.num_sequences == 0 and s.blocks_cached == 0
        assert s.blocks_free == s.num_blocks
        assert session.lookup(NS, PROMPT) == 0  # no hit on the old epoch's prefix

        new_kv = session.pool.kv_pool()
        assert new_kv.is_cuda and new_kv.data_ptr() != old_kv.data_ptr()
        assert int(torch.count_nonzero(new_kv)) == 0  # a new allocation, zeroed
        # The worker's old mapping is its own memory now: still what it wrote, not the pool.
        assert torch.all(old_kv[:, :, table] == 7.0)
        new_kv.fill_(3.0)
        torch.cuda.synchronize()
        assert torch.all(old_kv[:, :, table] == 7.0)
        del old_kv

        # The new epoch serves, and its fence page is the one the stream writes.
        again = session.step([rq.admit(PROMPT, NS)])
        assert again.results[0].status.code == 0
        seq2 = again.results[0].admit.sequence_id
        session.complete_on_stream(again.fence, torch.cuda.current_stream())
        rel = session.step([rq.release(seq2)])
        session.complete_on_stream(rel.fence, torch.cuda.current_stream())
        torch.cuda.synchronize()
        deadline = time.monotonic() + 5
        while admin_stats(d).blocks_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        s = admin_stats(d)
        assert s.blocks_pending == 0 and s.blocks_free + s.blocks_cached == s.num_blocks
        del new_kv
        session.detach()
    finally:
        client.close()
        d.stop()
