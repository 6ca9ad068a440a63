"""Where the core's tier decisions meet bytes: the ``TierIO`` collaborator the runtime injects.

The core decides which entry moves where (``blockd.core.tiering``); it never touches a byte. It
calls a ``TierIO`` synchronously at the moment a move is decided, and the call returns once the
bytes are where they must be (or says they are not): a spill has copied the pool block into the
slot before the block is handed to anyone, a load has copied and *checked* the slot's bytes into
the fresh pool block before the admit that needs them returns. A load that fails its check (a
slot header or checksum that does not match: a torn write after a crash, a corrupted disk) is a
miss: ``load`` returns False and the core drops the entry; bytes that fail their check are never
in a block a worker is told holds a prefix.

Replay. Whether a call succeeded is part of what a Step did, so it is journalled:
``RecordingIO`` numbers the calls of each Step and keeps the numbers of those that failed; a
journal replay injects ``ReplayIO`` with them, which moves no byte (the bytes moved in the run
that was journalled, and what they became since is in the files) and answers each call as it
was answered then, so the replayed core takes the same decisions.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["RecordingIO", "ReplayIO", "TierIO"]


class TierIO(Protocol):
    """Moves one block's bytes between the pool and a lower tier's slot. Slots are numbered
    inside their tier (``LowerTiers.local``); ``serial`` and ``key`` name the entry, so that a
    slot's header says which entry its bytes are (a load checks both)."""

    def spill(self, block: int, tier: str, slot: int, serial: int, key: bytes) -> bool:
        """Copy pool ``block`` into ``slot`` of ``tier``; False if it could not be written."""
        ...

    def load(self, tier: str, slot: int, block: int, serial: int, key: bytes) -> bool:
        """Check ``slot`` holds entry (``serial``, ``key``) intact, then copy it into pool
        ``block``; False (the block untouched) if the check or the read fails."""
        ...

    def move(self, src_tier: str, src_slot: int, dst_tier: str, dst_slot: int, serial: int,
             key: bytes) -> bool:
        """Copy an intact slot into a slot of a lower tier (a demotion); False if the source
        fails its check or the destination cannot be written."""
        ...

    def scrub(self, tier: str, slot: int) -> None:
        """Erase a slot whose entry was dropped (its tenant asked for scrub-on-reuse)."""
        ...

    def store(self, tier: str, slot: int, source: int, serial: int, key: bytes) -> bool:
        """Write bytes from outside the node (the remote tier's fetch) into ``slot``:
        ``source`` numbers them among what the runtime staged for this call of
        ``Tiering.adopt`` (already checked by the runtime); False if not written."""
        ...


class RecordingIO:
    """A live ``TierIO`` that numbers its calls and remembers which failed (for the journal)."""

    def __init__(self, inner: TierIO) -> None:
        self.inner = inner
        self.calls = 0
        self.failed: list[int] = []

    def take_failures(self) -> list[int]:
        """The numbers of the calls that failed since the last ``take_failures``; numbering
        starts again."""
        out = self.failed
        self.failed = []
        self.calls = 0
        return out

    def _note(self, ok: bool) -> bool:
        if not ok:
            self.failed.append(self.calls)
        self.calls += 1
        return ok

    def spill(self, block: int, tier: str, slot: int, serial: int, key: bytes) -> bool:
        return self._note(self.inner.spill(block, tier, slot, serial, key))

    def load(self, tier: str, slot: int, block: int, serial: int, key: bytes) -> bool:
        return self._note(self.inner.load(tier, slot, block, serial, key))

    def move(self, src_tier: str, src_slot: int, dst_tier: str, dst_slot: int, serial: int,
             key: bytes) -> bool:
        return self._note(self.inner.move(src_tier, src_slot, dst_tier, dst_slot, serial, key))

    def scrub(self, tier: str, slot: int) -> None:
        self.inner.scrub(tier, slot)

    def store(self, tier: str, slot: int, source: int, serial: int, key: bytes) -> bool:
        return self._note(self.inner.store(tier, slot, source, serial, key))


class ReplayIO:
    """The ``TierIO`` of a journal replay: no byte moves; call ``i`` fails iff it did."""

    def __init__(self, failed: list[int] | tuple[int, ...] = ()) -> None:
        self.failed = set(failed)
        self.calls = 0

    def _answer(self) -> bool:
        ok = self.calls not in self.failed
        self.calls += 1
        return ok

    def spill(self, block: int, tier: str, slot: int, serial: int, key: bytes) -> bool:
        return self._answer()

    def load(self, tier: str, slot: int, block: int, serial: int, key: bytes) -> bool:
        return self._answer()

    def move(self, src_tier: str, src_slot: int, dst_tier: str, dst_slot: int, serial: int,
             key: bytes) -> bool:
        return self._answer()

    def scrub(self, tier: str, slot: int) -> None:
        pass

    def store(self, tier: str, slot: int, source: int, serial: int, key: bytes) -> bool:
        return self._answer()
