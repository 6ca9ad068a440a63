"""Deliberately weak key hashes for the core tests: they collide on purpose, so that only the
manager's verification (stored tokens, parent and its serial, namespace) keeps K/V apart.
Each mimics the interface the BlockManager's ``hasher_factory`` expects: ``f(seed)`` returning an
object with ``update``, ``digest`` (16 bytes) and ``copy``.
"""

from __future__ import annotations

import xxhash


class LenHasher:
    """Colliding key hash: the digest is the number of bytes fed, nothing about their values.

    Every namespace root is 16 bytes, so block ``i`` of *every* prompt in *every* namespace gets
    the same key.
    """

    def __init__(self, seed: int, n: int = 0) -> None:
        self.n = n

    def update(self, data: bytes | memoryview) -> None:
        self.n += memoryview(data).nbytes

    def digest(self) -> bytes:
        return self.n.to_bytes(16, "little")

    def copy(self) -> LenHasher:
        return LenHasher(0, self.n)


class ConstHasher:
    """The worst hash: every key is the same 16 bytes."""

    def __init__(self, seed: int) -> None:
        pass

    def update(self, data: bytes | memoryview) -> None:
        pass

    def digest(self) -> bytes:
        return b"\x42" * 16

    def copy(self) -> ConstHasher:
        return self


class TailHasher:
    """A colliding key hash that ignores everything before the last block: the key of block
    ``i`` depends only on ``i`` and block ``i``'s own tokens, not on the earlier blocks or the
    namespace. Two prompts that end a block alike but differ before collide, which is exactly
    what parent verification must catch."""

    chunk = 4

    def __init__(self, seed: int, buf: bytes = b"") -> None:
        self.buf = buf

    def update(self, data: bytes | memoryview) -> None:
        self.buf += bytes(data)

    def digest(self) -> bytes:
        return len(self.buf).to_bytes(8, "little") + xxhash.xxh3_64_digest(self.buf[-self.chunk:])

    def copy(self) -> TailHasher:
        return type(self)(0, self.buf)
