"""The lower tiers' index: prefixes whose bytes sit in a host-memory or a disk slot.

A prefix is an *entry*: its key, its token ids, its namespace, its serial and its parent's serial
(``blockd.core.prefix_index``, "Verification"). Where its bytes are is its *location*: a pool
block (the pool's ``PrefixIndex``), a slot of a lower tier (this index), or both (a prefix loaded
back into the pool keeps its lower copy, so evicting it again copies nothing). This room holds
the lower locations: fixed-size slots, one block's bytes each, numbered in one id space across
the tiers (tier ``t``'s slots are ``base[t] .. base[t] + num_slots[t] - 1``); which bytes are in a
slot is the runtime's (``blockd.core.tier_io``); which entry to spill, demote or drop is
``blockd.core.tiering``'s.

Per slot, flat arrays (no Python object per slot): key (the ``KeyTable``), token ids and the
parent's key (arenas), namespace id (0: free), serial, parent serial, owner tenant slot, LRU
links, a stamp and a pin byte. Each tier has a free stack and per-tenant LRU lists (least
recently used first), threaded through ``prev``/``next`` like the pool's (``blockd.core.blocks``).

Invariants (``check``): every slot is free (on its tier's free stack, ns 0) or occupied (on
exactly one LRU list of its tier and owner, its key mapping to it); usage per (tier, tenant)
counts the occupied slots; no slot is pinned between calls.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from blockd.core.errors import Internal
from blockd.core.key_table import KEY_BYTES, KeyTable

#: Tier names, top to bottom below the pool (what events and metrics call them).
HOST = "host"
DISK = "disk"
TIER_ORDER = (HOST, DISK)
_NIL = -1
_STAMP_MASK = 0xFFFFFFFF


def bytes_per_slot(block_size: int) -> int:
    """Memory the index takes per lower slot, whether used or not: key (16) and parent key (16),
    token ids (4 per token), namespace, serial, parent serial, LRU links and stamp (4 each),
    owner (2), pin (1), and the key table's 2 to 4 slots of 4 bytes."""
    return 16 + 16 + 4 * block_size + 6 * 4 + 2 + 1 + 16


@dataclass(frozen=True, slots=True)
class TierShape:
    """One lower tier: its name (``HOST`` or ``DISK``) and how many block slots it has."""

    name: str
    num_slots: int


class LowerTiers:
    """Slots of every lower tier and the entries they hold. Owned by ``Tiering``."""

    def __init__(self, shapes: Sequence[TierShape], block_size: int,
                 num_tenants: int = 1) -> None:
        shapes = [s for s in shapes if s.num_slots > 0]
        names = [s.name for s in shapes]
        if names != [n for n in TIER_ORDER if n in names]:
            raise Internal(f"lower tiers {names} are not in the order {TIER_ORDER}")
        self.names = names
        self.num_slots = [s.num_slots for s in shapes]
        self.base = [sum(self.num_slots[:t]) for t in range(len(shapes))]
        n = sum(self.num_slots)
        self.capacity = n
        self.chunk_bytes = 4 * block_size
        self.keys = KeyTable(n)
        #: Token ids and parent key by slot; valid while occupied (``ns[s] != 0``).
        self._tokens = bytearray()
        self._parent_keys = bytearray()
        self.ns = array("I", bytes(4 * n))
        self.serial = array("I", bytes(4 * n))
        self.parent_serial = array("I", bytes(4 * n))
        self.owner = array("H", bytes(2 * n))
        self.prev = array("i", [_NIL]) * n
        #: LRU successor of an occupied slot, or the next slot down its tier's free stack.
        self.next = array("i", [_NIL]) * n
        self.stamp = array("I", bytes(4 * n))
        #: Set while an admit loads from the slot: never evicted then (reset before it ends).
        self.pinned = bytearray(n)
        self.free_head = [_NIL] * len(shapes)
        self.num_free = list(self.num_slots)
        for t in range(len(shapes)):
            lo, hi = self.base[t], self.base[t] + self.num_slots[t]
            for s in range(lo, hi - 1):
                self.next[s] = s + 1
            self.free_head[t] = lo if hi > lo else _NIL
        self.head: list[list[int]] = [[] for _ in shapes]
        self.tail: list[list[int]] = [[] for _ in shapes]
        self.used: list[list[int]] = [[] for _ in shapes]
        self._clock = [0] * len(shapes)
        self.ensure_tenants(num_tenants)

    def ensure_tenants(self, num_tenants: int) -> None:
        for t in range(len(self.names)):
            grow = num_tenants - len(self.used[t])
            if grow > 0:
                self.head[t] += [_NIL] * grow
                self.tail[t] += [_NIL] * grow
                self.used[t] += [0] * grow

    # -- addressing ---------------------------------------------------------------------------

    def tier(self, name: str) -> int | None:
        """The index of tier ``name``, None when it has no slots."""
        return self.names.index(name) if name in self.names else None

    def tier_of(self, slot: int) -> int:
        t = len(self.base) - 1
        while self.base[t] > slot:
            t -= 1
        return t

    def local(self, slot: int) -> int:
        """The slot's number inside its tier (what the tier's store addresses)."""
        return slot - self.base[self.tier_of(slot)]

    def __len__(self) -> int:
        return len(self.keys)

    # -- entries ------------------------------------------------------------------------------

    def find(self, key: bytes) -> int | None:
        return self.keys.find(key)

    def tokens_of(self, slot: int) -> bytes:
        step = self.chunk_bytes
        return bytes(self._tokens[slot * step:(slot + 1) * step])

    def parent_key_of(self, slot: int) -> bytes:
        return bytes(self._parent_keys[slot * KEY_BYTES:(slot + 1) * KEY_BYTES])

    def key_of(self, slot: int) -> bytes:
        return self.keys.key_of(slot)

    def occupied(self) -> Iterator[int]:
        """Every occupied slot, in slot order."""
        ns = self.ns
        return (s for s in range(self.capacity) if ns[s])

    def take(self, t: int, tenant: int) -> int:
        """Pop a free slot of tier ``t`` (the caller checked ``num_free[t]``), not yet in the
        index: ``insert`` fills it, ``give_back`` returns it."""
        s = self.free_head[t]
        if s == _NIL:
            raise Internal(f"tier {self.names[t]} has no free slot")
        self.free_head[t] = self.next[s]
        self.next[s] = _NIL
        self.num_free[t] -= 1
        self.owner[s] = tenant
        return s

    def give_back(self, slot: int) -> None:
        """Return a taken slot that was never filled (its copy failed) to its free stack."""
        t = self.tier_of(slot)
        self.next[slot] = self.free_head[t]
        self.free_head[t] = slot
        self.num_free[t] += 1

    def insert(self, slot: int, key: bytes, chunk: bytes, parent_key: bytes, ns_id: int,
               serial: int, parent_serial: int) -> bool:
        """Fill a taken slot with an entry, most recently used; False (slot still taken, not
        indexed) when the key is already in a lower tier."""
        if not self.keys.insert(slot, key):
            return False
        self._reserve(slot)
        step = self.chunk_bytes
        self._tokens[slot * step:(slot + 1) * step] = chunk
        self._parent_keys[slot * KEY_BYTES:(slot + 1) * KEY_BYTES] = parent_key or bytes(16)
        self.ns[slot] = ns_id
        self.serial[slot] = serial
        self.parent_serial[slot] = parent_serial
        t = self.tier_of(slot)
        self.used[t][self.owner[slot]] += 1
        self._link(t, slot)
        return True

    def remove(self, slot: int) -> int:
        """Drop an occupied slot's entry and free the slot; returns its namespace id."""
        ns_id = self.ns[slot]
        if not ns_id:
            raise Internal(f"lower slot {slot} is not occupied")
        if not self.keys.remove(slot):
            raise Internal(f"lower slot {slot} is missing from the key table")
        t = self.tier_of(slot)
        self._unlink(t, slot)
        self.used[t][self.owner[slot]] -= 1
        self.ns[slot] = 0
        self.serial[slot] = 0
        self.parent_serial[slot] = 0
        self.give_back(slot)
        return ns_id

    def touch(self, slot: int) -> None:
        """A hit: the slot becomes its tier's most recently used."""
        t = self.tier_of(slot)
        self._unlink(t, slot)
        self._link(t, slot)

    def oldest(self, t: int, allowed: Sequence[bool]) -> int | None:
        """The least recently used unpinned slot of tier ``t`` among the owners ``allowed``
        (by tenant slot), or None."""
        best = None
        best_age = -1
        clock = self._clock[t]
        for owner, head in enumerate(self.head[t]):
            if owner >= len(allowed) or not allowed[owner]:
                continue
            s = head
            while s != _NIL and self.pinned[s]:
                s = self.next[s]
            if s != _NIL:
                age = (clock - self.stamp[s]) & _STAMP_MASK
                if age > best_age:
                    best, best_age = s, age
        return best

    def lru_order(self, t: int, tenant: int) -> list[int]:
        out = []
        s = self.head[t][tenant]
        while s != _NIL:
            out.append(s)
            s = self.next[s]
        return out

    # -- internals ----------------------------------------------------------------------------

    def _link(self, t: int, slot: int) -> None:
        owner = self.owner[slot]
        clock = (self._clock[t] + 1) & _STAMP_MASK
        self._clock[t] = clock
        self.stamp[slot] = clock
        tail = self.tail[t][owner]
        self.prev[slot] = tail
        self.next[slot] = _NIL
        if tail == _NIL:
            self.head[t][owner] = slot
        else:
            self.next[tail] = slot
        self.tail[t][owner] = slot

    def _unlink(self, t: int, slot: int) -> None:
        owner = self.owner[slot]
        p, nx = self.prev[slot], self.next[slot]
        if p == _NIL:
            self.head[t][owner] = nx
        else:
            self.next[p] = nx
        if nx == _NIL:
            self.tail[t][owner] = p
        else:
            self.prev[nx] = p
        self.prev[slot] = self.next[slot] = _NIL

    def _reserve(self, slot: int) -> None:
        have = len(self._tokens) // self.chunk_bytes
        if slot < have:
            return
        grow = min(self.capacity, max(slot + 1, 2 * have, 1024)) - have
        self._tokens.extend(bytes(grow * self.chunk_bytes))
        self._parent_keys.extend(bytes(grow * KEY_BYTES))

    # -- invariants ---------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``Internal`` naming the first violated invariant (module docstring)."""
        seen: set[int] = set()
        for t in range(len(self.names)):
            lo, hi = self.base[t], self.base[t] + self.num_slots[t]
            free: list[int] = []
            s = self.free_head[t]
            while s != _NIL and len(free) <= hi - lo:
                free.append(s)
                s = self.next[s]
            _require(len(free) == len(set(free)) == self.num_free[t], f"{self.names[t]} free "
                     "stack is broken")
            for s in free:
                _require(lo <= s < hi and not self.ns[s], f"free slot {s} is occupied or "
                         "outside its tier")
            seen.update(free)
            for owner in range(len(self.used[t])):
                order = self.lru_order(t, owner)
                _require(len(order) == self.used[t][owner], f"{self.names[t]} usage of "
                         f"tenant slot {owner}")
                for s in order:
                    _require(lo <= s < hi and self.ns[s] != 0 and self.owner[s] == owner,
                             f"slot {s} on the wrong LRU")
                    _require(self.keys.find(self.key_of(s)) == s, f"slot {s}: key maps "
                             "elsewhere")
                seen.update(order)
        _require(len(seen) == self.capacity, "a lower slot is neither free nor on an LRU")
        _require(len(self.keys) == sum(sum(u) for u in self.used), "lower key table count")
        _require(not any(self.pinned), "a lower slot is pinned between calls")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise Internal(f"invariant violated: {what}")
