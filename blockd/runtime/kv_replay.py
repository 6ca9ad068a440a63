"""Replay answers on the KV-event ROUTER socket, bounded per peer and in all (issue 28, finding 8).

vLLM's replay protocol (``ZmqEventPublisher._service_replay``; docs/kv_events.md, "Replay
protocol") answers an 8-byte start sequence number with every buffered batch from there on, then
an end marker. Unbounded, that is an amplifier: without CURVE anyone who reaches the socket sends
8 bytes and the daemon sends the whole buffer (3.97 MB, ~22 ms of CPU, measured), again for each
request, also after the sender left (300 requests: ~6.6 CPU-seconds). Here every answer is
bounded three ways, and every request is still answered with the end marker, so a subscriber
never waits for an answer that does not come (a REQ socket could not even send again):

* per answer, ``events.replay_max_bytes``: the batches from ``start_seq`` on, oldest first, as
  long as they fit (at least one, so a subscriber always progresses); the answer then ends with
  the end marker before the newest batch, exactly as a replay that reached the end of the buffer
  ends. The subscriber sees the gap is not closed yet and asks again from the sequence number
  after the last one it got (docs/kv_events.md, "What a consumer must do", step 3);
* per peer (the ``Peer-Address`` ZMQ reports: the IP over TCP, so reconnecting with a new
  identity does not help), a token bucket of ``events.replay_requests_per_second`` with
  ``events.replay_request_burst``: a request beyond it is answered with the end marker only;
* in all, ``events.replay_bytes_per_second``, a token bucket holding a second's worth (at least
  one full answer): many peers, or many addresses, share it.

Everything here runs on the publisher's socket thread (``KvEventPublisher._socket_loop``), the
only user of the ROUTER socket and of this state.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from blockd.events_config import EventsConfig

#: The sequence number that ends a replay: -1 as a signed 64-bit big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Most peers with a request bucket of their own; the least recently seen is forgotten first
#: (it comes back with a full bucket: the shared byte budget still holds).
MAX_PEERS = 4096

Clock = Callable[[], float]


class TokenBucket:
    """``rate`` tokens a second, at most ``capacity``; starts full. ``take`` may leave a debt
    (a negative level) that the refill pays back before anything else is taken."""

    __slots__ = ("rate", "capacity", "level", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def take(self, n: float, now: float) -> bool:
        if self.refill(now) < n:
            return False
        self.level -= n
        return True


@dataclass(frozen=True)
class Answer:
    """What to send for one request: the frames of each message, and what kind of answer it
    is (``served``: every batch asked for; ``truncated``: it ends before the newest batch;
    ``limited``: the end marker only, the peer's rate or the byte budget spent; ``malformed``:
    the end marker only, not a replay)."""

    messages: list[list[bytes]]
    outcome: str
    batches: int = 0
    bytes: int = 0


class ReplayLimits:
    """The buckets (per peer, and the shared byte budget) and the answers' shape."""

    def __init__(self, cfg: EventsConfig, *, topic: bytes, legacy: bool,
                 clock: Clock = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        #: vLLM: [b"", topic, seq, payload] per batch; legacy: [b"", seq, payload].
        self.head = [b""] if legacy else [b"", topic]
        self.end = [b"", END_SEQ, b""] if legacy else [b"", b"", END_SEQ, b""]
        self.overhead = len(b"".join(self.head)) + 8  # a batch's frames besides its payload
        self.max_bytes = cfg.replay_max_bytes
        self.budget = TokenBucket(cfg.replay_bytes_per_second,
                                  max(cfg.replay_bytes_per_second, cfg.replay_max_bytes), clock())
        self.peers: OrderedDict[str, TokenBucket] = OrderedDict()

    def _peer_allows(self, peer: str, now: float) -> bool:
        bucket = self.peers.get(peer)
        if bucket is None:
            bucket = TokenBucket(self.cfg.replay_requests_per_second,
                                 self.cfg.replay_request_burst, now)
            self.peers[peer] = bucket
            if len(self.peers) > MAX_PEERS:
                self.peers.popitem(last=False)
        else:
            self.peers.move_to_end(peer)
        return bucket.take(1, now)

    def answer(self, identity: bytes, body: list[bytes], peer: str,
               buffered: Callable[[int], list[tuple[int, bytes]]]) -> Answer:
        """The messages answering ``body`` (the request's frames after the delimiter) from
        ``peer``; ``buffered(start)`` gives the batches from ``start`` on, oldest first."""
        end = [identity, *self.end]
        now = self.clock()
        if not self._peer_allows(peer, now):
            return Answer([end], "limited")
        if len(body) != 1 or len(body[0]) != 8:
            return Answer([end], "malformed")
        batches = buffered(int.from_bytes(body[0], "big"))
        if not batches:
            return Answer([end], "served")
        room = min(self.max_bytes, self.budget.refill(now))
        if room <= 0:
            return Answer([end], "limited")
        messages: list[list[bytes]] = []
        sent = 0
        for seq, payload in batches:
            cost = self.overhead + len(payload)
            if messages and sent + cost > room:
                break
            messages.append([identity, *self.head, seq.to_bytes(8, "big"), payload])
            sent += cost
        self.budget.level -= sent  # the first batch may leave a debt: it is paid back first
        outcome = "served" if len(messages) == len(batches) else "truncated"
        return Answer([*messages, end], outcome, len(messages), sent)
