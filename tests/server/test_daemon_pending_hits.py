"""Against a real daemon: a session's own commits of a Step whose fence has not completed are
prefix hits for that session's later admissions (its worker orders its own kernels), and for
no other session until the fence completes (issue 17)."""

from daemon_proc import NS, Worker, admit, commit, md, release

from blockd.api.v1 import blockd_pb2 as pb


def _lookup(w: Worker, tokens: list[int]) -> int:
    lk = w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                                        token_ids=tokens), metadata=md(w.who))
    return lk.num_cached_tokens


def test_own_pending_commits_hit_other_sessions_wait_for_the_fence(daemon) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(5000, 5008))  # two full blocks of 4
    w1 = Worker(daemon.stub(), "alice", "acme")
    w2 = Worker(daemon.stub(), "multi", "acme")  # the same tenant, another worker
    first = w1.step(admit(prompt + [1]), fence=1).results[0].admit  # computed in step 1
    # Step 2 commits the prompt's blocks under fence 2, then admits a request sharing them.
    r = w1.step(commit(first.sequence_id), admit(prompt + [3]), fence=2)
    assert r.results[0].commit.num_blocks_committed == 2
    second = r.results[1].admit
    assert second.num_cached_tokens == 8
    assert list(second.block_table[:2]) == list(first.block_table[:2])
    # A later Step of the same session still hits them (fence 2 is not reported yet).
    third = w1.step(admit(prompt + [2]), fence=3).results[0].admit
    assert list(third.block_table[:2]) == list(first.block_table[:2])
    assert _lookup(w1, prompt + [4]) == 8
    # Another session: fence 2 of w1 has not completed, so nothing is visible to it.
    assert _lookup(w2, prompt + [4]) == 0
    other = w2.admit(prompt + [4])
    assert other.num_cached_tokens == 0
    assert not set(other.block_table) & set(first.block_table)
    # w1 reports fence 2: now every session of the tenant hits the blocks.
    w1.stub.Heartbeat(pb.HeartbeatRequest(session_id=w1.sid, epoch=w1.epoch, completed_fence=2),
                      metadata=md("alice"))
    assert _lookup(w2, prompt + [5]) == 8
    late = w2.admit(prompt + [5])
    assert list(late.block_table[:2]) == list(first.block_table[:2])
    r = w1.step(*(release(x.sequence_id) for x in (first, second, third)), fence=4)
    assert all(x.status.code == 0 for x in r.results)
    r = w2.step(release(other.sequence_id), release(late.sequence_id))
    assert all(x.status.code == 0 for x in r.results)
    for w in (w1, w2):
        w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md(w.who))
