"""KV events in vLLM's wire format (ZMQ PUB + ROUTER replay) and WatchEvents' sequence numbers.

The consumer below is written from vLLM's documented KV-events schema only (msgspec Structs,
``array_like``, tagged events): nothing of blockd's is imported to decode the stream.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import grpc
import msgspec
import pytest
import zmq
from daemon_proc import TENANTS, Daemon, Worker, commit, md, release, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import EventsConfig
from blockd.runtime.events import CLEARED, REMOVED, STORED, Event
from blockd.runtime.kv_events import KvEventPublisher, encode_batch

BLOCK_SIZE = 4
TOPIC = "kv@test-pod@tiny"
SALT = b"SALT-must-never-be-published-7f3a"


# -- a consumer built from vLLM's documented schema --------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Tagged: each event is an array whose first element is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The older schema (before lora_name / extra_keys / data_parallel_rank) must decode it too.
class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                     tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                      tag="BlockRemoved"):
    block_hashes: list[int]


class OldAllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                          tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(OldEventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)
END = -1


class Consumer:
    """A SUB subscriber that checks sequence numbers and repairs gaps through the replay socket.

    ``drop_live`` = (first, count): the live messages with these ordinal positions (0-based,
    counted from ``sync``) are received and then discarded, as a lossy network would.
    """

    def __init__(self, pub: str, replay: str, *, drop_live: tuple[int, int] = (0, 0)) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.replay_endpoint = replay
        self.next_seq = 0
        self.batches: dict[int, bytes] = {}
        self.gaps: list[tuple[int, int]] = []  # (expected, received) on live messages
        self.lost: list[tuple[int, int]] = []  # unrecoverable: older than the replay buffer
        self.discarded: dict[int, bytes] = {}
        self.live = 0
        self.drop_first, self.drop_count = drop_live
        self.topics: set[bytes] = set()
        time.sleep(0.2)  # let the subscription reach the publisher

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Everything the publisher still buffers from ``start`` (a DEALER: many replies)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert sock.poll(5000), "replay timed out"
                empty, seq_bytes, payload = sock.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END:
                    assert payload == b""
                    return out
                out.append((seq, payload))
        finally:
            sock.close(linger=0)

    def _repair(self) -> None:
        for seq, payload in self.replay(self.next_seq):
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self.lost.append((self.next_seq, seq))
            self._accept(seq, payload)

    def _accept(self, seq: int, payload: bytes) -> None:
        self.batches[seq] = payload
        self.next_seq = seq + 1

    def sync(self) -> None:
        """Catch up from seq 0 through replays (what a consumer does when it starts)."""
        self._repair()
        self.live = 0

    def receive(self, timeout: float) -> bool:
        if not self.sub.poll(int(timeout * 1000)):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        self.topics.add(topic)
        seq = int.from_bytes(seq_bytes, "big")
        n, self.live = self.live, self.live + 1
        if self.drop_first <= n < self.drop_first + self.drop_count:
            self.discarded[seq] = payload
            return True
        if seq < self.next_seq:
            return True  # already had it through a replay
        if seq > self.next_seq:
            self.gaps.append((self.next_seq, seq))
            self._repair()
            if seq < self.next_seq:
                return True
        self._accept(seq, payload)
        return True

    def until(self, done: Callable[[Consumer], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            left = deadline - time.monotonic()
            assert left > 0, "the expected events did not arrive"
            self.receive(min(left, 0.2))

    def decoded(self) -> list[tuple[int, KVEventBatch]]:
        return [(s, DECODE.decode(self.batches[s])) for s in sorted(self.batches)]

    def events(self) -> list[Any]:
        return [ev for _, b in self.decoded() for ev in b.events]

    def stored_hashes(self) -> set[int]:
        return {h for ev in self.events() if isinstance(ev, BlockStored)
                for h in ev.block_hashes}

    def removed_hashes(self) -> set[int]:
        return {h for ev in self.events() if isinstance(ev, BlockRemoved)
                for h in ev.block_hashes}


def flatten(events: list[Any]) -> list[tuple[Any, ...]]:
    """One entry per block (kind, hash, parent, tokens) or per clear, for comparisons."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                toks = tuple(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                out.append(("stored", h, parent, toks))
                parent = h
        elif isinstance(ev, BlockRemoved):
            out.extend(("removed", h) for h in ev.block_hashes)
        else:
            out.append(("cleared",))
    return out


def flatten_watch(responses: list[pb.WatchEventsResponse]) -> list[tuple[Any, ...]]:
    def h(key: bytes) -> int:
        return int.from_bytes(key[:8], "big")

    out: list[tuple[Any, ...]] = []
    for r in responses:
        kind = r.WhichOneof("event")
        if kind == "block_stored":
            bs = r.block_stored
            parent = h(bs.parent_block_hash) if bs.parent_block_hash else None
            for i, key in enumerate(bs.block_hashes):
                toks = tuple(bs.token_ids[i * bs.block_size:(i + 1) * bs.block_size])
                out.append(("stored", h(key), parent, toks))
                parent = h(key)
        elif kind == "block_removed":
            out.extend(("removed", h(k)) for k in r.block_removed.block_hashes)
        else:
            out.append(("cleared",))
    return out


# -- the daemon --------------------------------------------------------------------------------


def _tenants() -> dict[str, Any]:
    t = copy.deepcopy(TENANTS)
    for tenant in t["tenants"]:
        tenant["quota_blocks"] = 4096
    return t


@pytest.fixture(scope="module")
def kvd(tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    d = start(tmp_path_factory.mktemp("blockd-kv"), num_blocks=4096, tenants=_tenants(),
              extra={"events": {"zmq_endpoint": "tcp://127.0.0.1:*",
                                "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC,
                                "batch_ms": 5}})
    assert d.endpoints["kv_events"].startswith("tcp://127.0.0.1:")
    yield d
    assert d.stop() == 0, d.log_text()
    text = d.log_text()
    assert "Traceback" not in text and "kv events stopped" in text, text


@pytest.fixture
def consumer(kvd: Daemon) -> Consumer:
    c = Consumer(kvd.endpoints["kv_events"], kvd.endpoints["kv_replay"])
    c.sync()
    yield c
    c.close()


def store(w: Worker, tokens: list[int], ns: pb.CacheNamespace) -> str:
    """Admit, commit under the next fence, complete it: the full blocks enter the index."""
    seq = w.admit(tokens, ns).sequence_id
    r = w.step(commit(seq))
    assert r.results[0].commit.num_blocks_committed == len(tokens) // BLOCK_SIZE
    w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch,
                                         completed_fence=w.fence), metadata=md(w.who))
    w.step(release(seq), fence=0)
    return seq


def detach(*workers: Worker) -> None:
    for w in workers:
        w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md(w.who))


def flush(kvd: Daemon, **filters: str) -> int:
    admin = kvd.stub("unix")
    return admin.FlushNamespace(pb.FlushNamespaceRequest(**filters),
                                metadata=md("admin")).num_blocks_flushed


def watch(kvd: Daemon, since: int, n: int) -> list[pb.WatchEventsResponse]:
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=since),
                                         metadata=md("admin"), timeout=10)
    out = [next(calls) for _ in range(n)]
    calls.cancel()
    return out


GROUP_NS = pb.CacheNamespace(model_id="tiny", model_revision="r1", lora_id="adapter-x")
PRIVATE_NS = pb.CacheNamespace(model_id="tiny", model_revision="r1", cache_salt=SALT)


# -- tests -------------------------------------------------------------------------------------


def test_vllm_schema_consumer_decodes_stored_and_removed(kvd: Daemon,
                                                         consumer: Consumer) -> None:
    group = Worker(kvd.stub("unix"), "carol", "initech")  # group "labs": token ids published
    private = Worker(kvd.stub("unix"), "alice", "acme")  # private: no token ids
    g_tokens = list(range(100, 109))  # 2 full blocks + 1 token
    p_tokens = list(range(200, 212))  # 3 full blocks
    n0 = len(consumer.stored_hashes())
    store(group, g_tokens, GROUP_NS)
    store(private, p_tokens, PRIVATE_NS)
    consumer.until(lambda c: len(c.stored_hashes()) >= n0 + 5)
    assert flush(kvd, model_id="tiny") == 5
    consumer.until(lambda c: any(isinstance(e, AllBlocksCleared) for e in c.events()))

    assert consumer.topics == {TOPIC.encode()}
    assert consumer.gaps == [] and consumer.lost == []
    assert sorted(consumer.batches) == list(range(consumer.next_seq))
    batches = consumer.decoded()
    for _, b in batches:
        assert b.data_parallel_rank == 0 and b.ts > 1.6e9
    stored = [e for e in consumer.events() if isinstance(e, BlockStored)]
    # A chain is one BlockStored (as vLLM publishes a request's blocks) unless a batch boundary
    # fell inside it; join per namespace label to compare.
    by_ns: dict[str, BlockStored] = {}
    for e in stored:
        assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
        ns = e.extra_keys[0][1]
        if ns in by_ns:
            j = by_ns[ns]
            assert e.parent_block_hash == j.block_hashes[-1]
            j.block_hashes += e.block_hashes
            j.token_ids += e.token_ids
            j.extra_keys = (j.extra_keys or []) + e.extra_keys
        else:
            by_ns[ns] = copy.deepcopy(e)
    assert len(by_ns) == 2
    g, p = by_ns.values()
    assert g.block_size == p.block_size == BLOCK_SIZE
    assert (g.medium, p.medium) == ("CPU", "CPU")
    assert (g.lora_id, g.lora_name, p.lora_name) == (None, "adapter-x", None)
    assert g.parent_block_hash is None and p.parent_block_hash is None
    assert len(g.block_hashes) == 2 and g.token_ids == g_tokens[:8]
    assert len(p.block_hashes) == 3 and p.token_ids == []  # a private tenant's tokens stay home
    assert all(0 <= h < 2**64 for h in g.block_hashes + p.block_hashes)
    assert len(set(g.block_hashes + p.block_hashes)) == 5
    for ev in (g, p):
        assert ev.extra_keys is not None and len(ev.extra_keys) == len(ev.block_hashes)
        assert len(set(ev.extra_keys)) == 1
    g_key, p_key = g.extra_keys[0], p.extra_keys[0]
    assert g_key[0] == p_key[0] == "blockd"
    assert g_key[1].startswith("ns-") and len(g_key[1]) == 19 and g_key[1] != p_key[1]
    assert g_key[2] == "group:labs"
    assert p_key[2].startswith("private:") and len(p_key[2]) == len("private:") + 16
    assert "acme" not in p_key[2]
    for _, raw in consumer.batches.items():
        assert SALT not in raw and SALT.hex().encode() not in raw
        assert b"acme" not in raw  # the private tenant's id is nowhere in the stream

    removed = [e for e in consumer.events() if isinstance(e, BlockRemoved)]
    assert {h for e in removed for h in e.block_hashes} == set(g.block_hashes + p.block_hashes)
    assert all(e.medium == "CPU" for e in removed)
    assert isinstance(consumer.events()[-1], AllBlocksCleared)

    # An older vLLM-schema consumer (no lora_name / extra_keys / rank) decodes the same bytes.
    old = msgspec.msgpack.Decoder(type=OldKVEventBatch)
    for seq in consumer.batches:
        assert len(old.decode(consumer.batches[seq]).events) == len(
            DECODE.decode(consumer.batches[seq]).events)

    # WatchEvents carries the same events in the same order: built from the same records.
    flat = flatten(consumer.events())
    watched = watch(kvd, 1, len(flat))
    assert [r.sequence_number for r in watched] == list(range(1, len(flat) + 1))
    assert flatten_watch(watched) == flat
    detach(group, private)


def test_dropped_messages_are_detected_and_replayed(kvd: Daemon) -> None:
    c = Consumer(kvd.endpoints["kv_events"], kvd.endpoints["kv_replay"], drop_live=(2, 3))
    try:
        c.sync()
        start_seq = c.next_seq
        n0 = len(c.stored_hashes())
        w = Worker(kvd.stub("unix"), "dave", "umbrella")
        rounds = 10
        for i in range(rounds):
            store(w, [1000 + 10 * i + j for j in range(8)], GROUP_NS)
            time.sleep(0.03)  # > batch_ms: one batch per round
        c.until(lambda c: len(c.stored_hashes()) >= n0 + 2 * rounds)
        before = len(c.events())
        assert flush(kvd, tenant_id="umbrella") == 2 * rounds
        c.until(lambda c: any(isinstance(e, AllBlocksCleared) for e in c.events()[before:]))

        # It noticed the hole from the sequence numbers, exactly once, where it was made...
        dropped = sorted(c.discarded)
        assert len(dropped) == 3 and dropped == list(range(dropped[0], dropped[0] + 3))
        assert c.gaps == [(dropped[0], dropped[0] + 3)] and c.lost == []
        # ...and the replay filled it with the very bytes that were dropped.
        for seq in dropped:
            assert c.batches[seq] == c.discarded[seq]
        assert sorted(c.batches) == list(range(c.next_seq))
        assert c.next_seq - start_seq >= rounds
        assert dict(c.replay(0)) == c.batches  # the full, gap-free sequence
        detach(w)
    finally:
        c.close()


def test_flush_that_empties_the_cache_emits_all_blocks_cleared(kvd: Daemon,
                                                               consumer: Consumer) -> None:
    g = Worker(kvd.stub("unix"), "carol", "initech")
    p = Worker(kvd.stub("unix"), "bob", "globex")
    n0 = len(consumer.stored_hashes())
    store(g, list(range(300, 308)), GROUP_NS)
    store(p, list(range(400, 408)), PRIVATE_NS)
    consumer.until(lambda c: len(c.stored_hashes()) >= n0 + 4)
    before = len(consumer.events())
    first_watch = len(flatten(consumer.events())) + 1  # WatchEvents' next sequence number

    assert flush(kvd, tenant_id="initech") == 2  # globex's blocks remain: nothing "all cleared"
    assert flush(kvd, tenant_id="globex") == 2  # now the index is empty
    consumer.until(lambda c: any(isinstance(e, AllBlocksCleared) for e in c.events()[before:]))
    tail = flatten(consumer.events()[before:])
    assert [t[0] for t in tail] == ["removed"] * 4 + ["cleared"]

    watched = watch(kvd, first_watch, 5)
    assert [r.WhichOneof("event") for r in watched] == ["block_removed"] * 4 + [
        "all_blocks_cleared"]
    assert flatten_watch(watched) == tail
    detach(g, p)


def test_encoder_joins_chains_and_splits_namespaces() -> None:
    k = [bytes([i]) * 8 + bytes(8) for i in range(1, 6)]
    tok = b"".join(i.to_bytes(4, "little") for i in range(8))

    def stored(key: bytes, parent: bytes, ns: str, tokens: bytes = tok[:16]) -> Event:
        return Event(0, STORED, (key,), parent, tokens, "", ns, "public")

    events = [stored(k[0], b"", "ns-a"), stored(k[1], k[0], "ns-a", tok[16:]),
              stored(k[2], k[1], "ns-b"),  # another namespace: a new BlockStored
              stored(k[3], k[0], "ns-a"),  # not the child of the previous block: a new one
              Event(0, REMOVED, (k[0],)), Event(0, REMOVED, (k[1], k[2])), Event(0, CLEARED)]
    for extra in (True, False):
        raw = encode_batch(events, ts=1.0, block_size=BLOCK_SIZE, medium="GPU", extra_keys=extra)
        got = DECODE.decode(raw).events
        h = [int.from_bytes(x[:8], "big") for x in k]
        assert [type(e).__name__ for e in got] == ["BlockStored"] * 3 + ["BlockRemoved",
                                                                         "AllBlocksCleared"]
        a, b, c = got[:3]
        assert (a.block_hashes, a.parent_block_hash, a.token_ids) == (h[:2], None, list(range(8)))
        assert (b.block_hashes, b.parent_block_hash) == ([h[2]], h[1])
        assert (c.block_hashes, c.parent_block_hash) == ([h[3]], h[0])
        assert got[3].block_hashes == h[:3] and got[3].medium == "GPU"
        assert a.extra_keys == ([("blockd", "ns-a", "public")] * 2 if extra else None)


def test_publisher_replay_older_than_its_buffer_is_reported() -> None:
    """In-process: a replay from before the bounded buffer starts at the oldest batch kept."""
    cfg = EventsConfig(zmq_endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                       topic=TOPIC, batch_ms=0, replay_buffer=3)
    pub = KvEventPublisher(cfg, block_size=BLOCK_SIZE, medium="CPU")
    pub.start()
    try:
        for i in range(6):
            key = bytes([i]) * 16
            pub.submit(Event(i + 1, STORED, (key,), token_bytes=b"\x01\x00\x00\x00" * 4,
                             namespace="ns-0011223344556677", tenant="public"))
            deadline = time.monotonic() + 5
            while pub.next_seq <= i:  # one batch per event: wait for it
                assert time.monotonic() < deadline
                time.sleep(0.002)
        c = Consumer(pub.endpoint, pub.replay_endpoint)
        try:
            c.sync()
            assert c.lost == [(0, 3)]  # batches 0..2 are gone: resynchronise from scratch
            assert sorted(c.batches) == [3, 4, 5]
            ev = DECODE.decode(c.batches[5]).events[0]
            assert isinstance(ev, BlockStored) and ev.block_hashes == [int("05" * 8, 16)]
            assert ev.token_ids == [1] * 4 and ev.extra_keys == [("blockd",
                                                                  "ns-0011223344556677",
                                                                  "public")]
            # A malformed request is answered with END only; the socket keeps serving.
            sock = c.ctx.socket(zmq.DEALER)
            sock.connect(pub.replay_endpoint)
            sock.send_multipart([b"", b"bad"])
            assert sock.poll(5000)
            assert sock.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
            sock.close(linger=0)
            assert [s for s, _ in c.replay(4)] == [4, 5]
        finally:
            c.close()
    finally:
        pub.stop()
    pub.submit(Event(7, REMOVED, (b"\x00" * 16,)))  # after stop: dropped, never raises


def test_publisher_can_connect_to_a_binding_consumer() -> None:
    """llm-d's indexer binds one SUB socket and every publisher connects to it."""
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.bind("tcp://127.0.0.1:*")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        cfg = EventsConfig(zmq_endpoint=sub.getsockopt_string(zmq.LAST_ENDPOINT),
                           zmq_connect=True, topic="kv@pod-a@tiny", batch_ms=0)
        pub = KvEventPublisher(cfg, block_size=BLOCK_SIZE, medium="CPU")
        pub.start()
        try:
            # A binding SUB sends its subscription to a connecting PUB only once it has polled
            # (libzmq#2267); a consumer's receive loop does that anyway.
            for _ in range(4):
                sub.poll(50)
            pub.submit(Event(1, CLEARED))
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert (topic, seq) == (b"kv@pod-a@tiny", bytes(8))
            assert isinstance(DECODE.decode(payload).events[0], AllBlocksCleared)
        finally:
            pub.stop()
    finally:
        ctx.destroy(linger=0)


def test_watch_events_resume_and_out_of_range(kvd: Daemon) -> None:
    w = Worker(kvd.stub("unix"), "carol", "initech")
    x_tokens = list(range(500, 508))
    store(w, x_tokens, GROUP_NS)
    # A watcher reads up to X's two stored blocks, then disconnects.
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=1),
                                         metadata=md("admin"), timeout=10)
    seen = []
    while True:
        r = next(calls)
        seen.append(r)
        if r.WhichOneof("event") == "block_stored" and list(r.block_stored.token_ids) == \
                x_tokens[4:]:
            break
    calls.cancel()
    last = seen[-1].sequence_number
    x_keys = {k for r in seen[-2:] for k in r.block_stored.block_hashes}

    # While it is away: Y is stored, everything is flushed; then a marker Z is stored.
    y_tokens = list(range(600, 612))
    store(w, y_tokens, GROUP_NS)
    flush(kvd, model_id="tiny")
    store(w, [700, 701, 702, 703], GROUP_NS)

    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=last + 1),
                                         metadata=md("admin"), timeout=10)
    missed = []
    while True:
        r = next(calls)
        missed.append(r)
        if r.WhichOneof("event") == "block_stored" and list(r.block_stored.token_ids) == [
                700, 701, 702, 703]:
            break
    calls.cancel()
    seqs = [r.sequence_number for r in missed]
    assert seqs == list(range(last + 1, last + 1 + len(missed)))  # no gap, no duplicate
    kinds = [r.WhichOneof("event") for r in missed]
    assert kinds == ["block_stored"] * 3 + ["block_removed"] * 5 + ["all_blocks_cleared",
                                                                    "block_stored"]
    assert [list(r.block_stored.token_ids) for r in missed[:3]] == [
        y_tokens[0:4], y_tokens[4:8], y_tokens[8:12]]
    removed = {k for r in missed[3:8] for k in r.block_removed.block_hashes}
    y_keys = {k for r in missed[:3] for k in r.block_stored.block_hashes}
    assert removed == x_keys | y_keys

    # Fall more than the buffer (65536 events) behind: resuming is refused with OUT_OF_RANGE.
    assert flush(kvd, model_id="tiny") == 1  # the marker
    big = Worker(kvd.stub("unix"), "dave", "umbrella")
    n_blocks = 2000
    produced = 0
    i = 0
    while produced <= 65536:
        base = 1_000_000 + i * n_blocks * BLOCK_SIZE
        store(big, list(range(base, base + n_blocks * BLOCK_SIZE)), GROUP_NS)
        assert flush(kvd, model_id="tiny") == n_blocks
        produced += 2 * n_blocks + 1
        i += 1
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=last + 1),
                                         metadata=md("admin"), timeout=10)
    with pytest.raises(grpc.RpcError) as exc:
        next(calls)
    assert exc.value.code() == grpc.StatusCode.OUT_OF_RANGE
    oldest = int(exc.value.details().split("events before ")[1].split()[0])
    assert oldest > last + 1 + produced - 65536 - 16
    assert watch(kvd, oldest, 1)[0].sequence_number == oldest  # the oldest kept still resumes
    detach(w, big)
