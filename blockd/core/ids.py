"""Typed ids and the one sequence-id minter.

Sequence ids are 128 random bits (the API promises they are unguessable). A daemon that journals
its Steps must record the ids it minted, and a journal replay must hand out exactly those ids
again: :class:`SequenceIds` has the three modes (normal, recording, replaying) in one object,
injected into the ``BlockManager`` by whoever composes it, instead of flags flipped on the
manager from outside.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NewType

from blockd.core.errors import Internal

#: A physical block id: an index into the pool, 0..num_blocks-1.
BlockId = NewType("BlockId", int)
#: A sequence id as minted by :class:`SequenceIds`.
SequenceId = NewType("SequenceId", str)
#: A session id (minted by ``BlockManager.open_session``).
SessionId = NewType("SessionId", str)


def opaque_id(nbytes: int) -> str:
    """A random URL-safe id of ``nbytes`` bytes that never begins with "-": ids are typed on
    command lines (``blockctl inspect SEQ``), where a leading "-" reads as an option."""
    while True:
        out = secrets.token_urlsafe(nbytes)
        if out[0] != "-":
            return out


class SequenceIds:
    """Mints sequence ids; optionally records them (journal) or replays recorded ones."""

    __slots__ = ("_minted", "_replay")

    def __init__(self) -> None:
        #: Ids minted since the last ``take_minted``, while recording; None when not recording.
        self._minted: list[str] | None = None
        #: Ids to hand out instead of new ones, during a replay.
        self._replay: deque[str] | None = None

    def new(self) -> str:
        """The next sequence id."""
        if self._replay is not None:
            if not self._replay:
                raise Internal("a replayed Step mints more sequence ids than it did originally")
            return self._replay.popleft()
        seq_id = opaque_id(16)  # 128 random bits (less 1/64 of one), as the API promises
        if self._minted is not None:
            self._minted.append(seq_id)
        return seq_id

    def record(self) -> None:
        """From now on, remember every id minted until it is taken (a journalling daemon)."""
        if self._minted is None:
            self._minted = []

    def take_minted(self) -> list[str]:
        """The ids minted since the last call (empty when not recording)."""
        out = self._minted
        if not out:
            return []
        self._minted = []
        return out

    @contextmanager
    def replaying(self, ids: Iterable[str]) -> Iterator[None]:
        """Hand out exactly ``ids``, in order, instead of new ones (a journal replay)."""
        self._replay = deque(ids)
        try:
            yield
        finally:
            self._replay = None
