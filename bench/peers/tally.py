"""The one counting rule every manager in bench/peers_replay.py is held to.

A block operation is a block newly allocated to a sequence (taken from the free pool or from
an eviction) or a block reference released (a sequence ending drops every block of its
table). Blocks a sequence acquires through a prefix hit are not operations: they are counted
apart (``hit_blocks``), with the hit rate over prompt tokens. The drivers count from what each
manager returns (new block lists, hit lengths) or, where a manager returns none (SGLang's
paged allocator hands back token slots), from its own page arithmetic; the released count of
a sequence is the size of its table (hits + allocations), the same identity for all three.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Tally:
    allocated: int = 0
    released: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    #: KV slots the manager gave out: prompt tokens plus one per decoded token.
    tokens: int = 0
    requests: int = 0
    stalls: int = 0

    @property
    def ops(self) -> int:
        return self.allocated + self.released

    def as_dict(self) -> dict[str, int | float]:
        d: dict[str, int | float] = asdict(self)
        d["ops"] = self.ops
        d["hit_rate_tokens"] = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return d
