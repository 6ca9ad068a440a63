"""Typed block events: what the core tells the outside world about its prefix index.

The core emits one record per change of the index, synchronously, to the ``EventSink`` it was
given (vLLM's ``BlockPool`` queues typed events the same way). The runtime's event log numbers
them and converts them for gRPC WatchEvents and the ZMQ KV-event publisher; the records carry
everything those need (the parent's key, the namespace's label), so nobody above the core keeps
a second copy of the index. What a subscriber may *see* of them (token ids of private tenants,
tenant labels) is decided by the runtime, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

#: Where the bytes of an event's block are: the pool, or a lower tier
#: (``blockd.core.lower_tiers``: ``"host"``, ``"disk"``). The runtime names them in vLLM's
#: media (``GPU``/``CPU`` for the pool by its backend, ``CPU``, ``STORAGE``).
POOL = "pool"


class BlockStored(NamedTuple):
    """A full, committed block entered the prefix index.

    The two per-block records are immutable tuples (``_replace`` makes a changed copy): the
    event log keeps them as they came, and one is made per block the index gains or loses,
    the daemon's hottest path (a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``; a tuple is built in one call)."""

    block: int
    #: The block's 16-byte prefix key.
    key: bytes
    #: The key of the block it chains to; b"" for the first block of a prefix.
    parent_key: bytes
    #: Its token ids, uint32 little-endian.
    token_bytes: bytes
    #: ``"ns-"`` + the first 8 bytes of the namespace's keyed root hash, in hex: names a
    #: namespace without revealing any of its fields.
    namespace_label: str
    lora_id: str
    #: ``private:<tenant>``, ``group:<name>`` or ``public`` (see ``blockd.core.tenants``).
    sharing_domain: str
    #: ``POOL`` (``block`` is a pool block id) or a lower tier (``block`` is its slot id).
    tier: str = POOL
    #: The namespace's 16-byte root key if this is the first block of its prefix (its parent
    #: serial is 0), else b"": with ``parent_key`` it places the block in its chain for
    #: what derives keys of its own from the chain (the remote tier). Never sent to
    #: subscribers (``blockd.runtime.events`` copies the fields they get).
    root_key: bytes = b""

    def held_by(self, tier: str) -> BlockStored:
        """The same block as ``tier`` holds it, without the root key: what a node announces of
        a block it copied there (the remote tier)."""
        return self._replace(tier=tier, root_key=b"")


class BlockRemoved(NamedTuple):
    """A block left the prefix index (evicted or flushed), or a lower tier's slot its entry.

    It names its namespace and sharing domain as its ``BlockStored`` did, so that a consumer
    shows the removal to exactly the audience that saw the block stored: block ids repeat
    across partitions, so no one above the core keeps a ``block -> labels`` mirror.
    """

    block: int
    key: bytes
    namespace_label: str
    sharing_domain: str
    tier: str = POOL


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix index is empty (a flush emptied it)."""


CoreEvent = BlockStored | BlockRemoved | AllBlocksCleared
#: Receives each event as it happens, on the caller's thread. Must not call back into the core.
EventSink = Callable[[CoreEvent], None]
