"""Tenant isolation: a tenant cannot hit, read, inspect, flush or infer (through distinct status
codes, answers or the timing of Lookup) another tenant's private prefixes; scrubbed blocks read
zero through a worker's own mapping of the pool.

Why Lookup cannot leak: every prefix key chains from a namespace root that includes the sharing
domain, which the daemon derives from the *session's* tenant ("private:acme"), never from the
request. globex's Lookup of acme's prompt therefore hashes globex's root, probes keys that no
block is indexed under, and misses exactly as it misses a prompt nobody ever sent: same answer
bytes, same work (the first probe of the binary search misses, and so does every later one).

Existence of ids: GetBlockTable/Inspect answer NOT_FOUND for an unknown sequence id but
PERMISSION_DENIED for another session's. That difference is only harmless because minted ids are
unguessable (test_findings.py::test_minted_ids_carry_at_least_128_random_bits, F4: sequence ids
had 96 random bits, not the 128 the proto promises; fixed).
"""

from __future__ import annotations

import random
import statistics
import time

import grpc
import pytest
from daemon_proc import NS, TOKENS, Worker, commit, md, release, start
from fuzz_support import COUNTS

from blockd.api.v1 import blockd_pb2 as pb

S = grpc.StatusCode
#: 6 full blocks + 2 tokens: 24 tokens can hit.
PROMPT = list(range(5000, 5026))
NEVER_SEEN = list(range(9000, 9026))
QUICK_STOP = {"server": {"grace_seconds": 0.2}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = start(tmp_path_factory.mktemp("isolation"), num_blocks=128, extra=QUICK_STOP)
    yield d
    d.stop()


def stats(stub) -> pb.StatsResponse:  # type: ignore[no-untyped-def]
    return stub.Stats(pb.StatsRequest(), metadata=md("admin"))


def stored_keys(who: str, stub) -> set[bytes]:  # type: ignore[no-untyped-def]
    """Block hashes of every BlockStored event ``who`` may watch (the stream stays open: read
    until a short deadline)."""
    keys: set[bytes] = set()
    try:
        for ev in stub.WatchEvents(pb.WatchEventsRequest(since_sequence=1), metadata=md(who),
                                   timeout=2):
            if ev.WhichOneof("event") == "block_stored":
                keys.update(ev.block_stored.block_hashes)
    except grpc.RpcError as err:
        assert err.code() == S.DEADLINE_EXCEEDED, err.details()
    return keys


def lookup(w: Worker, tokens: list[int], ns: pb.CacheNamespace = NS) -> pb.LookupResponse:
    COUNTS["requests"] += 1
    COUNTS["rpc.Lookup"] += 1
    return w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=ns,
                                          token_ids=tokens), metadata=md(w.who))


def cache_prompt(w: Worker, tokens: list[int], ns: pb.CacheNamespace = NS,
                 keep: bool = False) -> tuple[str, list[int]]:
    """Admit, commit and complete: the prompt's full blocks enter the prefix index."""
    a = w.admit(tokens, ns)
    w.step(commit(a.sequence_id))
    w.step(completed=w.fence)
    if not keep:
        w.step(release(a.sequence_id))
        w.step(completed=w.fence)
    return a.sequence_id, list(a.block_table)


@pytest.fixture(scope="module")
def acme_cached(daemon):  # type: ignore[no-untyped-def]
    """alice (acme, private) has PROMPT cached and one live sequence holding it."""
    a = Worker(daemon.stub(), "alice", "acme")
    seq, table = cache_prompt(a, PROMPT, keep=True)
    assert lookup(a, PROMPT).num_cached_tokens == 24  # a hit for acme itself
    return {"a": a, "seq": seq, "table": table}


def test_private_prefix_is_invisible_to_another_tenant(daemon, acme_cached) -> None:  # type: ignore[no-untyped-def]
    a, table = acme_cached["a"], acme_cached["table"]
    b = Worker(daemon.stub(), "bob", "globex")
    m = Worker(daemon.stub(), "multi", "globex")  # may act for acme too, but acts for globex
    before = stats(a.stub)
    for w in (b, m):
        for ns in (NS, pb.CacheNamespace(model_id="tiny", model_revision="r1", cache_salt=b"")):
            hit = lookup(w, PROMPT, ns)
            miss = lookup(w, NEVER_SEEN, ns)
            assert hit.num_cached_tokens == 0
            # Byte-identical to a prompt nobody has sent: nothing to tell them apart.
            assert hit.SerializeToString() == miss.SerializeToString()
    assert stats(a.stub) == before  # lookups are pure reads
    # Admitting the prompt finds nothing and shares no block.
    got = b.admit(PROMPT)
    assert got.num_cached_tokens == 0
    assert not set(got.block_table) & set(table)
    ins = b.stub.Inspect(pb.InspectRequest(session_id=b.sid, sequence_id=got.sequence_id),
                         metadata=md("bob"))
    assert all(blk.ref_count == 1 and not blk.shared for blk in ins.blocks)
    b.step(release(got.sequence_id))
    # Same after acme's sequence is gone and the blocks are merely CACHED.
    a2 = Worker(daemon.stub(), "alice", "acme")
    seq, _ = cache_prompt(a2, PROMPT)
    assert lookup(a2, PROMPT).num_cached_tokens == 24
    assert lookup(b, PROMPT).SerializeToString() == lookup(b, NEVER_SEEN).SerializeToString()


def test_group_tenants_do_share_positive_control(daemon) -> None:  # type: ignore[no-untyped-def]
    """The same measurement does see sharing where the policy allows it (group "labs")."""
    c = Worker(daemon.stub(), "carol", "initech")
    d = Worker(daemon.stub(), "dave", "umbrella")
    tokens = list(range(7000, 7010))
    cache_prompt(c, tokens)
    assert lookup(d, tokens).num_cached_tokens == 8
    assert d.admit(tokens).num_cached_tokens == 8


def test_another_tenant_cannot_inspect_or_read_tables(daemon, acme_cached) -> None:  # type: ignore[no-untyped-def]
    a, seq = acme_cached["a"], acme_cached["seq"]
    b = Worker(daemon.stub(), "bob", "globex")
    before = stats(a.stub)
    cases = [
        # bob's own session, acme's sequence: another session's object
        (pb.GetBlockTableRequest(session_id=b.sid, sequence_id=seq), S.PERMISSION_DENIED),
        (pb.InspectRequest(session_id=b.sid, sequence_id=seq), S.PERMISSION_DENIED),
        # acme's session itself
        (pb.GetBlockTableRequest(session_id=a.sid, sequence_id=seq), S.PERMISSION_DENIED),
        (pb.InspectRequest(session_id=a.sid, sequence_id=seq), S.PERMISSION_DENIED),
        # without a session id a lookup covers the caller's own tenants: another tenant's
        # sequence is NOT_FOUND, exactly like an id that does not exist
        (pb.GetBlockTableRequest(session_id="", sequence_id=seq), S.NOT_FOUND),
        (pb.InspectRequest(session_id="", sequence_id=seq), S.NOT_FOUND),
        # an id that does not exist: NOT_FOUND (ids are unguessable; see the module docstring)
        (pb.InspectRequest(session_id=b.sid, sequence_id="A" * 16), S.NOT_FOUND),
    ]
    for req, code in cases:
        fn = b.stub.Inspect if isinstance(req, pb.InspectRequest) else b.stub.GetBlockTable
        COUNTS["requests"] += 1
        with pytest.raises(grpc.RpcError) as info:
            fn(req, metadata=md("bob"))
        assert info.value.code() == code, (req, info.value.details())
        assert "5000" not in (info.value.details() or "")  # no token ids in errors
    # Stats list only the caller's tenants; WatchEvents shows each credential its own tenants'
    # domains only: none of acme's private blocks reach bob (docs/kv_events.md).
    mine = b.stub.Stats(pb.StatsRequest(), metadata=md("bob"))
    assert [t.tenant_id for t in mine.tenants] == ["globex"]
    alice_keys = stored_keys("alice", a.stub)
    assert alice_keys, "acme's own stream shows its cached prefix"
    assert stored_keys("bob", b.stub).isdisjoint(alice_keys)
    assert stats(a.stub) == before


def test_another_tenant_cannot_flush_a_private_prefix(daemon) -> None:  # type: ignore[no-untyped-def]
    a = Worker(daemon.stub(), "alice", "acme")
    b = Worker(daemon.stub(), "bob", "globex")
    tokens = list(range(6000, 6010))
    cache_prompt(a, tokens)
    assert lookup(a, tokens).num_cached_tokens == 8
    before = stats(a.stub)
    for req in (pb.FlushNamespaceRequest(tenant_id="acme"),
                pb.FlushNamespaceRequest(tenant_id="acme", model_id="tiny"),
                pb.FlushNamespaceRequest(model_id="tiny"),
                pb.FlushNamespaceRequest(model_id="tiny", model_revision="r1")):
        COUNTS["requests"] += 1
        with pytest.raises(grpc.RpcError) as info:
            b.stub.FlushNamespace(req, metadata=md("bob"))
        assert info.value.code() == S.PERMISSION_DENIED
    assert stats(a.stub) == before
    # Flushing its own tenant's blocks of the same model leaves acme's alone.
    b.stub.FlushNamespace(pb.FlushNamespaceRequest(tenant_id="globex", model_id="tiny"),
                          metadata=md("bob"))
    assert lookup(a, tokens).num_cached_tokens == 8


def test_lookup_timing_does_not_reveal_another_tenants_prefix(daemon, acme_cached) -> None:  # type: ignore[no-untyped-def]
    """globex times Lookup of acme's cached prompt against a never-seen prompt of the same
    length, in pairs timed back to back in random order; the median of the pairs' ratios is
    within 0.8..1.25."""
    b = Worker(daemon.stub(), "bob", "globex")
    assert lookup(b, PROMPT).num_cached_tokens == 0
    req = {name: pb.LookupRequest(session_id=b.sid, epoch=b.epoch, namespace=NS, token_ids=t)
           for name, t in (("cached", PROMPT), ("fresh", NEVER_SEEN))}
    meta = md("bob")
    times: dict[str, list[int]] = {"cached": [], "fresh": []}
    rng = random.Random(1234)
    answers = set()
    for i in range(50 + 400):
        order = ["cached", "fresh"]
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter_ns()
            r = b.stub.Lookup(req[name], metadata=meta)
            dt = time.perf_counter_ns() - t0
            if i >= 50:  # after warm-up
                times[name].append(dt)
                answers.add(r.SerializeToString())
    COUNTS["requests"] += 900
    COUNTS["rpc.Lookup"] += 900
    assert answers == {b""}  # every answer: zero cached tokens
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each pair was timed back to back, so both share whatever load the machine had then
    # (under a parallel suite the two series' medians drifted apart by ~20% once, 0.79, with
    # nothing to do with the prompts): the claim is on the pairs' ratios.
    pairs = statistics.median(c / f for c, f in zip(times["cached"], times["fresh"],
                                                     strict=True))
    ratio = med["cached"] / med["fresh"]
    print(f"lookup medians: cached-by-acme {med['cached'] / 1e3:.1f} us, never-seen "
          f"{med['fresh'] / 1e3:.1f} us, ratio {ratio:.3f}; median of the pairs' ratios "
          f"{pairs:.3f}")
    assert 0.8 <= pairs <= 1.25, (pairs, med)


# -- scrubbed blocks read zero in the reader's own mapping -----------------------------------

@pytest.fixture(scope="module")
def pool_daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = start(tmp_path_factory.mktemp("scrub"), num_blocks=32, extra=QUICK_STOP)
    yield d
    d.stop()


def _client(d, who):  # type: ignore[no-untyped-def]
    from blockd_client import Client

    return Client(f"unix:{d.endpoints['unix']}", token=TOKENS[who])


def _wait(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("writer,reader,cached", [
    (("carol", "initech"), ("dave", "umbrella"), False),  # same group, another tenant: FREE
    (("alice", "acme"), ("bob", "globex"), True),         # private: CACHED, evicted, reused
])
def test_blocks_reused_by_another_tenant_read_zero(pool_daemon, writer, reader, cached) -> None:  # type: ignore[no-untyped-def]
    """The writer fills every block it holds with 7.0 and lets them go (FREE, or CACHED in the
    prefix index and then evicted by the reader's admit); the reader gets them back scrubbed:
    listed in scrubbed_blocks and all zeros through the reader's own mapping of the pool."""
    torch = pytest.importorskip("torch")
    import blockd_client.requests as rq
    from blockd_gpu import KvLayout

    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    ns = rq.namespace("tiny", model_revision="r1")
    with _client(pool_daemon, writer[0]) as cw, _client(pool_daemon, reader[0]) as cr:
        w = cw.attach(writer[1], layout)
        r = cr.attach(reader[1], layout)
        s0 = cr.stats()
        free = s0.blocks_free + s0.blocks_cached
        n = min(free, 30)
        out = w.step([rq.admit(list(range(3000, 3000 + 4 * n)), ns, cache=cached)])
        assert out.results[0].status.code == 0
        table = list(out.results[0].admit.block_table)
        pool_w = w.pool.kv_pool()
        pool_w[:, :, table] = 7.0
        w.complete(out.fence)
        seq = out.results[0].admit.sequence_id
        if cached:
            done = w.step([rq.commit(seq)])
            w.complete(done.fence)
        rel = w.step([rq.release(seq)])
        w.complete(rel.fence)
        _wait(lambda: cr.stats().blocks_pending == 0, "pending blocks")
        if cached:
            assert cr.stats().blocks_cached >= n - 1  # the full blocks stay in the index
        # The reader needs all of them: free ones first, then the writer's evicted ones.
        got = r.step([rq.admit(list(range(8000, 8000 + 4 * free - 1)), ns, cache=False)])
        assert got.results[0].status.code == 0, got.results[0].status
        blocks = list(got.results[0].admit.block_table)
        reused = sorted(set(blocks) & set(table))
        assert len(reused) == n
        assert set(reused) <= set(got.response.scrubbed_blocks)
        pool_r = r.pool.kv_pool()
        assert torch.count_nonzero(pool_r[:, :, reused]) == 0
        COUNTS["requests"] += 6
        r.step([rq.release(got.results[0].admit.sequence_id)])
        w.detach()
        r.detach()
