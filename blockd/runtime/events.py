"""Block events (stored / removed / all cleared) with gap-free sequence numbers, and who may
see what of them.

The core hands ``on_core_event`` its typed events (``blockd.core.events``) synchronously, on the
event loop. Each is numbered here and kept as it came (the core's record holds everything an
``Event`` needs, and never changes); it becomes an ``Event``, the one record both gRPC
WatchEvents (``blockd.runtime.convert.watch_event``) and the ZMQ KV-event publisher
(``blockd.runtime.kv_events``) convert from, when something reads it: a daemon nobody watches
numbers and keeps its events (one per block the index gains or loses, the daemon's hottest
path) without building any. WatchEvents streams read from a bounded replay buffer, so a slow
watcher can never make the daemon hold unbounded memory: it gets OUT_OF_RANGE and resubscribes.
Listeners (the ZMQ publisher) are handed each ``Event`` as it is appended; a listener must be
O(1) and must not block.

What a reader sees is decided here, once, by its ``Audience`` (docs/kv_events.md, "Who sees
what"): every reader gets events through ``Audience.view``, never the records themselves.

- The ZMQ socket has no authentication: its audience (``ANYONE``) gets every event, but a
  private tenant's token ids never.
- A WatchEvents caller (authenticated) gets the events of the sharing domains its credential
  acts for, token ids included (a private tenant's own credential, or a router's credential that
  acts for the tenants it routes); an admin credential also gets every other event, with the
  token ids of other private tenants withheld.
- No event ever includes a salt or a private tenant's id: the namespace label is a prefix of the
  keyed root hash, and the tenant label of a private domain is a keyed digest whose key lives
  only in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from blockd.core.errors import BlockdError, StatusCode
from blockd.core.events import POOL, AllBlocksCleared, BlockRemoved, BlockStored, CoreEvent

log = logging.getLogger("blockd.events")


class OutOfRange(BlockdError):
    """The events a watcher asked for are no longer in the bounded buffer: resubscribe."""

    status = StatusCode.OUT_OF_RANGE


STORED = "stored"
REMOVED = "removed"
CLEARED = "all_cleared"
PRIVATE = "private:"

#: vLLM's medium names of the lower tiers (``vllm.distributed.kv_events``: ``MEDIUM_CPU``,
#: ``MEDIUM_STORAGE``, what its offloading connector publishes); the pool's is its backend's
#: (``GPU`` for cuda, ``CPU`` for host memory).
#: The remote tier (``blockd.runtime.remote``) has a medium of its own, ``REMOTE``: a block the
#: shared cluster holds, which this node can fetch (docs/tiers.md, "Many nodes").
TIER_MEDIA = {"host": "CPU", "disk": "STORAGE", "remote": "REMOTE"}


def medium_of(tier: str, pool_medium: str) -> str:
    """The vLLM medium of an event's tier (``blockd.core.events.POOL`` or a lower one)."""
    return TIER_MEDIA.get(tier, pool_medium)


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    kind: str
    #: 16-byte keys of the blocks concerned.
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes = b""
    #: uint32 LE token ids. In the log: every tenant's; in a view: empty where withheld.
    token_bytes: bytes = b""
    #: The namespace's LoRA adapter name ("" = the base model).
    lora_id: str = ""
    #: The namespace label (stored and removed blocks).
    namespace: str = ""
    #: The sharing domain ("public", "group:<name>"), or for a private domain
    #: "private:<keyed digest of the tenant id>" (never the raw id). Stored and removed blocks.
    tenant: str = ""
    #: Where the block's bytes are: ``"pool"``, ``"host"`` or ``"disk"`` (``medium_of``).
    tier: str = POOL

    @property
    def private(self) -> bool:
        return self.tenant.startswith(PRIVATE)


@dataclass(frozen=True, slots=True)
class Audience:
    """Who reads the events, and so which of them and which token ids it gets."""

    #: Also the events of domains it does not act for (the ZMQ socket, an admin).
    every_domain: bool
    #: Tenant labels of the domains it acts for: their events come with token ids.
    own: frozenset[str] = frozenset()

    def view(self, ev: Event) -> Event | None:
        """``ev`` as this audience may see it, or None if it may not see it at all."""
        if ev.kind == CLEARED or ev.tenant in self.own:
            return ev
        if not self.every_domain:
            return None
        if ev.private and ev.token_bytes:
            return dataclasses.replace(ev, token_bytes=b"")
        return ev


#: The unauthenticated ZMQ socket: every event; a private tenant's token ids never.
ANYONE = Audience(every_domain=True)


class EventLog:
    """Bounded, sequence-numbered log of block events; watchers await new ones."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        #: ``(sequence number, the core's record)``, oldest first (``record``).
        self.events: deque[tuple[int, CoreEvent]] = deque(maxlen=capacity)
        self.next_seq = 1
        self._changed = asyncio.Event()
        #: Called with each appended event's view (after it has its sequence number).
        self._listeners: list[tuple[Callable[[Event], None], Audience]] = []
        #: Keys the private tenants' labels; never leaves this process, new at every start.
        self._label_key = os.urandom(32)
        self._tenant_labels: dict[str, str] = {}

    def add_listener(self, fn: Callable[[Event], None], audience: Audience = ANYONE) -> None:
        """Call ``fn(view)`` for every event ``audience`` may see from now on (on the event
        loop; keep it O(1))."""
        self._listeners.append((fn, audience))

    def remove_listener(self, fn: Callable[[Event], None]) -> None:
        self._listeners = [(f, a) for f, a in self._listeners if f != fn]

    def tenant_label(self, sharing_domain: str) -> str:
        """What events say about a namespace's tenant: the domain, a digest for private ones."""
        label = self._tenant_labels.get(sharing_domain)
        if label is None:
            if sharing_domain.startswith(PRIVATE):
                tenant = sharing_domain[len(PRIVATE):].encode("utf-8")
                digest = hashlib.blake2b(tenant, key=self._label_key, digest_size=8,
                                         person=b"blockd.tenant").hexdigest()
                label = PRIVATE + digest
            else:
                label = sharing_domain
            self._tenant_labels[sharing_domain] = label
        return label

    def audience(self, domains: Iterable[str], *, every_domain: bool = False) -> Audience:
        """The audience of a credential acting for the tenants of these sharing domains."""
        return Audience(every_domain, frozenset(self.tenant_label(d) for d in domains))

    def on_core_event(self, ev: CoreEvent) -> None:
        """The BlockManager's event sink: number and keep ``ev``."""
        if not isinstance(ev, BlockStored | BlockRemoved | AllBlocksCleared):
            log.warning("unknown core event %r not logged", ev)  # pragma: no cover
            return
        seq = self.next_seq
        self.next_seq += 1
        self.events.append((seq, ev))
        self._changed.set()
        if not self._listeners:
            return
        record = self.record(seq, ev)
        for fn, audience in self._listeners:
            try:
                seen = audience.view(record)
                if seen is not None:
                    fn(seen)
            except Exception:  # a listener's failure must never reach the core
                log.exception("event listener failed; event %d not delivered to it", seq)

    def record(self, seq: int, ev: CoreEvent) -> Event:
        """Event ``seq`` as the log's readers get it (the tenant as its label)."""
        if isinstance(ev, BlockStored):
            return Event(seq, STORED, (ev.key,), ev.parent_key, token_bytes=ev.token_bytes,
                         lora_id=ev.lora_id, namespace=ev.namespace_label,
                         tenant=self.tenant_label(ev.sharing_domain), tier=ev.tier)
        if isinstance(ev, BlockRemoved):
            return Event(seq, REMOVED, (ev.key,), namespace=ev.namespace_label,
                         tenant=self.tenant_label(ev.sharing_domain), tier=ev.tier)
        return Event(seq, CLEARED)

    @property
    def oldest_seq(self) -> int:
        return self.events[0][0] if self.events else self.next_seq

    def since(self, seq: int) -> list[Event]:
        """Events with sequence number >= ``seq`` still in the buffer (the records: for the
        log's own readers; anything that leaves the daemon goes through an ``Audience``)."""
        if not self.events or seq >= self.next_seq:
            return []
        start = max(0, seq - self.events[0][0])
        record, events = self.record, self.events
        return [record(*events[i]) for i in range(start, len(events))]

    async def wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def wake(self) -> None:
        """Wake every follower waiting for an event, so that it checks its ``until`` now."""
        self._changed.set()

    async def follow(self, since: int, audience: Audience, *, until: Callable[[], bool]
                     ) -> AsyncIterator[Event]:
        """Every event ``audience`` may see from sequence number ``since`` (0: from now on), as
        they come, until ``until()`` says stop; ``OutOfRange`` if a needed event left the
        buffer (whether or not this audience would have seen it: a gap is a gap)."""
        nxt = since or self.next_seq
        if nxt < self.oldest_seq:
            raise OutOfRange(f"events before {self.oldest_seq} are gone", field="since_sequence")
        while not until():
            batch = self.since(nxt)
            if not batch:
                await self.wait()
                continue
            if batch[0].seq != nxt:  # fell behind the bounded buffer
                raise OutOfRange(f"events before {batch[0].seq} are gone",
                                 field="since_sequence")
            for ev in batch:
                seen = audience.view(ev)
                if seen is not None:
                    yield seen
            nxt = batch[-1].seq + 1
