"""blockd's core as bench/peers_replay.py drives it: one session, the Step operations in process.

Two decode paths: ``append`` once per sequence per step (the per-token path) and one
``append_batch`` per step (what blockd workers send). Prompt K/V is committed under the step's
fence; the previous step's fence completes when the next step begins (the GPU finished it).
"""

from __future__ import annotations

from array import array

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy

from .tally import Tally

SCOPE = PrefixScope("llama-3-8b", model_revision="main", tokenizer_digest=b"tok-v1")


class BlockdDriver:
    def __init__(self, trace: list, block_size: int, num_blocks: int, batch: bool) -> None:
        self.name = "blockd append_batch" if batch else "blockd append"
        self.batch = batch
        self.B = block_size
        self.m = BlockManager(PoolSpec(block_size=block_size, num_blocks=num_blocks),
                              [TenantPolicy("bench", quota_blocks=num_blocks)], seed=7)
        self.s = self.m.open_session("bench")
        # Inputs as the server receives them (packed uint32), built before the clock starts.
        self.prompts = [array("I", r.prompt).tobytes() for r in trace]
        self.outputs = [[array("I", [t]).tobytes() for t in r.output] for r in trace]
        self.plen = [len(r.prompt) for r in trace]
        self.seq: dict[int, str] = {}
        self.held: dict[int, int] = {}
        self.fence = 0
        self.t = Tally()

    def begin_step(self, step: int) -> None:
        if self.fence:
            self.m.complete_fence(self.s, self.fence, clamp_to_issued=True)
        self.fence = step

    def admit(self, i: int) -> bool:
        res = self.m.admit(self.s, SCOPE, self.prompts[i])
        if not hasattr(res, "block_table"):
            return False
        t = self.t
        hits = res.num_cached_tokens // self.B
        n = len(res.block_table)
        t.hit_blocks += hits
        t.allocated += n - hits
        t.hit_tokens += res.num_cached_tokens
        t.queried_tokens += self.plen[i]
        t.tokens += self.plen[i]
        t.requests += 1
        self.held[i] = n
        self.seq[i] = res.seq_id
        self.m.commit(self.s, res.seq_id, self.fence)
        return True

    def prefill(self, admitted: list[int]) -> None:
        pass  # admit already allocated and committed the prompt

    def decode(self, running: list[int], k: list[int]) -> list[bool]:
        """Append output token ``k[j]`` to ``running[j]``; returns which appends applied."""
        m, s, f, B, t = self.m, self.s, self.fence, self.B, self.t
        seq, outputs, plen, held = self.seq, self.outputs, self.plen, self.held
        ok = [True] * len(running)
        if self.batch:
            ids = [seq[i] for i in running]
            out = m.append_batch(s, ids, b"".join([outputs[i][k[j]]
                                                   for j, i in enumerate(running)]), fence=f)
            for j, _err in out.errors:
                ok[j] = False
                t.stalls += 1
            for j, res in out.deltas:
                n = len(res.block_ids)
                t.allocated += n
                held[running[j]] += n
            for j, i in enumerate(running):
                if ok[j] and (plen[i] + k[j] + 1) % B == 0:
                    m.commit(s, ids[j], f)
        else:
            for j, i in enumerate(running):
                res = m.append(s, seq[i], outputs[i][k[j]], f)
                if not hasattr(res, "block_ids"):
                    ok[j] = False
                    t.stalls += 1
                    continue
                n = len(res.block_ids)
                t.allocated += n
                held[i] += n
                if (plen[i] + k[j] + 1) % B == 0:
                    m.commit(s, seq[i], f)
        t.tokens += sum(ok)
        return ok

    def release(self, i: int) -> None:
        n = self.m.release(self.s, self.seq.pop(i), self.fence)
        held = self.held.pop(i)
        if n != held:  # the counting identity: a release drops exactly the table
            raise AssertionError(f"blockd released {n} references, its table had {held}")
        self.t.released += n

    def num_free(self) -> int:
        return self.m.state_counts().get("free", 0)
