"""The daemon reads fence pages only while a fence is announced and not completed
(``blockd.server.app.poll_fences``): an idle daemon sleeps until a Step announces one. Against a
real daemon and a real session's page: a fence announced after the daemon went idle, and
published in the page after the Step that announced it (no RPC reports it), still retires the
blocks released under it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from daemon_proc import TOKENS, start

import blockd_client.requests as rq
from blockd_client import Client
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = start(tmp_path_factory.mktemp("fence_poller"), num_blocks=32)
    yield d
    d.stop()


def pending(d: Any) -> int:
    with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["admin"]) as c:
        return int(c.stats().blocks_pending)


def wait_pending(d: Any, want: int, seconds: float = 10.0) -> int:
    deadline = time.monotonic() + seconds
    n = pending(d)
    while n != want and time.monotonic() < deadline:
        time.sleep(0.01)
        n = pending(d)
    return n


def test_a_fence_announced_after_the_daemon_went_idle_is_read_from_the_page(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(f"unix:{daemon.endpoints['unix']}", token=TOKENS["alice"]) as c:
        a = c.attach("acme", LAYOUT)
        for round_ in range(3):
            out = a.step([rq.admit(list(range(100 * round_, 100 * round_ + 24)), NS,
                                   cache=False)])
            seq = out.results[0].admit.sequence_id
            a.pool.publish_fence(out.fence)
            # Nothing is pending: the poller has gone to sleep (it wakes on a Step's fence).
            assert wait_pending(daemon, 0) == 0
            time.sleep(0.2)
            rel = a.step([rq.release(seq)])
            assert rel.fence > out.fence
            assert pending(daemon) == 6  # held back by the fence the page does not show yet
            time.sleep(0.1)
            assert pending(daemon) == 6
            # Published in the page, reported by no RPC: the poller the Step woke reads it.
            a.pool.publish_fence(rel.fence)
            assert wait_pending(daemon, 0) == 0, f"round {round_}: the page was not read"
        assert a.state.completed_fence() == rel.fence
        a.detach()
