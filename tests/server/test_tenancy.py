"""Two tenants through the real daemon: private prefixes never hit across tenants, a group
domain shares, and a client cannot pick another tenant's domain."""

from daemon_proc import NS, Worker, commit, md

from blockd.api.v1 import blockd_pb2 as pb

PROMPT = [501, 502, 503, 504, 505, 506, 507, 508, 509]


def _cached(w: Worker, tokens: list[int], ns: pb.CacheNamespace = NS) -> int:
    return w.stub.Lookup(pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=ns,
                                          token_ids=tokens), metadata=md(w.who)).num_cached_tokens


def _seed(w: Worker, tokens: list[int], ns: pb.CacheNamespace = NS) -> pb.AdmitResult:
    a = w.admit(tokens, ns)
    w.step(commit(a.sequence_id))
    w.step(completed=w.fence)
    return a


def test_private_prefixes_never_hit_across_tenants(daemon) -> None:  # type: ignore[no-untyped-def]
    alice = Worker(daemon.stub("unix"), "alice", "acme")
    bob = Worker(daemon.stub("tcp"), "bob", "globex")
    first = _seed(alice, PROMPT)
    assert _cached(alice, PROMPT + [1]) == 8
    assert _cached(bob, PROMPT + [1]) == 0
    b = bob.admit(PROMPT + [1])
    assert b.num_cached_tokens == 0
    assert not set(b.block_table) & set(first.block_table)
    # The same worker credential acting for two tenants does not bridge them either.
    multi_acme = Worker(daemon.stub("unix"), "multi", "acme")
    multi_globex = Worker(daemon.stub("unix"), "multi", "globex")
    assert _cached(multi_acme, PROMPT + [1]) == 8
    assert _cached(multi_globex, PROMPT + [1]) == 0


def test_group_domain_shares_and_identical_blocks_are_returned(daemon) -> None:  # type: ignore[no-untyped-def]
    carol = Worker(daemon.stub("unix"), "carol", "initech")
    dave = Worker(daemon.stub("unix"), "dave", "umbrella")
    alice = Worker(daemon.stub("unix"), "alice", "acme")
    prompt = [p + 1000 for p in PROMPT]
    first = _seed(carol, prompt)
    hit = dave.admit(prompt + [2])
    assert hit.num_cached_tokens == 8
    assert list(hit.block_table[:2]) == list(first.block_table[:2])
    assert _cached(alice, prompt + [2]) == 0  # acme is private, not in the group


def test_salt_and_model_revision_partition_the_cache(daemon) -> None:  # type: ignore[no-untyped-def]
    carol = Worker(daemon.stub("unix"), "carol", "initech")
    prompt = [p + 2000 for p in PROMPT]
    _seed(carol, prompt)
    salted = pb.CacheNamespace(model_id="tiny", model_revision="r1", cache_salt=b"s1")
    other_rev = pb.CacheNamespace(model_id="tiny", model_revision="r2")
    no_rev = pb.CacheNamespace(model_id="tiny")
    empty_rev = pb.CacheNamespace(model_id="tiny", model_revision="")
    assert _cached(carol, prompt) == 8
    for ns in (salted, other_rev, no_rev, empty_rev):
        assert _cached(carol, prompt, ns) == 0
    _seed(carol, prompt, no_rev)
    assert _cached(carol, prompt, no_rev) == 8
    assert _cached(carol, prompt, empty_rev) == 0  # missing != empty
