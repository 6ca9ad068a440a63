"""A Lookup's token ids are read from its bytes (``blockd.runtime.packed``), not by protobuf:
checked against protobuf's own parser on generated and mutated messages, then against a real
daemon (the same answer as a parsed request, including encodings only protobuf's parse takes;
bytes over the per-call bound refused unparsed, nothing changed)."""

from __future__ import annotations

import array
import copy
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_proc import NS, TENANTS, Daemon, Worker, md, start, varint
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from blockd.api.v1 import blockd_pb2 as pb
from blockd.runtime import packed
from blockd.runtime.budgets import PARSE_BYTES_PER_UNIT
from blockd.runtime.step import ATTACH_UNITS
from blockd.server.servicer import LOOKUP_TOKEN_IDS

S = grpc.StatusCode


def _field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _chunked(sid: str, tokens: list[int], chunks: list[int], tail: bytes = b"") -> bytes:
    """A LookupRequest whose token ids come in several packed chunks (cut at ``chunks``), with
    other fields between them: legal protobuf that no encoder of ours writes."""
    out = _field(1, sid.encode())
    cuts = sorted({0, len(tokens), *[c % (len(tokens) + 1) for c in chunks]})
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        out += _field(4, b"".join(varint(t) for t in tokens[a:b]))
        if i == 0:
            out += _field(3, pb.CacheNamespace(model_id="m").SerializeToString())
    return out + tail


def _ours(raw: bytes, limit: int) -> tuple[list[int], int, pb.LookupRequest] | None:
    split = packed.split_field(raw, LOOKUP_TOKEN_IDS)
    if split is None:
        return None
    rest, payloads = split
    ids = packed.PackedIds(payloads)
    return array.array("I", ids.first(limit)).tolist(), ids.count, pb.LookupRequest.FromString(rest)


def _same_as_protobuf(raw: bytes, limit: int) -> None:
    """Either both refuse the bytes, or both read the same ids, count and other fields."""
    try:
        theirs = pb.LookupRequest.FromString(raw)
    except DecodeError:
        theirs = None
    try:
        ours = _ours(raw, limit)
    except (packed.Malformed, DecodeError):
        assert theirs is None, raw
        return
    if ours is None:  # not split: the server parses it whole, as protobuf does
        return
    assert theirs is not None, raw
    ids, count, rest = ours
    assert count == len(theirs.token_ids)
    assert ids == list(theirs.token_ids)[:limit]
    theirs.ClearField("token_ids")
    assert rest == theirs


UINT32 = st.integers(0, 2**32 - 1)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(UINT32, max_size=300), chunks=st.lists(st.integers(0, 300), max_size=4),
       limit=st.integers(0, 320), sid=st.text(max_size=8), epoch=st.integers(0, 2**64 - 1))
def test_the_ids_read_from_the_bytes_are_protobufs(tokens: list[int], chunks: list[int],
                                                   limit: int, sid: str, epoch: int) -> None:
    encoded = pb.LookupRequest(session_id=sid, epoch=epoch, namespace=NS,
                               token_ids=tokens).SerializeToString()
    _same_as_protobuf(encoded, limit)
    _same_as_protobuf(_chunked(sid, tokens, chunks), limit)


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(UINT32, min_size=1, max_size=40), seed=st.integers(0, 2**32))
def test_mutated_bytes_are_refused_or_read_as_protobuf_reads_them(tokens: list[int],
                                                                  seed: int) -> None:
    rnd = random.Random(seed)
    raw = bytearray(pb.LookupRequest(session_id="s", epoch=1, namespace=NS,
                                     token_ids=tokens).SerializeToString())
    for _ in range(rnd.randint(1, 3)):
        what = rnd.randrange(3)
        at = rnd.randrange(len(raw))
        if what == 0:
            raw[at] = rnd.randrange(256)
        elif what == 1:
            del raw[at]
        else:
            raw.insert(at, rnd.randrange(256))
    _same_as_protobuf(bytes(raw), 64)


def test_what_protobuf_accepts_beyond_our_encoder() -> None:
    """Varints over 32 bits keep their low 32 (as protobuf does), over 10 bytes are refused;
    an unpacked id, a group or many fields are left to protobuf's own parse."""
    wide = _field(4, varint(2**40 + 5) + varint(2**64 - 1) + varint(7))
    assert _ours(wide, 9)[:2] == ([5, 2**32 - 1, 7], 3)
    _same_as_protobuf(wide, 9)
    with pytest.raises(packed.Malformed):
        _ours(_field(4, b"\xff" * 10 + b"\x01"), 9)
    with pytest.raises(packed.Malformed):
        _ours(_field(4, b"\x05\x85"), 9)  # ends inside a varint
    unpacked = varint(4 << 3) + varint(77)
    assert _ours(_field(4, varint(1)) + unpacked, 9) is None
    assert _ours(b"\x1b\x1c", 9) is None  # a group: start and end of field 3
    many = [varint(99 << 3) + varint(i) for i in range(packed.MAX_FIELDS + 1)]
    assert _ours(b"".join(many), 9) is None
    fewer = b"".join(many[1:])
    assert _ours(fewer, 9) == ([], 0, pb.LookupRequest.FromString(fewer))


# -- a real daemon ----------------------------------------------------------------------------

#: globex's own budget: an Attach and about 1.5 Lookups of the pool's reach (64 x 4 + 1 ids).
BURST = ATTACH_UNITS + 400


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tenants = copy.deepcopy(TENANTS)
    tenants["tenants"][1].update(work_units_per_second=1, work_units_burst=BURST)  # globex
    d = start(tmp_path_factory.mktemp("packed"), num_blocks=64, tenants=tenants,
              extra={"server": {"max_work_per_call": 8192}})
    yield d
    d.stop()


def _lookup(d: Daemon, raw: bytes, who: str) -> pb.LookupResponse:
    call = d.channel().unary_unary("/blockd.v1.BlockdService/Lookup",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.LookupResponse.FromString)
    return call(raw, metadata=md(who))


def test_a_lookup_read_from_its_bytes_answers_as_a_parsed_one(daemon: Daemon) -> None:
    """A cached 3-block prefix, asked for in every encoding: packed, in chunks, unpacked (left
    to protobuf), and far longer than the pool (only the pool's reach is read)."""
    w = Worker(daemon.stub(), "alice", "acme")
    prompt = list(range(5000, 5013))  # 3 full blocks of 4 and one token
    w.cache(prompt)
    head = _field(1, w.sid.encode()) + varint(2 << 3) + varint(w.epoch) + _field(
        3, NS.SerializeToString())
    long = prompt + list(range(7000, 7000 + 64 * 4 * 3))  # beyond 64 blocks of 4
    unpacked = b"".join(varint(4 << 3) + varint(t) for t in prompt)
    for raw in (head + _field(4, b"".join(varint(t) for t in prompt)),
                head + _field(4, b"".join(varint(t) for t in prompt[:5])) + _field(
                    4, b"".join(varint(t) for t in prompt[5:])),
                head + unpacked,
                head + _field(4, b"".join(varint(t) for t in long))):
        got = _lookup(daemon, raw, "alice")
        assert (got.num_cached_tokens, got.num_cached_blocks) == (12, 3), raw[-8:]


def test_bytes_over_the_per_call_bound_are_refused_unparsed(daemon: Daemon) -> None:
    """8192 work units at most per call: a Lookup or Step whose bytes alone cost more is
    RESOURCE_EXHAUSTED ("work", field request) before it is parsed (malformed bytes after
    the bound are never read), and nothing changes; one just under the bound is served."""
    w = Worker(daemon.stub(), "alice", "acme")
    before = w.stats()
    n = 8192 * PARSE_BYTES_PER_UNIT + PARSE_BYTES_PER_UNIT
    over = _field(1, w.sid.encode()) + _field(1023, b"x" * n)
    for method, response in (("Lookup", pb.LookupResponse), ("Step", pb.StepResponse)):
        call = daemon.channel().unary_unary(f"/blockd.v1.BlockdService/{method}",
                                            request_serializer=lambda b: b,
                                            response_deserializer=response.FromString)
        for raw in (over, over + b"\x0f"):  # well formed, then not
            with pytest.raises(grpc.RpcError) as err:
                call(raw, metadata=md("alice"))
            assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
            assert err.value.details().startswith(
                f"request: work: the request of {len(raw)} bytes costs "), \
                err.value.details()
            assert "over server.max_work_per_call (8192)" in err.value.details()
    after = w.stats()
    assert (after.blocks_free, after.num_sequences) == (before.blocks_free, before.num_sequences)
    under = pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                             token_ids=[1, 2, 3]).SerializeToString() + _field(
        1023, b"x" * (4000 * PARSE_BYTES_PER_UNIT))
    assert _lookup(daemon, under, "alice").num_cached_tokens == 0


def test_the_ids_work_is_charged_before_any_is_decoded(daemon: Daemon) -> None:
    """globex's bucket pays for one Lookup of the pool's reach, not two: the second is refused
    for rate although its bytes cost a few units, before its ids are even counted (the bucket
    must hold the bytes' units and the most work their ids can cost, ``reading_need``: here
    the pool's reach, 257 ids); the refusal took nothing, so a small Lookup is still
    served."""
    w = Worker(daemon.stub(), "bob", "globex")
    head = _field(1, w.sid.encode()) + varint(2 << 3) + varint(w.epoch) + _field(
        3, NS.SerializeToString())
    ids = b"".join(varint(t) for t in range(1000))
    assert _lookup(daemon, head + _field(4, ids), "bob").num_cached_tokens == 0
    with pytest.raises(grpc.RpcError) as err:
        _lookup(daemon, head + _field(4, ids), "bob")
    assert err.value.code() == S.RESOURCE_EXHAUSTED, err.value.details()
    assert err.value.details().startswith("rate: tenant 'globex'"), err.value.details()
    # The bytes cost parse_units(head) + scan_units(ids): 1 + 1 units.
    assert "this call needs 259 units" in err.value.details(), err.value.details()
    assert _lookup(daemon, head + _field(4, ids[:3]), "bob").num_cached_tokens == 0


def test_a_varint_protobuf_refuses_is_refused_wherever_it_lies(daemon: Daemon) -> None:
    """Only the ids a match reaches are decoded, but every one is checked: a varint over 10
    bytes is INVALID_ARGUMENT before or after the reach, as protobuf's parse refuses it."""
    w = Worker(daemon.stub(), "alice", "acme")
    head = _field(1, w.sid.encode()) + varint(2 << 3) + varint(w.epoch) + _field(
        3, NS.SerializeToString())
    ids = b"".join(varint(t) for t in range(1000))
    before = w.stats()
    for bad in (ids[:100] + b"\xff" * 10 + b"\x01" + ids[100:], ids + b"\xff" * 10 + b"\x01"):
        with pytest.raises(grpc.RpcError) as err:
            _lookup(daemon, head + _field(4, bad), "alice")
        assert err.value.code() == S.INVALID_ARGUMENT, err.value.details()
        assert err.value.details() == "request: a LookupRequest could not be parsed"
    assert w.stats() == before
    assert _lookup(daemon, head + _field(4, ids), "alice").num_cached_tokens == 0


def test_a_hit_longer_than_the_first_decoded_ids_is_found_whole(tmp_path: Path) -> None:
    """The daemon decodes a Lookup's first 4096 ids, and four times more while the hit covers
    them all: a cached 5000-token prefix is found whole from a 25,000-token request, and a
    prefix ending exactly at the first cut too."""
    tenants = copy.deepcopy(TENANTS)
    tenants["tenants"][0]["quota_blocks"] = 3000  # acme
    d = start(tmp_path, num_blocks=3000, tenants=tenants)
    try:
        w = Worker(d.stub(), "alice", "acme")
        prompt = list(range(1, 5002))  # 1250 full blocks of 4 and one token
        w.cache(prompt)
        for ids, hit in ((prompt[:5000] + list(range(90_000, 110_000)), 5000),
                         (prompt[:4097], 4096), (prompt[:4096], 4092), (prompt[:4100], 4096)):
            raw = pb.LookupRequest(session_id=w.sid, epoch=w.epoch, namespace=NS,
                                   token_ids=ids).SerializeToString()
            assert _lookup(d, raw, "alice").num_cached_tokens == hit, len(ids)
    finally:
        d.stop()
