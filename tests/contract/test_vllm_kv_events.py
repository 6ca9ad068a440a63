"""blockd's KV events are vLLM's: decoded by the installed vLLM's own classes, and byte for byte
what vLLM's own ``ZmqEventPublisher`` sends for the same events, live and in replay.

Everything runs over real ZMQ sockets: a real daemon's PUB and ROUTER sockets, and vLLM's
publisher bound on ipc sockets in the test. Only the batch timestamp is normalised before
bytes are compared. When a vLLM release changes the format, these tests fail, not a user.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
from daemon_proc import TENANTS, Daemon, Worker, commit, md, release, start

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import EventsConfig
from blockd.runtime.events import CLEARED, REMOVED, STORED, Event
from blockd.runtime.kv_events import KvEventPublisher

BLOCK_SIZE = 4
TOPIC = "kv@contract-pod@tiny"
SALT = b"contract-salt-never-published"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
GROUP_NS = pb.CacheNamespace(model_id="tiny", model_revision="r1", lora_id="adapter-x")
PRIVATE_NS = pb.CacheNamespace(model_id="tiny", model_revision="r1", cache_salt=SALT)
G_TOKENS = list(range(100, 109))  # 2 full blocks (+1 token, never stored)
P_TOKENS = list(range(200, 212))  # 3 full blocks


@pytest.fixture(scope="module")
def vkv() -> ModuleType:
    """``vllm.distributed.kv_events`` of the installed vLLM, imported once for the module."""
    try:
        import vllm
        import vllm.distributed.kv_events as kv
    except Exception as exc:  # not only ImportError: a broken install raises anything
        why = (f"vLLM is not importable ({type(exc).__name__}: {exc}); the KV-event contract "
               "tests need it (make install: the vllm extra of pyproject.toml)")
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs it: a missing vLLM there is a broken install
        pytest.skip(why)
    print(f"contract against vLLM {vllm.__version__}")
    return kv


def normalised(payload: bytes) -> bytes:
    """The batch with its timestamp zeroed: a 3-array whose first element is a float64."""
    assert payload[:2] == b"\x93\xcb", payload[:16]
    return payload[:2] + bytes(8) + payload[10:]


def recv(sock: zmq.Socket[Any], what: str) -> list[bytes]:
    assert sock.poll(10_000), f"{what} did not arrive"
    return sock.recv_multipart()


def replay(ctx: zmq.Context[Any], endpoint: str, start_seq: int = 0) -> list[list[bytes]]:
    """Every frame list of one replay (after the DEALER's delimiter), the end marker included."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            frames = recv(sock, "a replay answer")
            out.append(frames)
            if frames[-2:] == [END_SEQ, b""]:
                return out
    finally:
        sock.close(linger=0)


@dataclass
class VllmPublisher:
    """vLLM's own publisher, bound on ipc sockets, with a live subscriber."""

    pub: Any
    endpoint: str
    replay_endpoint: str
    sub: zmq.Socket[Any]

    def send(self, batch: Any) -> list[bytes]:
        self.pub.publish(batch)
        return recv(self.sub, "vLLM's live batch")


@pytest.fixture
def vllm_pub(vkv: ModuleType) -> Iterator[VllmPublisher]:
    where = tempfile.mkdtemp(prefix="kvc-")  # short: ipc paths are limited to ~100 bytes
    ctx = zmq.Context()
    endpoint, replay_endpoint = f"ipc://{where}/pub", f"ipc://{where}/replay"
    pub = vkv.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint,
                                replay_endpoint=replay_endpoint, topic=TOPIC)
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        time.sleep(0.5)  # the subscription must reach vLLM's PUB socket (no signal for it)
        yield VllmPublisher(pub, endpoint, replay_endpoint, sub)
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)
        shutil.rmtree(where, ignore_errors=True)


# -- a real daemon's stream --------------------------------------------------------------------


@dataclass
class Traffic:
    live: list[list[bytes]]  # [topic, seq, payload] as the SUB received them, in order
    replay: list[list[bytes]]  # the replay from 0, end marker included
    keys: dict[str, list[bytes]]  # the blocks' 16-byte keys, from an admin's WatchEvents


def _store(w: Worker, tokens: list[int], ns: pb.CacheNamespace) -> None:
    seq = w.admit(tokens, ns).sequence_id
    w.step(commit(seq))
    w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch,
                                         completed_fence=w.fence), metadata=md(w.who))
    w.step(release(seq), fence=0)


def _until(cond: Callable[[], bool], sub: zmq.Socket[Any], live: list[list[bytes]]) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, "the daemon's batches did not arrive"
        if sub.poll(100):
            live.append(sub.recv_multipart())


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    """A group tenant stores 2 blocks under a LoRA, a private one 3 under a salt, everything is
    flushed; a subscriber connected before the first event records the live stream."""
    tenants = copy.deepcopy(TENANTS)
    d: Daemon = start(tmp_path_factory.mktemp("blockd-contract"), num_blocks=256,
                      tenants=tenants,
                      extra={"events": {"zmq_endpoint": "tcp://127.0.0.1:*",
                                        "replay_endpoint": "tcp://127.0.0.1:*",
                                        "topic": TOPIC, "batch_ms": 5}})
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(d.endpoints["kv_events"])
        time.sleep(0.3)  # the subscription must reach the daemon before its first batch
        group, private = Worker(d.stub(), "carol", "initech"), Worker(d.stub(), "alice", "acme")
        live: list[list[bytes]] = []
        _store(group, G_TOKENS, GROUP_NS)
        _store(private, P_TOKENS, PRIVATE_NS)
        assert d.stub().FlushNamespace(pb.FlushNamespaceRequest(model_id="tiny"),
                                       metadata=md("admin")).num_blocks_flushed == 5
        _until(lambda: any(f[2].endswith(b"\xb0AllBlocksCleared\x00") for f in live), sub,
               live)
        calls = d.stub().WatchEvents(pb.WatchEventsRequest(since_sequence=1),
                                     metadata=md("admin"), timeout=10)
        stored = [next(calls).block_stored for _ in range(5)]
        calls.cancel()
        keys = {"group": [k for s in stored[:2] for k in s.block_hashes],
                "private": [k for s in stored[2:] for k in s.block_hashes]}
        yield Traffic(live, replay(ctx, d.endpoints["kv_replay"]), keys)
    finally:
        ctx.destroy(linger=0)
        assert d.stop() == 0, d.log_text()


def test_vllm_decodes_the_live_stream_and_the_replay(vkv: ModuleType, traffic: Traffic) -> None:
    decoder = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
    live, answers = traffic.live, traffic.replay
    assert [f[0] for f in live] == [TOPIC.encode()] * len(live)
    assert [int.from_bytes(f[1], "big") for f in live] == list(range(len(live)))
    # The replay, in vLLM's frames: [topic, seq, payload] per batch, then [b"", END, b""].
    assert answers[-1] == [b"", b"", END_SEQ, b""]
    assert [[b"", *f] for f in live] == answers[:-1]

    events = [ev for f in live for ev in decoder.decode(f[2]).events]
    assert all(decoder.decode(f[2]).data_parallel_rank == 0 for f in live)
    stored = [e for e in events if isinstance(e, vkv.BlockStored)]
    g = [e for e in stored if e.lora_name == "adapter-x"]
    p = [e for e in stored if e.lora_name is None]
    assert len(g) + len(p) == len(stored)

    def h(key: bytes) -> int:
        return int.from_bytes(key[:8], "big")

    def joined(evs: list[Any], attr: str) -> list[Any]:
        return [x for e in evs for x in getattr(e, attr)]

    # Field by field as vLLM defines them (vllm/distributed/kv_events.py, v1/core/block_pool.py)
    assert joined(g, "block_hashes") == [h(k) for k in traffic.keys["group"]]
    assert joined(p, "block_hashes") == [h(k) for k in traffic.keys["private"]]
    assert joined(g, "token_ids") == G_TOKENS[:8] and joined(p, "token_ids") == []
    assert g[0].parent_block_hash is None and p[0].parent_block_hash is None
    for chain in (g, p):  # a batch boundary may split a chain: the parent links the parts
        for a, b in zip(chain, chain[1:], strict=False):
            assert b.parent_block_hash == a.block_hashes[-1]
    assert joined(g, "extra_keys") == [("adapter-x",)] * 2  # the LoRA name per block
    assert joined(p, "extra_keys") == [None] * 3  # nothing: the salt is never published
    for e in stored:
        assert (e.block_size, e.medium, e.lora_id) == (BLOCK_SIZE, "CPU", None)
        assert (e.group_idx, e.kv_cache_spec_kind, e.locality, e.session_id) == (
            None, None, None, None)
    removed = [e for e in events if isinstance(e, vkv.BlockRemoved)]
    assert sorted(joined(removed, "block_hashes")) == sorted(
        h(k) for k in traffic.keys["group"] + traffic.keys["private"])
    assert {e.medium for e in removed} == {"CPU"}
    assert isinstance(events[-1], vkv.AllBlocksCleared)
    assert len(stored) + len(removed) + 1 == len(events)


def test_the_bytes_are_what_vllms_publisher_sends(vkv: ModuleType, traffic: Traffic,
                                                  vllm_pub: VllmPublisher) -> None:
    """vLLM's publisher, handed the events of each of blockd's batches, sends the same frames
    (timestamp aside), live and in replay."""
    decoder = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
    for topic, seq, payload in traffic.live:
        events = decoder.decode(payload).events
        theirs = vllm_pub.send(vkv.KVEventBatch(ts=time.time(), events=events))
        assert theirs[:2] == [topic, seq]
        assert normalised(theirs[2]) == normalised(payload)
    ctx = zmq.Context()
    try:
        theirs = replay(ctx, vllm_pub.replay_endpoint)
    finally:
        ctx.destroy(linger=0)
    ours = traffic.replay
    assert [f[:3] for f in theirs] == [f[:3] for f in ours]  # delimiter, topic, seq / end
    assert [normalised(f[3]) for f in theirs[:-1]] == [normalised(f[3]) for f in ours[:-1]]
    assert theirs[-1] == ours[-1] == [b"", b"", END_SEQ, b""]


# -- the same events built independently on both sides -----------------------------------------


K = [bytes([i]) * 8 + bytes([i]) * 8 for i in range(1, 6)]
H = [int.from_bytes(k[:8], "big") for k in K]


def _tokens(*ids: int) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in ids)


def test_independently_built_events_encode_identically(vkv: ModuleType,
                                                       vllm_pub: VllmPublisher) -> None:
    """The facts of five events, once as blockd ``Event`` records, once as vLLM's own objects:
    a LoRA chain of two blocks, a private block (token ids withheld), a 2**64-1 hash,
    removals and a clear."""
    ours_events = [
        Event(1, STORED, (K[0],), b"", _tokens(1, 2, 3, 4), "ad", "ns-a", "public"),
        Event(2, STORED, (K[1],), K[0], _tokens(5, 6, 7, 8), "ad", "ns-a", "public"),
        Event(3, STORED, (b"\xff" * 16,), K[2], b"", "", "ns-b", "private:00ff00ff00ff00ff"),
        Event(4, REMOVED, (K[0], K[1])), Event(5, CLEARED)]
    theirs_events = [
        vkv.BlockStored(block_hashes=H[:2], parent_block_hash=None, token_ids=list(range(1, 9)),
                        block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name="ad",
                        extra_keys=[("ad",), ("ad",)]),
        vkv.BlockStored(block_hashes=[2**64 - 1], parent_block_hash=H[2], token_ids=[],
                        block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[None]),
        vkv.BlockRemoved(block_hashes=H[:2], medium="GPU"),
        vkv.AllBlocksCleared()]
    cfg = EventsConfig(zmq_endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                       topic=TOPIC, batch_ms=10_000, max_batch=len(ours_events))
    pub = KvEventPublisher(cfg, block_size=BLOCK_SIZE, medium="GPU")
    pub.start()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        deadline = time.monotonic() + 10
        while pub.stats()["subscribers"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # connected; now let the subscription through
        for ev in ours_events:  # max_batch of them: exactly one batch
            pub.submit(ev)
        ours = recv(sub, "blockd's live batch")
        theirs = vllm_pub.send(vkv.KVEventBatch(ts=time.time(), events=theirs_events))
        assert ours[:2] == theirs[:2] == [TOPIC.encode(), bytes(8)]
        assert normalised(ours[2]) == normalised(theirs[2])
        ours_replay, theirs_replay = replay(ctx, pub.replay_endpoint), replay(
            ctx, vllm_pub.replay_endpoint)
        assert [f[:3] for f in ours_replay] == [f[:3] for f in theirs_replay]
        assert normalised(ours_replay[0][3]) == normalised(theirs_replay[0][3])
    finally:
        ctx.destroy(linger=0)
        pub.stop()


def test_optional_labels_decode_and_legacy_does_not(vkv: ModuleType) -> None:
    """``events.labels`` adds a field vLLM's decoder skips; ``wire_format: legacy`` (the
    pre-0.26 arrays) is exactly what today's vLLM no longer decodes."""
    from blockd.runtime.kv_events import encode_batch

    evs = [Event(1, STORED, (K[0],), b"", _tokens(1, 2, 3, 4), "", "ns-a", "group:labs")]
    decoder = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
    (ev,) = decoder.decode(encode_batch(evs, ts=1.0, block_size=BLOCK_SIZE, medium="CPU",
                                        labels=True)).events
    assert isinstance(ev, vkv.BlockStored) and ev.token_ids == [1, 2, 3, 4]
    assert ev.block_hashes == [H[0]] and ev.extra_keys == [None]
    legacy = encode_batch(evs, ts=1.0, block_size=BLOCK_SIZE, medium="CPU",
                          wire_format="legacy")
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(legacy)


def test_lower_tier_events_carry_vllms_own_media_byte_for_byte(vkv: ModuleType,
                                                               vllm_pub: VllmPublisher) -> None:
    """A prefix spilled to the host tier and demoted to disk, as vLLM's offloading connector
    would publish it: BlockStored on ``MEDIUM_CPU`` and then on ``MEDIUM_STORAGE`` (vLLM's
    names, imported from it), BlockRemoved of each medium apart; the pool's on its own."""
    ours_events = [
        Event(1, STORED, (K[0],), b"", _tokens(1, 2, 3, 4), "", "ns-a", "public"),
        Event(2, STORED, (K[0],), b"", _tokens(1, 2, 3, 4), "", "ns-a", "public", tier="host"),
        Event(3, REMOVED, (K[0],)),
        Event(4, STORED, (K[0],), b"", _tokens(1, 2, 3, 4), "", "ns-a", "public", tier="disk"),
        Event(5, REMOVED, (K[0],), tier="host"),
        Event(6, REMOVED, (K[0],), tier="disk")]
    theirs_events = [
        vkv.BlockStored(block_hashes=[H[0]], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                        block_size=BLOCK_SIZE, lora_id=None, medium=vkv.MEDIUM_GPU,
                        lora_name=None, extra_keys=[None]),
        vkv.BlockStored(block_hashes=[H[0]], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                        block_size=BLOCK_SIZE, lora_id=None, medium=vkv.MEDIUM_CPU,
                        lora_name=None, extra_keys=[None]),
        vkv.BlockRemoved(block_hashes=[H[0]], medium=vkv.MEDIUM_GPU),
        vkv.BlockStored(block_hashes=[H[0]], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                        block_size=BLOCK_SIZE, lora_id=None, medium=vkv.MEDIUM_STORAGE,
                        lora_name=None, extra_keys=[None]),
        vkv.BlockRemoved(block_hashes=[H[0]], medium=vkv.MEDIUM_CPU),
        vkv.BlockRemoved(block_hashes=[H[0]], medium=vkv.MEDIUM_STORAGE)]
    from blockd.runtime.kv_events import encode_batch

    ours = encode_batch(ours_events, ts=1.0, block_size=BLOCK_SIZE, medium="GPU")
    decoded = msgspec.msgpack.Decoder(type=vkv.KVEventBatch).decode(ours).events
    assert [getattr(e, "medium", None) for e in decoded] == [
        vkv.MEDIUM_GPU, vkv.MEDIUM_CPU, vkv.MEDIUM_GPU, vkv.MEDIUM_STORAGE, vkv.MEDIUM_CPU,
        vkv.MEDIUM_STORAGE]
    theirs = vllm_pub.send(vkv.KVEventBatch(ts=1.0, events=theirs_events))
    assert normalised(theirs[2]) == normalised(ours)
