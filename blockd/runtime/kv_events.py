"""Block events in vLLM's KV-events wire format: a ZMQ PUB stream and a ROUTER replay socket.

The ``EventLog`` stays the single source of events (and of WatchEvents' sequence numbers). This
module only re-encodes the ``Event`` views the log hands its listeners (audience ``ANYONE``: a
private tenant's token ids are already withheld, and no salt or private tenant id is ever in an
``Event``). The format is what the installed vLLM's ``vllm.distributed.kv_events`` encodes and
decodes (``tests/contract`` proves it against vLLM's own classes and publisher); the details are
in docs/kv_events.md.

Threads: the event loop calls ``submit`` (one ``SimpleQueue.put``; never blocks, never raises).
A publisher thread batches events (``batch_ms`` / ``max_batch``), encodes each batch once, keeps
it in a bounded replay buffer and sends it on the PUB socket (which drops rather than blocks for
a slow subscriber). A socket thread owns the ROUTER socket and the PUB socket's monitor: it
answers replay requests from a snapshot of that buffer, so a replay never delays publishing,
each answer bounded per request, per peer and in all (``blockd.runtime.kv_replay``), and counts
the PUB socket's connected peers. Each socket is used by one thread only; the threads
share the buffer and the counters under locks.

Who may read (docs/security.md): without CURVE the sockets are unauthenticated, so a private
tenant's LoRA name (``lora_name``, ``extra_keys``) is withheld (nil) like its token ids; bind
them to loopback, or set ``events.curve_secret_key_file``: PUB and ROUTER then require CURVE,
and only the public keys in ``events.curve_client_keys`` are admitted (pyzmq's ZAP
authenticator), who also get private tenants' LoRA names.
"""

from __future__ import annotations

import itertools
import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from blockd import logs
from blockd.core.errors import FailedPrecondition, InvalidArgument
from blockd.events_config import EventsConfig
from blockd.runtime import kv_curve
from blockd.runtime.events import CLEARED, REMOVED, STORED, Event, medium_of
from blockd.runtime.kv_replay import END_SEQ as END_SEQ
from blockd.runtime.kv_replay import ReplayLimits

log = logging.getLogger("blockd.kv_events")

#: The optional BlockStored field with blockd's labels (``events.labels``); vLLM has no field
#: of that name, so its decoder skips it.
LABELS_FIELD = "blockd"

_FLUSH = object()
_PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def block_hash(key: bytes) -> int:
    """A 16-byte block key as the unsigned 64-bit hash routers see: its first 8 bytes, big-endian.

    Routers use it to score and link blocks, never for correctness: blockd verifies every
    prefix hit by token ids and namespace, so a collision here can only misroute a request.
    """
    return int.from_bytes(key[:8], "big")


def _tokens(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw)) if raw else []


class _Stored:
    """One BlockStored being assembled: a chain of blocks of one namespace."""

    __slots__ = ("hashes", "parent", "tokens", "lora", "namespace", "tenant", "medium")

    def __init__(self, ev: Event, lora: str, medium: str) -> None:
        self.hashes: list[int] = []
        self.parent = block_hash(ev.parent_hash) if ev.parent_hash else None
        self.tokens: list[int] = []
        self.lora, self.namespace, self.tenant = lora, ev.namespace, ev.tenant
        self.medium = medium


def encode_events(events: Iterable[Event], *, block_size: int, medium: str,
                  wire_format: str = "vllm", extra_keys: bool = True,
                  labels: bool = False, private_lora: bool = False) -> list[Any]:
    """The events of one batch, in order, as vLLM's ``KVCacheEvent`` values.

    Consecutive stored blocks of one chain (same namespace and medium, each the parent of the
    next) become one ``BlockStored``, as vLLM publishes a request's new blocks; consecutive
    removals of one medium become one ``BlockRemoved``. ``medium`` is the pool's (vLLM's name
    for its backend's memory); a lower tier's events carry theirs (``events.medium_of``).
    ``wire_format`` "vllm": tagged maps (vLLM's current msgspec encoding, ``omit_defaults``:
    the tag first, then the fields in vLLM's order, defaults left out);
    "legacy": the pre-0.26 tagged arrays. A private tenant's LoRA name is published only with
    ``private_lora`` (an authenticated socket); otherwise it is nil, like the base model's.
    """
    groups: list[Any] = []  # _Stored, ("removed", medium, [hash, ...]) or ("cleared",)
    last_key = b""
    for ev in events:
        where = medium_of(ev.tier, medium)
        if ev.kind == STORED:
            lora = "" if ev.private and not private_lora else ev.lora_id
            cur = groups[-1] if groups else None
            if not (isinstance(cur, _Stored) and last_key and ev.parent_hash == last_key
                    and (cur.lora, cur.namespace, cur.tenant, cur.medium)
                    == (lora, ev.namespace, ev.tenant, where)):
                cur = _Stored(ev, lora, where)
                groups.append(cur)
            cur.hashes.extend(block_hash(k) for k in ev.block_hashes)
            cur.tokens.extend(_tokens(ev.token_bytes))
            last_key = ev.block_hashes[-1] if ev.block_hashes else b""
            continue
        last_key = b""
        if ev.kind == REMOVED:
            hashes = [block_hash(k) for k in ev.block_hashes]
            if (groups and isinstance(groups[-1], tuple) and groups[-1][0] == "removed"
                    and groups[-1][1] == where):
                groups[-1][2].extend(hashes)
            else:
                groups.append(("removed", where, hashes))
        elif ev.kind == CLEARED:
            groups.append(("cleared",))
        else:  # pragma: no cover - EventLog makes no other kinds
            log.warning("unknown event kind %r not published", ev.kind)
    legacy = wire_format == "legacy"
    out: list[Any] = []
    for g in groups:
        if isinstance(g, _Stored):
            out.append(_stored(g, block_size, legacy, extra_keys, labels))
        elif g[0] == "removed":
            out.append(["BlockRemoved", g[2], g[1]] if legacy else
                       {"type": "BlockRemoved", "block_hashes": g[2], "medium": g[1]})
        else:
            out.append(["AllBlocksCleared"] if legacy else {"type": "AllBlocksCleared"})
    return out


def _stored(g: _Stored, block_size: int, legacy: bool, extra_keys: bool, labels: bool) -> Any:
    """vLLM's BlockStored. ``lora_id`` (vLLM's integer adapter id) has no blockd counterpart:
    nil. ``extra_keys``, one entry per block, are vLLM's block-hash extra inputs as it publishes
    them: the LoRA name, or nil; the cache salt that vLLM adds to a first block is never
    published (blockd's namespace, salt included, is already in the hash)."""
    lora = g.lora or None
    values: list[Any] = [g.hashes, g.parent, g.tokens, block_size, None, g.medium, lora]
    if extra_keys:
        values.append([(lora,) if lora else None for _ in g.hashes])
    if legacy:
        return ["BlockStored", *values]
    names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name", "extra_keys")
    event: dict[str, Any] = {"type": "BlockStored", **dict(zip(names, values, strict=False))}
    if labels:
        event[LABELS_FIELD] = {"namespace": g.namespace, "tenant": g.tenant}
    return event


def encode_batch(events: Iterable[Event], *, ts: float, block_size: int, medium: str,
                 wire_format: str = "vllm", extra_keys: bool = True,
                 labels: bool = False, private_lora: bool = False) -> bytes:
    """One msgpack ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank=0]`` (an array in
    both formats; vLLM's publisher sets the rank, 0 for a single engine)."""
    return _pack(ts, encode_events(events, block_size=block_size, medium=medium,
                                   wire_format=wire_format, extra_keys=extra_keys,
                                   labels=labels, private_lora=private_lora))


def _pack(ts: float, events: list[Any]) -> bytes:
    payload: bytes = msgpack.packb([float(ts), events, 0], use_bin_type=True)
    return payload


class KvEventPublisher:
    """Publishes ``Event`` views as vLLM KV-event batches on ZMQ; serves replays."""

    def __init__(self, cfg: EventsConfig, *, block_size: int, medium: str) -> None:
        if not cfg.zmq_endpoint:
            raise InvalidArgument("events.zmq_endpoint is empty", field="events.zmq_endpoint")
        cfg.check()
        self.cfg = cfg
        self.block_size = block_size
        self.medium = medium
        #: The topic frame of every message (``EventsConfig.resolved_topic``).
        self.topic = cfg.resolved_topic().encode("utf-8")
        if not self.topic:
            log.warning("KV events are published under vLLM's default empty topic: llm-d's "
                        "KV-cache indexer needs kv@<pod>@<model>; set events.model_name (the "
                        "model the router scores requests for) or events.topic",
                        extra=logs.fields(endpoint=cfg.zmq_endpoint))
        self.legacy = cfg.wire_format == "legacy"
        #: Bound endpoints (a "*" port resolved), set by ``start``.
        self.endpoint = ""
        self.replay_endpoint = ""
        #: Sequence number of the next batch: 0 first, +1 per batch (vLLM's numbering).
        self.next_seq = 0
        self._counts = dict.fromkeys(("published_batches", "published_events",
                                      "dropped_batches", "dropped_events", "replays_served",
                                      "replays_limited", "replays_truncated", "replay_bytes"), 0)
        self._peers: set[int] = set()
        self._stats_lock = threading.Lock()
        self._overflowed = False  # event loop only
        self._lost = False  # publisher thread only
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.replay_buffer)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._closed = False
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._router: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._threads: list[threading.Thread] = []
        secret = kv_curve.read_secret(cfg)
        #: CURVE on the sockets (``blockd.runtime.kv_curve``), None without it.
        self.curve = kv_curve.CurveServer(secret, kv_curve.client_keys(cfg)) if secret else None
        #: The replay answers' bounds (socket thread only).
        self.replay_limits = ReplayLimits(cfg, topic=self.topic, legacy=self.legacy)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets (errors surface here) and start the threads."""
        ctx: zmq.Context[Any] = zmq.Context()
        where = "events.zmq_endpoint"
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.cfg.hwm)
            pub.setsockopt(zmq.LINGER, 500)
            if self.curve is not None:
                self.curve.secure(ctx, pub)
            self._monitor = pub.get_monitor_socket(_PEER_EVENTS)
            if self.cfg.zmq_connect:
                pub.connect(self.cfg.zmq_endpoint)
            else:
                pub.bind(self.cfg.zmq_endpoint)
            self._pub = pub
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.cfg.replay_endpoint:
                where = "events.replay_endpoint"
                router = ctx.socket(zmq.ROUTER)
                # A full replay must fit the send queue, or its tail (and END) would be dropped.
                router.setsockopt(zmq.SNDHWM, max(1000, 2 * (self.cfg.replay_buffer + 1)))
                router.setsockopt(zmq.LINGER, 0)
                if self.curve is not None:
                    self.curve.secure(ctx, router)
                router.bind(self.cfg.replay_endpoint)
                self._router = router
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if self.curve is not None:
                self.curve.stop()
            ctx.destroy(linger=0)
            self._pub = self._router = self._monitor = None
            verb = "connect to" if self.cfg.zmq_connect and where.endswith("zmq_endpoint") \
                else "bind"
            raise FailedPrecondition(f"cannot {verb} {getattr(self.cfg, where.split('.')[1])!r}: "
                                     f"{exc}", field=where) from None
        self._ctx = ctx
        self._threads = [threading.Thread(target=self._publish_loop, name="blockd-kv-pub",
                                          daemon=True),
                         threading.Thread(target=self._socket_loop, name="blockd-kv-sockets",
                                          daemon=True)]
        for t in self._threads:
            t.start()
        log.info("kv events publishing", extra=logs.fields(
            endpoint=self.endpoint, mode="connected" if self.cfg.zmq_connect else "bound",
            replay=self.replay_endpoint or None, topic=self.topic.decode(),
            wire_format=self.cfg.wire_format, curve=self.curve is not None))

    def submit(self, ev: Event) -> None:
        """The EventLog listener (on the event loop): O(1), never blocks or raises.

        The queue is bounded by ``events.hwm``: if the publisher thread falls that far behind,
        events are dropped rather than held (counted in ``dropped_events``; each unbroken run of
        them in ``dropped_batches``), and the first event queued after the run is preceded by
        AllBlocksCleared, so that consumers drop their view instead of keeping a silently
        incomplete one (the dropped events never got a sequence number: no replay has them).
        """
        if self._closed:
            return
        if self._queue.qsize() >= self.cfg.hwm:
            with self._stats_lock:
                self._counts["dropped_events"] += 1
                if not self._overflowed:
                    self._counts["dropped_batches"] += 1
            self._overflowed = True
            return
        if self._overflowed:
            self._overflowed = False
            self._queue.put(Event(0, CLEARED))
        self._queue.put(ev)

    def stats(self) -> dict[str, int]:
        """Counters since start, safe to read from any thread (docs/kv_events.md, "Counters").

        ``published_batches``/``published_events``: batches sent on the PUB socket and the
        vLLM events (BlockStored, BlockRemoved, AllBlocksCleared) in them. ``dropped_batches``:
        batches lost before a consumer could see them (a run of events dropped by a full
        queue, a batch that failed to encode, or one the PUB socket refused; the last kind can
        be replayed). ``dropped_events``: blockd's events (one per block, or a clear) in the
        first two kinds. ``replays_served``: replay requests answered (``replays_truncated``
        of them ended before the newest batch); ``replays_limited``: requests answered with
        the end marker only (the peer's rate or the byte budget spent); ``replay_bytes``:
        bytes of the batches replays carried. ``subscribers``: peers connected to the PUB
        socket now (the socket monitor's accepted or connected minus disconnected
        connections, whatever topics they subscribe to).
        """
        with self._stats_lock:
            out = dict(self._counts)
            out["subscribers"] = len(self._peers)
        return out

    def stop(self, timeout: float = 5.0) -> None:
        """Publish what is queued, stop the threads and close the sockets (blocking)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._stopping.set()
        for t in self._threads:
            t.join(timeout)
        if any(t.is_alive() for t in self._threads):
            log.warning("kv events threads did not stop within %.1fs", timeout)
            return  # the sockets are still in use; daemon threads die with the process
        if self._pub is not None:
            self._pub.disable_monitor()
        for sock in (self._monitor, self._pub, self._router):
            if sock is not None:
                sock.close(linger=0 if sock is not self._pub else None)
        if self.curve is not None:
            self.curve.stop()
        if self._ctx is not None:
            self._ctx.term()
        log.info("kv events stopped", extra=logs.fields(**self.stats()))

    # -- publishing (publisher thread) ---------------------------------------------------------

    def _publish_loop(self) -> None:
        q = self._queue
        batch_s = self.cfg.batch_ms / 1000
        batch: list[Event] = []
        deadline = 0.0
        while True:
            try:
                item = q.get(timeout=max(0.0, deadline - time.monotonic()) if batch else None)
            except queue.Empty:
                item = _FLUSH
            if item is None:  # stop: drain what is left, then leave
                while True:
                    try:
                        rest = q.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(rest, Event):
                        batch.append(rest)
                for i in range(0, len(batch), self.cfg.max_batch):
                    self._flush(batch[i:i + self.cfg.max_batch])
                return
            if item is _FLUSH:
                self._flush(batch)
                batch = []
                continue
            batch.append(item)
            if len(batch) == 1:
                deadline = time.monotonic() + batch_s
            if len(batch) >= self.cfg.max_batch:
                self._flush(batch)
                batch = []

    def _flush(self, batch: list[Event]) -> None:
        if not batch:
            return
        if self._lost:  # the previous batch never got a sequence number: say so
            self._lost = False
            batch = [Event(0, CLEARED), *batch]
        try:
            events = encode_events(batch, block_size=self.block_size, medium=self.medium,
                                   wire_format=self.cfg.wire_format,
                                   extra_keys=self.cfg.extra_keys, labels=self.cfg.labels,
                                   private_lora=self.curve is not None)
            payload = _pack(time.time(), events)
        except Exception:
            log.exception("encoding a batch failed; it is not published",
                          extra=logs.fields(events=len(batch)))
            self._lost = True
            with self._stats_lock:
                self._counts["dropped_batches"] += 1
                self._counts["dropped_events"] += len(batch)
            return
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:  # buffered before it is sent: whoever sees seq N can replay N
            self._buffer.append((seq, payload))
        assert self._pub is not None
        sent = True
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # PUB drops rather than blocks; this is unexpected
            sent = False
            log.warning("publishing a batch failed (it can be replayed)",
                        extra=logs.fields(seq=seq, error=str(exc)))
        with self._stats_lock:
            if sent:
                self._counts["published_batches"] += 1
                self._counts["published_events"] += len(events)
            else:
                self._counts["dropped_batches"] += 1

    # -- replay and peers (socket thread) ------------------------------------------------------

    def buffered(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The buffered batches with sequence number >= ``start_seq``, oldest first."""
        with self._lock:
            if not self._buffer:
                return []
            skip = max(0, start_seq - self._buffer[0][0])
            return list(itertools.islice(self._buffer, skip, None))

    def _socket_loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = dict(poller.poll(100))
                if self._monitor is not None and self._monitor in ready:
                    self._on_monitor(self._monitor)
                if self._router is not None and self._router in ready:
                    frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._serve_replay(self._router, frames)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stopping.is_set():
                    return
                log.warning("kv events socket error", extra=logs.fields(error=str(exc)))
            except Exception:
                log.exception("serving the kv events sockets failed")

    def _on_monitor(self, monitor: zmq.Socket[Any]) -> None:
        msg = recv_monitor_message(monitor, zmq.NOBLOCK)
        event, fd = msg["event"], int(msg["value"])  # the connection's file descriptor
        with self._stats_lock:
            if event == zmq.EVENT_DISCONNECTED:
                self._peers.discard(fd)
            elif event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self._peers.add(fd)

    def _serve_replay(self, router: zmq.Socket[Any], frames: list[zmq.Frame]) -> None:
        # [identity, b"", start_seq]: a REQ client adds the empty delimiter itself; a DEALER
        # client sends it explicitly (one without it is served too).
        raw = [f.bytes for f in frames]
        identity = raw[0]
        body = raw[2:] if len(raw) >= 3 and raw[1] == b"" else raw[1:]
        answer = self.replay_limits.answer(identity, body, _peer(frames), self.buffered)
        *batches, end = answer.messages
        for message in batches:
            router.send_multipart(message, flags=zmq.NOBLOCK, copy=False)
        with self._stats_lock:  # counted before its end is sent: a client that saw the end
            if answer.outcome == "limited":  # sees the count (stats() races no more)
                self._counts["replays_limited"] += 1
            elif answer.outcome != "malformed":
                self._counts["replays_served"] += 1
                self._counts["replays_truncated"] += answer.outcome == "truncated"
                self._counts["replay_bytes"] += answer.bytes
        router.send_multipart(end, flags=zmq.NOBLOCK)
        log.debug("replay answered", extra=logs.fields(outcome=answer.outcome,
                                                       batches=answer.batches))


def _peer(frames: list[zmq.Frame]) -> str:
    """The requester as ZMQ knows it: its address (the IP over TCP), else its identity."""
    try:
        address = frames[-1].get("Peer-Address")
    except zmq.ZMQError:
        address = ""
    return str(address) if address else "id:" + frames[0].bytes.hex()
