"""KV events: the ZMQ stream and replay (PUB + ROUTER), WatchEvents' audiences and sequence
numbers, the publisher's counters, the topic, the legacy format.

This file decodes with plain msgpack (no vLLM): it checks what blockd puts in the events and who
gets them. ``tests/contract`` proves the same bytes are vLLM's format with vLLM's own code.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import grpc
import msgpack
import pytest
import zmq
from daemon_proc import TENANTS, Daemon, Worker, commit, md, release, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import EventsConfig
from blockd.core.errors import InvalidArgument
from blockd.runtime.events import CLEARED, REMOVED, STORED, Event
from blockd.runtime.kv_events import KvEventPublisher, encode_batch
from blockd.runtime.tenants_file import token_hash

BLOCK_SIZE = 4
TOPIC = "kv@test-pod@tiny"
SALT = b"SALT-must-never-be-published-7f3a"
END = -1
END_SEQ = END.to_bytes(8, "big", signed=True)
NOBODY = (("authorization", "Bearer tok-nobody"),)  # a credential acting for no tenant


def decode(payload: bytes) -> list[Any]:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and ts > 1.6e9 and rank == 0
    return list(events)


def replay(ctx: zmq.Context[Any], endpoint: str, start: int, topic: bytes = TOPIC.encode()
           ) -> list[tuple[int, bytes]]:
    """Everything the publisher still buffers from ``start`` (a DEALER: many replies), checking
    each frame is vLLM's: [b"", topic, seq, payload], ending [b"", b"", END, b""]."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "replay timed out"
            frames = sock.recv_multipart()
            if frames == [b"", b"", END_SEQ, b""]:
                return out
            empty, got_topic, seq_bytes, payload = frames
            assert (empty, got_topic) == (b"", topic)
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        sock.close(linger=0)


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
        return replay(self.ctx, self.replay_endpoint, start)

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

    def events(self) -> list[dict[str, Any]]:
        return [ev for s in sorted(self.batches) for ev in decode(self.batches[s])]

    def stored_hashes(self) -> set[int]:
        return {h for ev in self.events() if ev["type"] == "BlockStored"
                for h in ev["block_hashes"]}


def flatten(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """One entry per block (kind, hash, parent, tokens) or per clear, for comparisons."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        if ev["type"] == "BlockStored":
            parent = ev["parent_block_hash"]
            for i, h in enumerate(ev["block_hashes"]):
                toks = tuple(ev["token_ids"][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                out.append(("stored", h, parent, toks))
                parent = h
        elif ev["type"] == "BlockRemoved":
            out.extend(("removed", h) for h in ev["block_hashes"])
        else:
            assert ev == {"type": "AllBlocksCleared"}
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
    t["workers"].append({"name": "nobody", "token_sha256": token_hash("tok-nobody"),
                         "tenants": []})
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


def watch(kvd: Daemon, since: int, n: int, who: str | None = "admin",
          metadata: Any = None) -> list[pb.WatchEventsResponse]:
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=since),
                                         metadata=metadata or md(who), timeout=10)
    out = [next(calls) for _ in range(n)]
    calls.cancel()
    return out


def watch_until_cleared(kvd: Daemon, since: int, who: str | None
                        ) -> list[pb.WatchEventsResponse]:
    """What ``who`` may see from ``since`` up to the next AllBlocksCleared (seen by all)."""
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=since),
                                         metadata=md(who), timeout=10)
    out = []
    for r in calls:
        out.append(r)
        if r.WhichOneof("event") == "all_blocks_cleared":
            break
    calls.cancel()
    return out


GROUP_NS = pb.CacheNamespace(model_id="tiny", model_revision="r1", lora_id="adapter-x")
PRIVATE_NS = pb.CacheNamespace(model_id="tiny", model_revision="r1", cache_salt=SALT)


# -- the stream --------------------------------------------------------------------------------


def test_stream_carries_vllm_fields_and_keeps_private_tokens_home(kvd: Daemon,
                                                                  consumer: Consumer) -> None:
    group = Worker(kvd.stub("unix"), "carol", "initech")  # group "labs": token ids published
    private = Worker(kvd.stub("unix"), "alice", "acme")  # private: no token ids on ZMQ
    g_tokens = list(range(100, 109))  # 2 full blocks + 1 token
    p_tokens = list(range(200, 212))  # 3 full blocks
    n0 = len(consumer.stored_hashes())
    store(group, g_tokens, GROUP_NS)
    store(private, p_tokens, PRIVATE_NS)
    consumer.until(lambda c: len(c.stored_hashes()) >= n0 + 5)
    assert flush(kvd, model_id="tiny") == 5
    consumer.until(lambda c: any(e["type"] == "AllBlocksCleared" for e in c.events()))

    assert consumer.topics == {TOPIC.encode()}
    assert consumer.gaps == [] and consumer.lost == []
    assert sorted(consumer.batches) == list(range(consumer.next_seq))
    stored = [e for e in consumer.events() if e["type"] == "BlockStored"]
    # A chain is one BlockStored (as vLLM publishes a request's blocks) unless a batch boundary
    # fell inside it; join chains by their LoRA name to compare.
    by_lora: dict[Any, dict[str, Any]] = {}
    for e in stored:
        assert list(e) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                           "block_size", "lora_id", "medium", "lora_name", "extra_keys"]
        if e["lora_name"] in by_lora:
            j = by_lora[e["lora_name"]]
            assert e["parent_block_hash"] == j["block_hashes"][-1]
            for k in ("block_hashes", "token_ids", "extra_keys"):
                j[k] += e[k]
        else:
            by_lora[e["lora_name"]] = copy.deepcopy(e)
    g, p = by_lora["adapter-x"], by_lora[None]
    assert g["block_size"] == p["block_size"] == BLOCK_SIZE
    assert (g["medium"], p["medium"]) == ("CPU", "CPU")
    assert (g["lora_id"], p["lora_id"]) == (None, None)  # vLLM's integer id: none in blockd
    assert g["parent_block_hash"] is None and p["parent_block_hash"] is None
    assert len(g["block_hashes"]) == 2 and g["token_ids"] == g_tokens[:8]
    assert len(p["block_hashes"]) == 3 and p["token_ids"] == []  # a private tenant's stay home
    # extra_keys as vLLM defines them: per block, the LoRA name (or nil); the salt never.
    assert g["extra_keys"] == [["adapter-x"]] * 2 and p["extra_keys"] == [None] * 3
    assert all(0 <= h < 2**64 for h in g["block_hashes"] + p["block_hashes"])
    assert len(set(g["block_hashes"] + p["block_hashes"])) == 5
    for raw in consumer.batches.values():
        assert SALT not in raw and SALT.hex().encode() not in raw
        assert b"acme" not in raw and b"blockd" not in raw  # no tenant id; no labels (off)

    removed = [e for e in consumer.events() if e["type"] == "BlockRemoved"]
    assert {h for e in removed for h in e["block_hashes"]} == set(g["block_hashes"]
                                                                  + p["block_hashes"])
    assert all(list(e) == ["type", "block_hashes", "medium"] and e["medium"] == "CPU"
               for e in removed)
    assert consumer.events()[-1] == {"type": "AllBlocksCleared"}

    # An admin's WatchEvents carries the same events in the same order (private token ids
    # withheld from it too: it does not act for acme).
    flat = flatten(consumer.events())
    watched = watch(kvd, 1, len(flat))
    assert [r.sequence_number for r in watched] == list(range(1, len(flat) + 1))
    assert flatten_watch(watched) == flat
    detach(group, private)


def test_watch_events_shows_each_credential_its_own_domains(kvd: Daemon) -> None:
    """A private tenant's events, token ids included, go to credentials acting for it (its own,
    a router's that acts for it); never to another tenant. Group events go to the group."""
    flush(kvd, model_id="tiny")  # nothing left over from earlier tests
    workers = {"acme": Worker(kvd.stub("unix"), "alice", "acme"),
               "globex": Worker(kvd.stub("unix"), "bob", "globex"),
               "initech": Worker(kvd.stub("unix"), "carol", "initech"),
               "umbrella": Worker(kvd.stub("unix"), "dave", "umbrella")}
    tokens = {t: [10_000 * (i + 1) + j for j in range(8)] for i, t in enumerate(workers)}
    store(workers["acme"], tokens["acme"], PRIVATE_NS)
    # Where this test's events start: "multi" acts for acme, so it sees acme's token ids.
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=1),
                                         metadata=md("multi"), timeout=10)
    since = next(r.sequence_number for r in calls
                 if list(r.block_stored.token_ids) == tokens["acme"][:4])
    calls.cancel()
    for t in ("globex", "initech", "umbrella"):
        store(workers[t], tokens[t], PRIVATE_NS if t == "globex" else GROUP_NS)
    assert flush(kvd, model_id="tiny") == 8  # empties the index: AllBlocksCleared ends reads

    admin = flatten_watch(watch_until_cleared(kvd, since, "admin"))
    stored = [e for e in admin if e[0] == "stored"]
    hashes = {t: [e[1] for e in stored[2 * i:2 * i + 2]] for i, t in enumerate(workers)}
    # The admin sees every block, with the token ids of shared domains only.
    assert [e[3] for e in stored] == [(), (), (), ()] + [
        tuple(tokens[t][i:i + 4]) for t in ("initech", "umbrella") for i in (0, 4)]
    assert len(admin) == 8 + 8 + 1

    def full(t: str) -> list[tuple[Any, ...]]:
        h = hashes[t]
        return [("stored", h[0], None, tuple(tokens[t][:4])),
                ("stored", h[1], h[0], tuple(tokens[t][4:]))]

    expect = {"alice": ["acme"], "bob": ["globex"], "multi": ["acme", "globex"],
              "carol": ["initech", "umbrella"], "dave": ["initech", "umbrella"]}
    for who, ts in expect.items():
        flat = flatten_watch(watch_until_cleared(kvd, since, who))
        assert [e for e in flat if e[0] == "stored"] == [e for t in ts for e in full(t)], who
        assert sorted(e for e in flat if e[0] == "removed") == sorted(
            ("removed", h) for t in ts for h in hashes[t]), who
        assert flat[-1] == ("cleared",) and len(flat) == 4 * len(ts) + 1, who
    detach(*workers.values())


def test_watch_events_refuses_a_credential_without_tenants(kvd: Daemon) -> None:
    before = kvd.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
    calls = kvd.stub("unix").WatchEvents(pb.WatchEventsRequest(since_sequence=1),
                                         metadata=NOBODY, timeout=10)
    with pytest.raises(grpc.RpcError) as exc:
        next(calls)
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "no tenant" in (exc.value.details() or "")
    after = kvd.stub("unix").Stats(pb.StatsRequest(), metadata=md("admin"))
    assert after == before


def test_laptop_default_local_tenant_watches_its_own_events(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tenants file, anonymous callers: the local tenant ("default", private) watches its
    own events with token ids; the unauthenticated ZMQ stream withholds them. The topic is the
    default kv@<pod>@<model> with the pod from the environment."""
    monkeypatch.setenv("POD_IP", "10.9.8.7")
    monkeypatch.setenv("POD_NAME", "not-this-one")
    d = start(tmp_path, num_blocks=256, extra={
        "tenants": {"file": "", "allow_anonymous": True},
        "events": {"zmq_endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                   "model_name": "tiny", "batch_ms": 1}})
    try:
        w = Worker(d.stub("unix"), None, "default")  # type: ignore[arg-type]
        tokens = list(range(50, 58))
        store(w, tokens, pb.CacheNamespace(model_id="tiny", model_revision="r1"))
        got = watch(d, 1, 2, who=None)
        assert [list(r.block_stored.token_ids) for r in got] == [tokens[:4], tokens[4:]]
        ctx = zmq.Context()
        try:
            topic = b"kv@10.9.8.7@tiny"
            deadline = time.monotonic() + 10
            batches: list[tuple[int, bytes]] = []
            while sum(len(decode(p)) for _, p in batches) == 0:
                assert time.monotonic() < deadline, "no batch published"
                batches = replay(ctx, d.endpoints["kv_replay"], 0, topic=topic)
            (ev,) = [e for _, p in batches for e in decode(p)]
            assert ev["type"] == "BlockStored" and ev["token_ids"] == []
            assert ev["block_hashes"] == [int.from_bytes(r.block_stored.block_hashes[0][:8],
                                                         "big") for r in got]
        finally:
            ctx.destroy(linger=0)
        detach(w)
    finally:
        assert d.stop() == 0, d.log_text()


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
        c.until(lambda c: any(e["type"] == "AllBlocksCleared" for e in c.events()[before:]))

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
    consumer.until(lambda c: any(e["type"] == "AllBlocksCleared"
                                 for e in c.events()[before:]))
    tail = flatten(consumer.events()[before:])
    assert [t[0] for t in tail] == ["removed"] * 4 + ["cleared"]

    watched = watch(kvd, first_watch, 5)
    assert [r.WhichOneof("event") for r in watched] == ["block_removed"] * 4 + [
        "all_blocks_cleared"]
    assert flatten_watch(watched) == tail
    detach(g, p)


# -- the encoder and the publisher in-process --------------------------------------------------


K = [bytes([i]) * 8 + bytes(8) for i in range(1, 6)]
H = [int.from_bytes(x[:8], "big") for x in K]
TOK = b"".join(i.to_bytes(4, "little") for i in range(8))


def stored_ev(key: bytes, parent: bytes, ns: str, tokens: bytes = TOK[:16], lora: str = "",
              tenant: str = "public") -> Event:
    return Event(0, STORED, (key,), parent, tokens, lora, ns, tenant)


def test_encoder_joins_chains_and_splits_namespaces() -> None:
    events = [stored_ev(K[0], b"", "ns-a", lora="ad"),
              stored_ev(K[1], K[0], "ns-a", TOK[16:], lora="ad"),
              stored_ev(K[2], K[1], "ns-b"),  # another namespace: a new BlockStored
              stored_ev(K[3], K[0], "ns-a", lora="ad"),  # not the previous block's child
              Event(0, REMOVED, (K[0],)), Event(0, REMOVED, (K[1], K[2])), Event(0, CLEARED)]
    for extra in (True, False):
        got = decode(encode_batch(events, ts=2e9, block_size=BLOCK_SIZE, medium="GPU",
                                  extra_keys=extra))
        assert [e["type"] for e in got] == ["BlockStored"] * 3 + ["BlockRemoved",
                                                                  "AllBlocksCleared"]
        a, b, c = got[:3]
        assert (a["block_hashes"], a["parent_block_hash"], a["token_ids"], a["lora_name"]) == (
            H[:2], None, list(range(8)), "ad")
        assert (b["block_hashes"], b["parent_block_hash"], b["lora_name"]) == ([H[2]], H[1],
                                                                               None)
        assert (c["block_hashes"], c["parent_block_hash"]) == ([H[3]], H[0])
        assert got[3] == {"type": "BlockRemoved", "block_hashes": H[:3], "medium": "GPU"}
        if extra:
            assert (a["extra_keys"], b["extra_keys"]) == ([["ad"], ["ad"]], [None])
        else:
            assert "extra_keys" not in a and "extra_keys" not in b


def test_labels_are_one_optional_field_and_legacy_is_the_old_arrays() -> None:
    events = [stored_ev(K[0], b"", "ns-a", tenant="private:0123456789abcdef"),
              Event(0, REMOVED, (K[0],)), Event(0, CLEARED)]
    got = decode(encode_batch(events, ts=2e9, block_size=BLOCK_SIZE, medium="CPU",
                              labels=True))
    assert got[0]["blockd"] == {"namespace": "ns-a", "tenant": "private:0123456789abcdef"}
    assert list(got[0])[-1] == "blockd" and "blockd" not in got[1]
    legacy = decode(encode_batch(events, ts=2e9, block_size=BLOCK_SIZE, medium="CPU",
                                 wire_format="legacy"))
    assert legacy == [["BlockStored", [H[0]], None, list(range(4)), BLOCK_SIZE, None, "CPU",
                       None, [None]],
                      ["BlockRemoved", [H[0]], "CPU"], ["AllBlocksCleared"]]


def _wait(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _publisher(**kw: Any) -> KvEventPublisher:
    cfg = EventsConfig(**{"zmq_endpoint": "tcp://127.0.0.1:*",
                          "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC,
                          "batch_ms": 0, **kw})
    return KvEventPublisher(cfg, block_size=BLOCK_SIZE, medium="CPU")


def test_publisher_replay_older_than_its_buffer_is_reported() -> None:
    """A replay from before the bounded buffer starts at the oldest batch kept."""
    pub = _publisher(replay_buffer=3)
    pub.start()
    try:
        for i in range(6):
            pub.submit(stored_ev(bytes([i]) * 16, b"", "ns-0011223344556677",
                                 b"\x01\x00\x00\x00" * 4))
            _wait(lambda i=i: pub.next_seq > i, "one batch per event")  # type: ignore[misc]
        c = Consumer(pub.endpoint, pub.replay_endpoint)
        try:
            c.sync()
            assert c.lost == [(0, 3)]  # batches 0..2 are gone: resynchronise from scratch
            assert sorted(c.batches) == [3, 4, 5]
            (ev,) = decode(c.batches[5])
            assert ev["block_hashes"] == [int("05" * 8, 16)] and ev["token_ids"] == [1] * 4
            # A malformed request is answered with the end marker only; the socket keeps
            # serving.
            sock = c.ctx.socket(zmq.DEALER)
            sock.connect(pub.replay_endpoint)
            sock.send_multipart([b"", b"bad"])
            assert sock.poll(5000)
            assert sock.recv_multipart() == [b"", b"", END_SEQ, b""]
            sock.close(linger=0)
            assert [s for s, _ in c.replay(4)] == [4, 5]
            assert pub.stats()["replays_served"] == 2  # the malformed one is not counted
        finally:
            c.close()
    finally:
        pub.stop()
    pub.submit(Event(7, REMOVED, (b"\x00" * 16,)))  # after stop: dropped, never raises


def test_legacy_wire_format_replays_without_the_topic_frame() -> None:
    pub = _publisher(wire_format="legacy")
    pub.start()
    ctx = zmq.Context()
    try:
        pub.submit(stored_ev(K[0], b"", "ns-a"))
        _wait(lambda: pub.next_seq == 1, "the batch")
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pub.replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert sock.poll(5000)
        empty, seq, payload = sock.recv_multipart()
        assert (empty, seq) == (b"", bytes(8))
        assert decode(payload)[0][0] == "BlockStored"
        assert sock.poll(5000) and sock.recv_multipart() == [b"", END_SEQ, b""]
    finally:
        ctx.destroy(linger=0)
        pub.stop()


def test_stats_count_subscribers_replays_and_drops() -> None:
    pub = _publisher(hwm=3)
    assert pub.stats() == {"published_batches": 0, "published_events": 0,
                           "dropped_batches": 0, "dropped_events": 0, "replays_served": 0,
                           "replays_limited": 0, "replays_truncated": 0, "replay_bytes": 0,
                           "subscribers": 0}
    # Its thread not started yet, the publisher has fallen behind: the queue holds 3 events;
    # the next two are dropped (one run: one dropped batch).
    for i in range(5):
        pub.submit(stored_ev(K[i], b"", "ns-a"))
    assert pub.stats()["dropped_events"] == 2 and pub.stats()["dropped_batches"] == 1
    pub.start()
    ctx = zmq.Context()
    try:
        subs = [ctx.socket(zmq.SUB) for _ in range(2)]
        for s in subs:
            s.connect(pub.endpoint)
        _wait(lambda: pub.stats()["subscribers"] == 2, "two subscribers")
        subs[0].close(linger=0)
        _wait(lambda: pub.stats()["subscribers"] == 1, "one subscriber left")
        _wait(lambda: pub.stats()["published_events"] == 3, "the three queued events")
        pub.submit(stored_ev(K[0], b"", "ns-b"))  # after the run: AllBlocksCleared first
        _wait(lambda: pub.stats()["published_events"] == 5, "the clear and the event")
        events = [e for _, p in replay(ctx, pub.replay_endpoint, 0) for e in decode(p)]
        assert [(e["type"], e.get("block_hashes")) for e in events] == [
            ("BlockStored", [H[0]]), ("BlockStored", [H[1]]), ("BlockStored", [H[2]]),
            ("AllBlocksCleared", None), ("BlockStored", [H[0]])]
        stats = pub.stats()
        assert stats["published_batches"] == pub.next_seq >= 2
        assert (stats["replays_served"], stats["dropped_batches"]) == (1, 1)
    finally:
        ctx.destroy(linger=0)
        pub.stop()


def test_publisher_can_connect_to_a_binding_consumer() -> None:
    """llm-d's indexer binds one SUB socket and every publisher connects to it."""
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.bind("tcp://127.0.0.1:*")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        cfg = EventsConfig(zmq_endpoint=sub.getsockopt_string(zmq.LAST_ENDPOINT),
                           zmq_connect=True, pod_id="pod-a", model_name="tiny", batch_ms=0)
        pub = KvEventPublisher(cfg, block_size=BLOCK_SIZE, medium="CPU")
        pub.start()
        try:
            # A binding SUB sends its subscription to a connecting PUB only once it has polled
            # (libzmq#2267); a consumer's receive loop does that anyway.
            for _ in range(4):
                sub.poll(50)
            _wait(lambda: pub.stats()["subscribers"] == 1, "the connection counted")
            pub.submit(Event(1, CLEARED))
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert (topic, seq) == (b"kv@pod-a@tiny", bytes(8))
            assert decode(payload) == [{"type": "AllBlocksCleared"}]
        finally:
            pub.stop()
    finally:
        ctx.destroy(linger=0)


def test_topic_and_format_settings_are_checked() -> None:
    env = {"POD_IP": "10.0.0.5", "POD_NAME": "blockd-0"}
    cfg = EventsConfig(model_name="org/model")
    assert cfg.resolved_topic(env) == "kv@10.0.0.5@org/model"
    assert cfg.resolved_topic({"POD_NAME": "blockd-0"}) == "kv@blockd-0@org/model"
    assert EventsConfig(model_name="m", pod_id="p:8000").resolved_topic(env) == "kv@p:8000@m"
    assert EventsConfig(topic="mine", model_name="m").resolved_topic(env) == "mine"
    assert EventsConfig().resolved_topic(env) == ""  # vLLM's default topic
    bad: list[tuple[Callable[[], Any], str]] = [
        (lambda: EventsConfig(model_name="replace-me"), "events.model_name"),
        (lambda: EventsConfig(model_name="<your model>"), "events.model_name"),
        (lambda: EventsConfig(wire_format="msgpack"), "events.wire_format"),
        (lambda: EventsConfig(pod_id="a@b"), "events.pod_id"),
        (lambda: EventsConfig(hwm=0), "events.hwm"),
        (lambda: EventsConfig(max_batch=0), "events.max_batch"),
        (lambda: EventsConfig(topic="t", labels=True, wire_format="legacy").check(),
         "events.labels"),
    ]
    for fn, field in bad:
        with pytest.raises(InvalidArgument) as exc:
            fn()
        assert exc.value.field == field, exc.value


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
