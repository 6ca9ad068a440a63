"""Block events in vLLM's KV-events wire format: a ZMQ PUB stream and a ROUTER replay socket.

The ``EventLog`` stays the single source of events (and of WatchEvents' sequence numbers). This
module only re-encodes its ``Event`` records, so both paths carry the same facts: token ids are
already withheld for private tenants, and no salt or private tenant id is ever in an ``Event``.

Threads: the event loop calls ``submit`` (one ``SimpleQueue.put``; never blocks, never raises).
A publisher thread batches events (``batch_ms`` / ``max_batch``), encodes each batch once, keeps
it in a bounded replay buffer and sends it on the PUB socket (which drops rather than blocks for
a slow subscriber). A replay thread owns the ROUTER socket and answers replay requests from a
snapshot of that buffer, so a replay never delays publishing. Each socket is used by one thread
only; the two threads share the buffer under a lock. The wire format is in docs/kv_events.md.
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

from blockd.config import EventsConfig
from blockd.core.errors import FailedPrecondition, InvalidArgument
from blockd.runtime.events import CLEARED, REMOVED, STORED, Event

log = logging.getLogger("blockd.kv_events")

#: The sequence number that ends a replay: -1 as a signed 64-bit big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: First element of every extra_keys entry: whose labels follow.
EXTRA_KEYS_TAG = "blockd"

_FLUSH = object()


def block_hash(key: bytes) -> int:
    """A 16-byte block key as the unsigned 64-bit hash routers see: its first 8 bytes, big-endian.

    Routers use it to score and link blocks, never for correctness: blockd verifies every
    prefix hit by token ids and namespace, so a collision here can only misroute a request.
    """
    return int.from_bytes(key[:8], "big")


def _tokens(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw)) if raw else []


def encode_events(events: Iterable[Event], *, block_size: int, medium: str,
                  extra_keys: bool = True) -> list[list[Any]]:
    """The tagged arrays of one batch, in order.

    Consecutive stored blocks of one chain (same namespace, each the parent of the next) become
    one ``BlockStored``, as vLLM publishes a request's new blocks; consecutive removals become
    one ``BlockRemoved``.
    """
    out: list[list[Any]] = []
    open_kind = ""
    open_ctx: tuple[str, str, str] = ("", "", "")
    last_key = b""
    for ev in events:
        if ev.kind == STORED:
            ctx = (ev.namespace, ev.tenant, ev.lora_id)
            hashes = [block_hash(k) for k in ev.block_hashes]
            tokens = _tokens(ev.token_bytes)
            entries = [(EXTRA_KEYS_TAG, ev.namespace, ev.tenant)] * len(hashes)
            if (open_kind == STORED and ctx == open_ctx and last_key
                    and ev.parent_hash == last_key):
                cur = out[-1]
                cur[1].extend(hashes)
                cur[3].extend(tokens)
                if extra_keys:
                    cur[8].extend(entries)
            else:
                parent = block_hash(ev.parent_hash) if ev.parent_hash else None
                cur = ["BlockStored", hashes, parent, tokens, block_size, None, medium,
                       ev.lora_id or None]
                if extra_keys:
                    cur.append(list(entries))
                out.append(cur)
                open_kind, open_ctx = STORED, ctx
            last_key = ev.block_hashes[-1] if ev.block_hashes else b""
        elif ev.kind == REMOVED:
            hashes = [block_hash(k) for k in ev.block_hashes]
            if open_kind == REMOVED:
                out[-1][1].extend(hashes)
            else:
                out.append(["BlockRemoved", hashes, medium])
                open_kind = REMOVED
        elif ev.kind == CLEARED:
            out.append(["AllBlocksCleared"])
            open_kind = CLEARED
        else:  # pragma: no cover - EventLog makes no other kinds
            log.warning("unknown event kind %r not published", ev.kind)
    return out


def encode_batch(events: Iterable[Event], *, ts: float, block_size: int, medium: str,
                 extra_keys: bool = True) -> bytes:
    """One msgpack ``EventBatch``: ``[ts, [event, ...], data_parallel_rank=0]``."""
    body = [float(ts), encode_events(events, block_size=block_size, medium=medium,
                                     extra_keys=extra_keys), 0]
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return payload


class KvEventPublisher:
    """Publishes ``Event`` records as vLLM KV-event batches on ZMQ; serves replays."""

    def __init__(self, cfg: EventsConfig, *, block_size: int, medium: str) -> None:
        if not cfg.zmq_endpoint:
            raise InvalidArgument("events.zmq_endpoint is empty", field="events.zmq_endpoint")
        if cfg.batch_ms < 0:
            raise InvalidArgument("events.batch_ms must be >= 0", field="events.batch_ms")
        if cfg.max_batch < 1:
            raise InvalidArgument("events.max_batch must be >= 1", field="events.max_batch")
        if cfg.replay_buffer < 1:
            raise InvalidArgument("events.replay_buffer must be >= 1",
                                  field="events.replay_buffer")
        if cfg.hwm < 0:
            raise InvalidArgument("events.hwm must be >= 0", field="events.hwm")
        self.cfg = cfg
        self.block_size = block_size
        self.medium = medium
        self.topic = cfg.topic.encode("utf-8")
        #: Bound endpoints (a "*" port resolved), set by ``start``.
        self.endpoint = ""
        self.replay_endpoint = ""
        #: Sequence number of the next batch: 0 first, +1 per batch (vLLM's numbering).
        self.next_seq = 0
        self.batches_published = 0
        self.events_published = 0
        self.replays_served = 0
        self.events_dropped = 0
        self._overflowed = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.replay_buffer)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._closed = False
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._router: zmq.Socket[Any] | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets (errors surface here) and start the threads."""
        ctx: zmq.Context[Any] = zmq.Context()
        where = "events.zmq_endpoint"
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.cfg.hwm)
            pub.setsockopt(zmq.LINGER, 500)
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
                router.bind(self.cfg.replay_endpoint)
                self._router = router
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            ctx.destroy(linger=0)
            self._pub = self._router = None
            verb = "connect to" if self.cfg.zmq_connect and where.endswith("zmq_endpoint") \
                else "bind"
            raise FailedPrecondition(f"cannot {verb} {getattr(self.cfg, where.split('.')[1])!r}: "
                                     f"{exc}", field=where) from None
        self._ctx = ctx
        self._threads = [threading.Thread(target=self._publish_loop, name="blockd-kv-pub",
                                          daemon=True)]
        if self._router is not None:
            self._threads.append(threading.Thread(target=self._replay_loop,
                                                  name="blockd-kv-replay", daemon=True))
        for t in self._threads:
            t.start()
        log.info("kv events publishing endpoint=%s (%s) replay=%s topic=%s", self.endpoint,
                 "connected" if self.cfg.zmq_connect else "bound", self.replay_endpoint or "-",
                 self.cfg.topic)

    def submit(self, ev: Event) -> None:
        """The EventLog listener: O(1), thread-safe, never blocks or raises.

        The queue is bounded by ``events.hwm``: if the publisher thread falls that far behind,
        events are dropped rather than held, and the next batch starts with AllBlocksCleared so
        that consumers drop their view instead of keeping a silently incomplete one.
        """
        if self._closed:
            return
        if self._queue.qsize() >= self.cfg.hwm:
            self.events_dropped += 1
            self._overflowed = True
            return
        self._queue.put(ev)

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
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.term()
        log.info("kv events stopped batches=%d events=%d replays=%d", self.batches_published,
                 self.events_published, self.replays_served)

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
        if self._overflowed:
            self._overflowed = False
            log.warning("kv events queue overflowed: %d events dropped, announcing "
                        "AllBlocksCleared", self.events_dropped)
            batch = [Event(0, CLEARED), *batch]
        try:
            payload = encode_batch(batch, ts=time.time(), block_size=self.block_size,
                                   medium=self.medium, extra_keys=self.cfg.extra_keys)
        except Exception:
            log.exception("encoding a batch of %d events failed; they are not published",
                          len(batch))
            return
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:  # buffered before it is sent: whoever sees seq N can replay N
            self._buffer.append((seq, payload))
        assert self._pub is not None
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # PUB drops rather than blocks; this is unexpected
            log.warning("publishing batch %d failed: %s", seq, exc)
        self.batches_published += 1
        self.events_published += len(batch)

    # -- replay (replay thread) ----------------------------------------------------------------

    def buffered(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The buffered batches with sequence number >= ``start_seq``, oldest first."""
        with self._lock:
            if not self._buffer:
                return []
            skip = max(0, start_seq - self._buffer[0][0])
            return list(itertools.islice(self._buffer, skip, None))

    def _replay_loop(self) -> None:
        router = self._router
        assert router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stopping.is_set():
                    return
                log.warning("replay socket error: %s", exc)
                continue
            try:
                self._serve_replay(router, frames)
            except Exception:
                log.exception("serving a replay request failed")

    def _serve_replay(self, router: zmq.Socket[Any], frames: list[bytes]) -> None:
        # [identity, b"", start_seq]: a REQ client adds the empty delimiter itself; a DEALER
        # client sends it explicitly.
        identity = frames[0]
        body = frames[2:] if len(frames) >= 3 and frames[1] == b"" else frames[1:]
        if len(body) != 1 or len(body[0]) != 8:
            log.debug("malformed replay request (%d frames); answered with END only", len(frames))
            router.send_multipart([identity, b"", END_SEQ, b""])
            return
        start = int.from_bytes(body[0], "big")
        batches = self.buffered(start)
        for seq, payload in batches:
            router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload],
                                  flags=zmq.NOBLOCK, copy=False)
        router.send_multipart([identity, b"", END_SEQ, b""], flags=zmq.NOBLOCK)
        self.replays_served += 1
        log.debug("replayed batches=%d from seq=%d", len(batches), start)
