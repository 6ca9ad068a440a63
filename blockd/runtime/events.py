"""Block events (stored / removed / all cleared) with gap-free sequence numbers.

The core hands ``on_core_event`` its typed events (``blockd.core.events``) synchronously, on the
event loop. Each becomes one ``Event`` record, numbered here: the one record both gRPC
WatchEvents (``blockd.runtime.convert.watch_event``) and the ZMQ KV-event publisher
(``blockd.runtime.kv_events``) convert from. WatchEvents streams read from a bounded replay
buffer, so a slow watcher can never make the daemon hold unbounded memory: it gets OUT_OF_RANGE
and resubscribes. Listeners (the ZMQ publisher) are handed each ``Event`` as it is appended; a
listener must be O(1) and must not block.

What an event carries is decided here, once, for both paths: a private tenant's events never
include token ids, and no event ever includes a salt or a private tenant's id (the namespace
label is a prefix of the keyed root hash; the tenant label of a private domain is a keyed digest
whose key lives only in this process).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from blockd.core.errors import BlockdError, StatusCode
from blockd.core.events import AllBlocksCleared, BlockRemoved, BlockStored, CoreEvent

log = logging.getLogger("blockd.events")

class OutOfRange(BlockdError):
    """The events a watcher asked for are no longer in the bounded buffer: resubscribe."""

    status = StatusCode.OUT_OF_RANGE


STORED = "stored"
REMOVED = "removed"
CLEARED = "all_cleared"


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    kind: str
    #: 16-byte keys of the blocks concerned.
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes = b""
    #: uint32 LE token ids; empty when the namespace's tenant is private.
    token_bytes: bytes = b""
    lora_id: str = ""
    namespace: str = ""
    #: The sharing domain ("public", "group:<name>"), or for a private domain
    #: "private:<keyed digest of the tenant id>" (never the raw id).
    tenant: str = ""


class EventLog:
    """Bounded, sequence-numbered log of block events; watchers await new ones."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.events: deque[Event] = deque(maxlen=capacity)
        self.next_seq = 1
        self._changed = asyncio.Event()
        #: Called with each appended event (after it has its sequence number).
        self._listeners: list[Callable[[Event], None]] = []
        #: Keys the private tenants' labels; never leaves this process, new at every start.
        self._label_key = os.urandom(32)
        self._tenant_labels: dict[str, str] = {}

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn(event)`` for every event from now on (on the event loop; keep it O(1))."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[Event], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def tenant_label(self, sharing_domain: str) -> str:
        """What events say about a namespace's tenant: the domain, a digest for private ones."""
        label = self._tenant_labels.get(sharing_domain)
        if label is None:
            if sharing_domain.startswith("private:"):
                tenant = sharing_domain[len("private:"):].encode("utf-8")
                digest = hashlib.blake2b(tenant, key=self._label_key, digest_size=8,
                                         person=b"blockd.tenant").hexdigest()
                label = "private:" + digest
            else:
                label = sharing_domain
            self._tenant_labels[sharing_domain] = label
        return label

    def on_core_event(self, ev: CoreEvent) -> None:
        """The BlockManager's event sink."""
        if isinstance(ev, BlockStored):
            private = ev.sharing_domain.startswith("private:")
            self._append(Event(0, STORED, (ev.key,), ev.parent_key,
                               token_bytes=b"" if private else ev.token_bytes,
                               lora_id=ev.lora_id, namespace=ev.namespace_label,
                               tenant=self.tenant_label(ev.sharing_domain)))
        elif isinstance(ev, BlockRemoved):
            self._append(Event(0, REMOVED, (ev.key,)))
        elif isinstance(ev, AllBlocksCleared):
            self._append(Event(0, CLEARED))
        else:  # pragma: no cover - CoreEvent has no other members
            log.warning("unknown core event %r not logged", ev)

    def _append(self, ev: Event) -> None:
        object.__setattr__(ev, "seq", self.next_seq)
        self.next_seq += 1
        self.events.append(ev)
        self._changed.set()
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:  # a listener's failure must never reach the core
                log.exception("event listener failed; event %d not delivered to it", ev.seq)

    @property
    def oldest_seq(self) -> int:
        return self.events[0].seq if self.events else self.next_seq

    def since(self, seq: int) -> list[Event]:
        """Events with sequence number >= ``seq`` still in the buffer."""
        if not self.events or seq >= self.next_seq:
            return []
        start = max(0, seq - self.events[0].seq)
        return [self.events[i] for i in range(start, len(self.events))]

    async def wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def follow(self, since: int, *, until: Callable[[], bool]
                     ) -> AsyncIterator[Event]:
        """Every event from sequence number ``since`` (0: from now on), as they come, until
        ``until()`` says stop; ``OutOfRange`` if a needed event left the buffer."""
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
                yield ev
            nxt = batch[-1].seq + 1
