"""Snapshots of a BlockManager: its whole state as bytes, and back.

A snapshot must restore a manager that behaves *exactly* like the one it was taken from: the
daemon's crash recovery loads the last snapshot and replays the journal written after it, and
replay only reproduces the same block ids, hits and answers if every ordering the manager
depends on (the free stack, the LRU lists and stamps, dict insertion orders, namespace id
recycling, entry serials) is restored bit for bit. Pickle preserves all of these, including
shared references (a sequence and its pending commit batch share one chain list; sequences
share namespace objects).

The one piece of state pickle cannot carry is a sequence's key stream (an XXH3 state object).
Its content is a function of the namespace's root key and the token ids of the sequence's
committed blocks, so a snapshot stores those token ids instead, found in the prefix index, in
a pending commit batch, or in a verified indexed twin. When none of those holds them (the
prefix was flushed while the sequence ran, or its twin was evicted), the snapshot *first turns
prefix caching off for that sequence in the live manager*, so the live and the restored
managers never diverge; such a sequence keeps its blocks and content, and its later blocks are
simply not offered to the cache.

Security: a snapshot is a pickle and must only ever be read from the daemon's private state
directory (mode 0700, owned by the daemon's user), which the daemon checks.
"""

from __future__ import annotations

import pickle
from array import array
from collections import deque
from enum import Enum
from typing import TYPE_CHECKING

import xxhash

from blockd.core.caching import CommitBatch
from blockd.core.errors import Internal
from blockd.core.events import EventSink
from blockd.core.ids import SequenceIds
from blockd.core.prefix_index import HashFactory
from blockd.core.sequence import TailWaste

if TYPE_CHECKING:
    from blockd.core.manager import BlockManager
    from blockd.core.sequence import Sequence

#: Bumped whenever the pickled layout changes (module paths, room classes, fields). A reader
#: that finds another version must not unpickle it: the runtime starts a new epoch instead.
#: 4: TenantPolicy.isolation (issue 14). 5: entry serials instead of block generations, the
#: key table as its own object (issue 25). 6: ``BlockArrays.payer`` and ``co_holders``, a
#: block charged to each tenant that holds it (issue 28).
FORMAT_VERSION = 6


def dump(manager: BlockManager) -> bytes:
    """The manager's state as bytes (see the module docstring).

    May turn prefix caching off for sequences whose committed token ids are nowhere to be
    found; counts them in ``manager.counters.uncacheable_after_snapshot``.
    """
    prefixes = _stream_prefixes(manager)
    streams = {}
    for seq in manager.sequences.values():
        if seq.stream is not None:
            streams[seq.id] = seq.stream
            seq.stream = prefixes[seq.id]  # type: ignore[assignment]
    try:
        return pickle.dumps(manager, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for seq_id, stream in streams.items():
            manager.sequences[seq_id].stream = stream


def load(data: bytes, *, events: EventSink | None = None, ids: SequenceIds | None = None,
         hasher_factory: HashFactory | None = None) -> BlockManager:
    """A manager restored from ``dump``'s bytes; key streams are rebuilt.

    ``events`` and ``ids`` are injected again (they are not part of a snapshot).
    """
    manager: BlockManager = pickle.loads(data)  # noqa: S301 (our own private state file)
    manager.set_event_sink(events)
    manager.set_ids(ids if ids is not None else SequenceIds())
    if hasher_factory is not None:
        manager.index.set_hasher_factory(hasher_factory)
    index = manager.index
    for seq in manager.sequences.values():
        prefix = seq.stream
        if isinstance(prefix, bytes):
            stream = index.new_stream(seq.ns.root_key)
            stream.update(prefix)
            seq.stream = stream
    # Recomputed, not trusted: a snapshot written before the running total existed lacks it.
    manager.tail = TailWaste(TailWaste.walk(manager.sequences.values(), manager.block_size))
    return manager


def _stream_prefixes(m: BlockManager) -> dict[str, bytes]:
    """Token ids of every caching sequence's committed blocks; uncaches those without."""
    chunk_bytes = m.index.chunk_bytes
    pending: dict[int, bytes] = {}
    for session in m.sessions.values():
        for _, _kind, payload in session.waiting:
            if isinstance(payload, CommitBatch):
                for b, chunk in zip(payload.blocks, payload.chunks, strict=True):
                    pending[b] = chunk
    out: dict[str, bytes] = {}
    for seq in list(m.sequences.values()):
        if seq.stream is None:
            continue
        prefix = _prefix_of(m, seq, pending)
        if prefix is None:
            _uncache(seq)
            m.counters.uncacheable_after_snapshot += 1
            continue
        if len(prefix) != seq.num_committed * chunk_bytes:
            raise Internal(f"sequence {seq.id}: committed token ids do not match its blocks")
        out[seq.id] = prefix
    return out


def _prefix_of(m: BlockManager, seq: Sequence, pending: dict[int, bytes]) -> bytes | None:
    index = m.index
    tokens = index.tokens
    key = index.key
    dup = m.cache.dup
    parts = []
    for b in seq.table[: seq.num_committed]:
        # The sequence references b, so b is neither evicted nor reused: whatever the index
        # or a pending commit says b holds is what this sequence computed there.
        chunk = tokens[b] if key[b] is not None else pending.get(b)
        if chunk is None and b in dup:
            twin, serial = dup[b]
            if key[twin] is not None and index.serial[twin] == serial:
                chunk = tokens[twin]
        if chunk is None:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _uncache(seq: Sequence) -> None:
    """Prefix caching off for a live sequence: its later commits are not indexed."""
    seq.cache = False
    seq.stream = None
    seq.tokens = bytearray()
    seq.keys = []
    seq.chain = []


def canonical(obj: object) -> object:
    """A plain nested structure of everything ``obj`` holds, in order (for tests).

    Two managers with equal ``canonical`` forms behave identically: it covers every
    container's order (dicts, the free stack, LRU lists), every array, and every key stream
    (by its digest). Pickle bytes cannot be compared instead: they also encode which equal
    objects happen to be shared.
    """
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, array):
        return (obj.typecode, obj.tobytes())
    if isinstance(obj, dict):
        return tuple((canonical(k), canonical(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple, deque)):
        return tuple(canonical(v) for v in obj)
    if isinstance(obj, xxhash.xxh3_128):
        return ("xxh3", obj.digest())
    if isinstance(obj, Enum):
        return repr(obj)
    if callable(obj):
        return "<callable>"
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names.extend(n for n in getattr(cls, "__slots__", ()) if n not in names)
    return (type(obj).__name__,
            tuple((n, canonical(getattr(obj, n))) for n in names if hasattr(obj, n)))
