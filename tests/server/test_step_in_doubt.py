"""A Step whose call ended without an answer (``Session.in_doubt``) applies exactly once:
``Session.settle()`` sends it again with its step_id and gets its answer whether the daemon had
applied it or never got it; ``AsyncSession`` the same. Real daemon processes; the answer is lost
in a real relay (``answer_relay``) or the daemon is stopped (SIGSTOP) while the call's deadline
passes.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from answer_relay import AnswerRelay
from daemon_proc import TOKENS, Daemon, md, start

import blockd_client.requests as rq
from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import BlockdError, Client, Session
from blockd_client.aio import AsyncClient
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")
PROMPT = list(range(1, 11))  # 2 full blocks of 4 + 2 tokens


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start(tmp_path / "blockd")
    yield d
    d.stop()


def figures(d: Daemon) -> tuple[int, int]:
    """(sequences, free blocks) as the admin sees them, straight from the daemon."""
    s = d.stub().Stats(pb.StatsRequest(), metadata=md("admin"))
    return s.num_sequences, s.blocks_free


def wait_for(d: Daemon, want: tuple[int, int], timeout: float = 10.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while (got := figures(d)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def client(target: str) -> Client:
    return Client(target, token=TOKENS["alice"], timeout=0.5, retries=1, reconnect_s=0.0)


def lose_an_admit(relay: AnswerRelay, c: Client) -> Session:
    """Attach, hold the daemon's answers and send one admit: it is applied, its answer kept,
    and the call ends past its deadline."""
    s = c.attach("acme", LAYOUT, worker_name="alice", map_pool=False)
    relay.hold()
    with pytest.raises(BlockdError) as info:
        s.step([rq.admit(PROMPT, NS)])
    assert info.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
    return s


def test_a_step_applied_whose_answer_was_lost_is_answered_from_the_record(
        daemon: Daemon, tmp_path: Path) -> None:
    idle = figures(daemon)
    with AnswerRelay(daemon.endpoints["unix"], tmp_path / "relay.sock") as relay, \
            client(relay.target) as c:
        s = lose_an_admit(relay, c)
        assert s.in_doubt is not None
        # The daemon applied it: one sequence of 3 blocks, which only the lost answer names.
        admitted = wait_for(daemon, (1, idle[1] - 3))
        assert admitted == (1, idle[1] - 3)
        relay.let_go()
        late = s.settle()
        assert late is not None and late.ok(), late
        seq = late.results[0].admit.sequence_id
        assert late.fence == 1 and late.results[0].admit.num_tokens == len(PROMPT)
        assert figures(daemon) == admitted  # answered from the record, not applied again
        assert s.in_doubt is None and s.settle() is None
        assert s.tables.blocks(seq) == list(late.results[0].admit.block_table)
        # The session goes on after it: the next Step (and its fence) is accepted.
        out = s.step([rq.release(seq)])
        assert out.ok() and out.fence == 2
        s.complete(out.fence)
        s.heartbeat()
        assert wait_for(daemon, idle) == idle


def test_a_step_the_daemon_never_got_in_time_applies_once_when_settled(daemon: Daemon) -> None:
    """Stopped, the daemon reads the Step (and its cancellation) only after the deadline: it may
    apply it then or drop it; ``settle`` leaves exactly one sequence either way."""
    idle = figures(daemon)
    with client(f"unix:{daemon.endpoints['unix']}") as c:
        s = c.attach("acme", LAYOUT, worker_name="alice", map_pool=False)
        daemon.signal(signal.SIGSTOP)
        try:
            with pytest.raises(BlockdError) as info:
                s.step([rq.admit(PROMPT, NS)])
        finally:
            daemon.signal(signal.SIGCONT)
        assert info.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
        late = s.settle()
        assert late is not None and late.ok(), late
        assert figures(daemon) == (1, idle[1] - 3)
        assert s.settle() is None


def test_a_refused_resend_is_no_longer_in_doubt_and_state_is_unchanged(
        daemon: Daemon, tmp_path: Path) -> None:
    """A later Step supersedes the one in doubt (its step_id can never be answered again)."""
    idle = figures(daemon)
    with AnswerRelay(daemon.endpoints["unix"], tmp_path / "relay.sock") as relay, \
            client(relay.target) as c:
        s = lose_an_admit(relay, c)
        relay.let_go()
        lost = s.in_doubt
        assert lost is not None
        wait_for(daemon, (1, idle[1] - 3))
        s.step([])  # the next Step: the lost one is superseded
        assert s.in_doubt is None
        s.in_doubt = lost  # what a caller that kept it would send again
        with pytest.raises(BlockdError) as info:
            s.settle()
        assert info.value.status == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.field == "step_id"
        assert s.in_doubt is None
        assert figures(daemon) == (1, idle[1] - 3)


def test_the_async_session_settles_a_lost_answer_from_the_record(
        daemon: Daemon, tmp_path: Path) -> None:
    idle = figures(daemon)

    async def lose_and_settle(relay: AnswerRelay) -> None:
        c = AsyncClient(relay.target, token=TOKENS["alice"], timeout=0.5, retries=1,
                        reconnect_s=0.0)
        try:
            s = await c.attach("acme", LAYOUT, worker_name="alice", map_pool=False)
            relay.hold()
            with pytest.raises(BlockdError) as info:
                await s.step([rq.admit(PROMPT, NS)])
            assert info.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
            assert s.in_doubt is not None
            admitted = await asyncio.to_thread(wait_for, daemon, (1, idle[1] - 3))
            assert admitted == (1, idle[1] - 3)
            relay.let_go()
            late = await s.settle()
            assert late is not None and late.ok(), late
            assert late.fence == 1 and late.results[0].admit.num_tokens == len(PROMPT)
            assert figures(daemon) == admitted  # from the record, not applied again
            assert s.in_doubt is None and await s.settle() is None
            out = await s.step([rq.release(late.results[0].admit.sequence_id)])
            assert out.ok() and out.fence == 2
            s.complete(out.fence)
            await s.step([])  # reports the completed fence
        finally:
            await c.close()

    with AnswerRelay(daemon.endpoints["unix"], tmp_path / "relay.sock") as relay:
        asyncio.run(lose_and_settle(relay))
    assert wait_for(daemon, idle) == idle
