"""The pool as workers see it: separate processes mapping the daemon's shared memory."""

import atexit
import gc
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from daemon_proc import TOKENS, start

import blockd_client.requests as rq
from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import BlockdError, Client, EpochChanged
from blockd_gpu import KvLayout

WORKER = str(Path(__file__).resolve().parent / "kvworker.py")
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
LAYOUT_ARGS = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
               "dtype": "float16"}
NS = rq.namespace("tiny", model_revision="r1")


class _ForkServer:
    """``kvworker.py serve``, started on first use in this process: each ``run_worker`` is a
    worker process of its own, forked from one that imported torch once (a second or two of
    CPU per worker otherwise). It exits when this process closes its stdin (at exit)."""

    proc: subprocess.Popen[str] | None = None
    lock = threading.Lock()

    @classmethod
    def run(cls, mode: str, args: dict, timeout: float) -> dict:
        with cls.lock:
            if cls.proc is None or cls.proc.poll() is not None:
                cls.proc = subprocess.Popen([sys.executable, WORKER, "serve"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True)
                atexit.register(cls.close, cls.proc)
            assert cls.proc.stdin is not None and cls.proc.stdout is not None
            cls.proc.stdin.write(json.dumps({"mode": mode, "args": args, "timeout": timeout})
                                 + "\n")
            cls.proc.stdin.flush()
            line = cls.proc.stdout.readline()
        assert line, f"kvworker serve exited ({cls.proc.poll()})"
        return json.loads(line)

    @staticmethod
    def close(proc: subprocess.Popen[str]) -> None:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)


def run_worker(d, mode: str, who: str, tenant: str, tokens: list[int], **kw):  # type: ignore[no-untyped-def]
    """``python kvworker.py MODE ARGS_JSON``, forked from ``kvworker.py serve``: its result.
    A worker starts in milliseconds this way: tests/remote once passed only because a new
    interpreter took seconds, which hid two daemon bugs (a dead master's keys taking the
    remote tier down; a fetch's stale miss suppressing the next fetch)."""
    args = {"target": f"unix:{d.endpoints['unix']}", "token": TOKENS[who], "tenant": tenant,
            "layout": LAYOUT_ARGS, "tokens": tokens, **kw}
    out = _ForkServer.run(mode, args, timeout=120)
    assert out["returncode"] == 0, out["stderr"]
    return json.loads(out["stdout"].strip().splitlines()[-1])


def write_each(d, who: str, tenant: str, prompts: list[list[int]]) -> list[dict]:  # type: ignore[no-untyped-def]
    """``run_worker(d, "write", who, tenant, p)`` for each prompt in turn, in one worker process
    (each prompt its own session, as separate workers): their results, in order."""
    reports = run_worker(d, "write", who, tenant, [], prompts=prompts)
    assert isinstance(reports, list) and len(reports) == len(prompts)
    return reports


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = start(tmp_path_factory.mktemp("pool"), num_blocks=32)
    yield d
    d.stop()


def client(d, who: str) -> Client:  # type: ignore[no-untyped-def]
    return Client(f"unix:{d.endpoints['unix']}", token=TOKENS[who])


def test_a_prefix_hit_reads_the_writers_bytes_in_another_process(daemon) -> None:  # type: ignore[no-untyped-def]
    tokens = list(range(300, 314))  # 3 full blocks + 2 tokens
    a = run_worker(daemon, "write", "alice", "acme", tokens)
    assert a["cached"] == 0 and a["committed"] == 3
    b = run_worker(daemon, "read", "alice", "acme", tokens)
    assert b["cached"] == 12
    assert b["table"][:3] == a["table"][:3]
    assert b["digests"] == a["digests"][:3]  # byte-identical K/V through another mapping
    assert b["pattern_ok"]
    # Another tenant (private) admitting the same prompt gets no hit and no shared block.
    c = run_worker(daemon, "read", "bob", "globex", tokens)
    assert c["cached"] == 0 and not set(c["table"]) & set(a["table"][:3])


def test_released_block_is_not_reused_before_its_fence(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca, client(daemon, "bob") as cb:
        a = ca.attach("acme", LAYOUT)
        b = cb.attach("globex", LAYOUT)
        free = cb.stats().blocks_free + cb.stats().blocks_cached
        # a takes 6 blocks and releases them under fence 2, whose work is "still running".
        out = a.step([rq.admit(list(range(1000, 1024)), NS, cache=False)])
        seq = out.results[0].admit.sequence_id
        mine = set(out.results[0].admit.block_table)
        a.complete(out.fence)
        rel = a.step([rq.release(seq)])
        assert cb.stats().blocks_pending == 6
        # b asks for everything else plus one: it must not get a's pending blocks.
        hog = b.step([rq.admit(list(range(4 * (free - 6))), NS, cache=False)])
        assert hog.results[0].status.code == 0
        more = b.step([rq.admit([1, 2, 3], NS, cache=False)])
        assert more.results[0].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert more.results[0].status.field == "pool"
        assert not mine & set(hog.results[0].admit.block_table)
        # The worker publishes fence 2 in its fence page; the daemon polls it.
        a.complete(rel.fence)
        deadline = time.monotonic() + 5
        while cb.stats().blocks_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        got = b.step([rq.admit([1, 2, 3], NS, cache=False)])
        assert got.results[0].status.code == 0
        assert set(got.results[0].admit.block_table) <= mine
        b.step([rq.release(hog.results[0].admit.sequence_id),
                rq.release(got.results[0].admit.sequence_id)])
        a.detach()
        b.detach()


def test_scrub_a_block_reused_across_tenants_reads_zero(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca, client(daemon, "bob") as cb:
        a = ca.attach("acme", LAYOUT)  # acme's policy: scrub_on_reuse (the default)
        b = cb.attach("globex", LAYOUT)
        free = cb.stats().blocks_free + cb.stats().blocks_cached
        out = a.step([rq.admit(list(range(2000, 2000 + 4 * free)), NS, cache=False)])
        table = list(out.results[0].admit.block_table)
        pool_a = a.pool.kv_pool()
        pool_a[:, :, table] = 7.0  # a's K/V everywhere it holds blocks
        a.complete(out.fence)
        rel = a.step([rq.release(out.results[0].admit.sequence_id)])
        a.complete(rel.fence)
        deadline = time.monotonic() + 5
        while cb.stats().blocks_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        got = b.step([rq.admit(list(range(4 * 3)), NS, cache=False)])
        blocks = list(got.results[0].admit.block_table)
        assert set(blocks) <= set(table)
        assert sorted(got.response.scrubbed_blocks) == sorted(blocks)
        pool_b = b.pool.kv_pool()
        assert torch.count_nonzero(pool_b[:, :, blocks]) == 0  # zeros in b's own mapping
        assert torch.all(pool_a[:, :, [t for t in table if t not in blocks]] == 7.0)
        b.step([rq.release(got.results[0].admit.sequence_id)])
        a.detach()
        b.detach()


def test_killed_worker_is_reaped_and_the_other_goes_on(daemon) -> None:  # type: ignore[no-untyped-def]
    # Alice's sessions are not bob's to count (Stats per tenant): an admin observes.
    with client(daemon, "bob") as cb, client(daemon, "admin") as observer:
        # b's lease outlasts the worker's start (torch's import alone takes seconds on a busy
        # machine): with the default 10 s it ran out under load before b's admit below.
        b = cb.attach("globex", LAYOUT, lease_ms=300_000)
        before = observer.stats()
        args = {"target": f"unix:{daemon.endpoints['unix']}", "token": TOKENS["alice"],
                "tenant": "acme", "layout": LAYOUT_ARGS, "tokens": list(range(500, 520)),
                "lease_ms": 400}
        proc = subprocess.Popen([sys.executable, WORKER, "hold", json.dumps(args)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        held = json.loads(proc.stdout.readline())
        assert len(held["table"]) == 5
        assert observer.stats().num_sessions == before.num_sessions + 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        out = b.step([rq.admit([9, 9, 9], NS)])  # unaffected meanwhile
        assert out.results[0].status.code == 0
        deadline = time.monotonic() + 60  # the reap takes ~0.5 s; the margin is for load
        while observer.stats().num_sessions > before.num_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        after = observer.stats()
        assert after.num_sessions == before.num_sessions
        # Everything the killed worker held is back; b holds the one block it admitted.
        reusable = after.blocks_free + after.blocks_cached
        assert reusable == before.blocks_free + before.blocks_cached - 1
        b.step([rq.release(out.results[0].admit.sequence_id)])
        b.detach()


def test_layout_mismatch_is_refused_naming_the_field(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca:
        for wrong, field in [(KvLayout(2, 2, 8, 8, "float16"), "layout.block_size"),
                             (KvLayout(2, 4, 8, 4, "float16"), "layout.num_kv_heads"),
                             (KvLayout(2, 2, 8, 4, "bfloat16"), "layout.dtype"),
                             (KvLayout(3, 2, 8, 4, "float16"), "layout.num_layers")]:
            with pytest.raises(BlockdError) as info:
                ca.attach("acme", wrong)
            assert info.value.status == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.field == field


def test_pool_views_are_zero_copy_and_outlive_close_safely(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca:
        a = ca.attach("acme", LAYOUT)
        a2 = ca.attach("acme", LAYOUT)
        k0 = a.pool.kv_caches()[0][0]
        k0[5, 1, 1, 3] = 42.0
        assert a2.pool.kv_caches()[0][0][5, 1, 1, 3] == 42.0  # the same memory
        assert k0.data_ptr() == a.pool.kv_pool().data_ptr()
        pool = a.pool
        a.detach()  # closes the view while k0 still points into the mapping
        assert pool.mapped
        assert k0[5, 1, 1, 3] == 42.0  # still valid memory, no SIGSEGV
        k0[5, 1, 1, 3] = 0.0
        del k0
        gc.collect()
        assert not pool.mapped  # the last view is gone: unmapped
        a2.detach()


def test_a_restarted_daemon_is_a_new_epoch_and_the_client_reattaches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = start(tmp_path / "e1", num_blocks=16)
    c = Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"], retries=40, backoff=0.05)
    s = c.attach("acme", LAYOUT)
    old = s.epoch
    s.step([rq.admit([1, 2, 3], NS)])
    d.stop()
    d2 = start(tmp_path / "e1", num_blocks=16)  # same socket path, fresh pool
    try:
        with pytest.raises(EpochChanged) as info:
            s.step([rq.admit([1, 2, 3], NS)])
        assert info.value.old == old and info.value.new == s.epoch != old
        out = s.step([rq.admit([1, 2, 3], NS)])  # the re-attached session works
        assert out.results[0].status.code == 0
        assert s.pool.epoch == s.epoch
        s.detach()
    finally:
        c.close()
        d2.stop()


def test_heartbeat_with_a_stale_epoch_is_failed_precondition(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca:
        s = ca.attach("acme", LAYOUT, map_pool=False)
        with pytest.raises(grpc.RpcError) as info:
            ca.stub.Heartbeat(pb.HeartbeatRequest(session_id=s.session_id, epoch=s.epoch + 2),
                              metadata=ca.metadata)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        s.detach()


def test_client_tables_follow_append_batch_and_copy_on_write(daemon) -> None:  # type: ignore[no-untyped-def]
    with client(daemon, "alice") as ca:
        s = ca.attach("acme", LAYOUT)
        out = s.step([rq.admit([1, 2, 3], NS, cache=False), rq.admit([4, 5, 6, 7], NS,
                                                                     cache=False)])
        a, b = (r.admit.sequence_id for r in out.results)
        fork = s.step([rq.fork(a)])
        (c,) = fork.results[0].fork.child_sequence_ids
        pool = s.pool.kv_pool()
        src = s.tables.blocks(a)[0]
        pool[:, :, src] = 3.0  # a's partial block, shared with c
        out = s.step([rq.append_batch([a, b, c], [8, 9, 10])])
        assert out.ok()
        # a's write into the shared block went through copy-on-write, done by the client.
        assert len(out.response.copies) == 1
        dst = s.tables.blocks(a)[0]
        assert dst != src and torch.all(pool[:, :, dst] == 3.0)
        for seq in (a, b, c):
            server = s.block_table(seq)
            assert s.tables.blocks(seq) == list(server.block_ids)
            assert int(s.tables.lens[s.tables.row(seq)]) == server.num_tokens
            assert s.tables.slots(seq, 0, server.num_tokens).tolist() == [
                server.block_ids[p // 4] * 4 + p % 4 for p in range(server.num_tokens)]
        s.step([rq.release(a), rq.release(b), rq.release(c)])
        s.detach()
