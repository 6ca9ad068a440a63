"""A straightforward block manager, the same-run baseline for bench/core_replay.py.

One Python object per block, a deque of free blocks that keep their hash until reused (so
freed blocks double as the prefix cache), a dict from chained hash to block id, and a list of
token ids per block for verification: the design most small engines use (nano-vllm's block
manager is this shape). Written here from that description; it exists only to be measured.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

import xxhash


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


@dataclass
class _Counters:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


@dataclass
class _Admit:
    seq_id: str
    block_table: list[int]


@dataclass
class _Append:
    block_ids: list[int]
    copy: None = None


class _NoFit:
    pass


class NaiveBlockManager:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.used: set[int] = set()
        self.hash_to_block: dict[int, int] = {}
        self.seqs: dict[str, _Seq] = {}
        self.counters = _Counters()
        self._next = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @staticmethod
    def _hash(tokens: list[int], prefix: int) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(array("I", tokens).tobytes())
        return h.intdigest()

    def _take(self) -> _Block:
        block = self.blocks[self.free.popleft()]
        if block.hash != -1:
            if self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
                self.counters.evictions += 1
            block.hash = -1
            block.token_ids = []
        block.ref_count = 1
        self.used.add(block.block_id)
        return block

    def admit(self, session: str, scope: object, prompt: bytes) -> _Admit | _NoFit:
        tokens = array("I", prompt).tolist()
        B = self.block_size
        n_blocks = -(-len(tokens) // B)
        if len(self.free) < n_blocks:  # conservative, like nano-vllm's can_allocate
            return _NoFit()
        seq = _Seq(tokens)
        h = -1
        miss = False
        for i in range(n_blocks):
            chunk = tokens[i * B:(i + 1) * B]
            full = len(chunk) == B and (i + 1) * B < len(tokens)
            h = self._hash(chunk, h) if len(chunk) == B else -1
            bid = self.hash_to_block.get(h, -1) if full and not miss else -1
            if bid == -1 or self.blocks[bid].token_ids != chunk:
                miss = True
                block = self._take()
            else:
                self.counters.hit_tokens += B
                block = self.blocks[bid]
                if bid in self.used:
                    block.ref_count += 1
                else:
                    self.free.remove(bid)  # O(n), as in the simple design
                    block.ref_count = 1
                    self.used.add(bid)
            seq.table.append(block.block_id)
            seq.hashes.append(h)
        self.counters.queried_tokens += len(tokens)
        self._next += 1
        sid = str(self._next)
        self.seqs[sid] = seq
        return _Admit(sid, seq.table.copy())

    def commit(self, session: str, seq_id: str, fence: int = 0) -> int:
        seq = self.seqs[seq_id]
        B = self.block_size
        n = 0
        for i in range(len(seq.tokens) // B):
            block = self.blocks[seq.table[i]]
            if block.hash == -1:
                prefix = seq.hashes[i - 1] if i else -1
                chunk = seq.tokens[i * B:(i + 1) * B]
                block.hash = self._hash(chunk, prefix)
                block.token_ids = chunk
                seq.hashes[i] = block.hash
                self.hash_to_block[block.hash] = block.block_id
                n += 1
        return n

    def append(self, session: str, seq_id: str, token: bytes, fence: int = 0
               ) -> _Append | _NoFit:
        seq = self.seqs[seq_id]
        seq.tokens.extend(array("I", token).tolist())
        if len(seq.tokens) > len(seq.table) * self.block_size:
            if not self.free:
                seq.tokens.pop()
                return _NoFit()
            block = self._take()
            seq.table.append(block.block_id)
            seq.hashes.append(-1)
            return _Append([block.block_id])
        return _Append([])

    def release(self, session: str, seq_id: str, fence: int = 0) -> int:
        seq = self.seqs.pop(seq_id)
        for bid in reversed(seq.table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used.discard(bid)
                self.free.append(bid)
        return len(seq.table)

    def complete_fence(self, session: str, fence: int) -> None:
        pass
