"""Block events (stored / removed / all cleared) with gap-free sequence numbers.

The core calls ``publish`` synchronously on the event loop; watchers (WatchEvents streams, and
later the ZMQ publisher) read from a bounded replay buffer, so a slow watcher can never make
the daemon hold unbounded memory: it gets OUT_OF_RANGE and resubscribes.

What an event carries is decided here, once: a private tenant's events never include token ids,
and no event ever includes a salt (the namespace label is a prefix of the keyed root hash).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from blockd.core.namespace import Namespace

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


class EventLog:
    """Bounded, sequence-numbered log of block events; watchers await new ones."""

    def __init__(self, capacity: int = 65536, block_size: int = 16) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.events: deque[Event] = deque(maxlen=capacity)
        self.next_seq = 1
        self._changed = asyncio.Event()
        #: Key of each indexed block, so a child's event can name its parent's hash.
        self._keys: dict[int, bytes] = {}

    def on_core_event(self, kind: str, data: dict[str, Any]) -> None:
        """The BlockManager's event sink."""
        if kind == STORED:
            ns: Namespace = data["ns"]
            key: bytes = data["key"]
            self._keys[data["block"]] = key
            private = ns.fields.sharing_domain.startswith("private:")
            parent = self._keys.get(data["parent"], b"") if data["parent"] >= 0 else b""
            self._append(Event(0, STORED, (key,), parent,
                               b"" if private else data["tokens"],
                               ns.fields.lora_id or "", "ns-" + ns.root_key[:8].hex()))
        elif kind == REMOVED:
            self._keys.pop(data["block"], None)
            self._append(Event(0, REMOVED, (data["key"],)))
        elif kind == CLEARED:
            self._keys.clear()
            self._append(Event(0, CLEARED))

    def _append(self, ev: Event) -> None:
        object.__setattr__(ev, "seq", self.next_seq)
        self.next_seq += 1
        self.events.append(ev)
        self._changed.set()

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
