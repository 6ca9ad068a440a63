"""The daemon's read-only calls: Lookup, GetBlockTable, Inspect, ListSequences and Stats.
Each checks who may ask (``Sessions``), charges what reading costs and answers from the core;
none changes a block, a sequence or a session. A mixin of ``runtime.daemon.Daemon``, whose
state it reads."""

from __future__ import annotations

from typing import Any

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.contract import KVManager
from blockd.core.coordinator import PartitionCoordinator
from blockd.core.errors import InvalidArgument
from blockd.core.spec import PoolSpec
from blockd.runtime import convert, stats, step
from blockd.runtime.budgets import WorkBudgets
from blockd.runtime.listing import SequenceIndex
from blockd.runtime.packed import PackedIds
from blockd.runtime.sessions import Sessions
from blockd.runtime.step import StepLimits
from blockd.runtime.tenants_file import Principal

#: The token ids of a Lookup read from its bytes that are decoded first (``Daemon.lookup``).
LOOKUP_FIRST_IDS = 4096


class Reads:
    spec: PoolSpec
    limits: StepLimits
    budgets: WorkBudgets
    sessions: Sessions
    manager: KVManager
    partitions: PartitionCoordinator
    index: SequenceIndex
    epoch: int

    @property
    def lookup_reach(self) -> int:
        """The most tokens of a prompt a Lookup reads: no hit is longer than the pool (nor
        than the prompt less its last token), so the tokens beyond cannot change the answer
        and are never hashed (nor, from a request's bytes, decoded: ``runtime.packed``)."""
        return self.spec.num_blocks * self.spec.block_size + 1

    def lookup(self, principal: Principal, req: pb.LookupRequest,
               packed: PackedIds | None = None) -> pb.LookupResponse:
        """``packed``: the request's token ids read from its bytes, in place of
        ``req.token_ids``. Their work is charged before any is decoded, and they are decoded
        only as far as the match goes: the first ``LOOKUP_FIRST_IDS``, four
        times more while the hit covers all of them (a prefix's hit is the prompt's hit
        wherever it ends short of the prefix), so a miss decodes a few thousand ids of a
        256k-token prompt and a full hit at most ~1.3x its ids."""
        info = self.sessions.get(principal, req.session_id, req.epoch)
        tokens: Any = req.token_ids
        count = len(tokens) if packed is None else packed.count
        step.check_token_count(self.limits, count, "token_ids")
        # Priced and charged before the cut: copying out the kept tokens is work too.
        n = min(count, self.lookup_reach)
        step.check_work(self.limits, n, "Lookup", "token_ids")
        scope = convert.scope(req.namespace)
        self.budgets.charge(info.tenant_id, n)
        if packed is None:
            hit = self.manager.lookup(info.id, scope, tokens[:n] if len(tokens) > n else tokens)
        else:
            B, size = self.spec.block_size, min(n, LOOKUP_FIRST_IDS)
            while True:
                hit = self.manager.lookup(info.id, scope, packed.first(size))
                if size >= n or hit < (size - 1) // B * B:
                    break
                size = min(n, size * 4)
        return pb.LookupResponse(num_cached_tokens=hit,
                                 num_cached_blocks=hit // self.spec.block_size)

    def block_table(self, principal: Principal, req: pb.GetBlockTableRequest
                    ) -> pb.GetBlockTableResponse:
        info = self.sessions.owning(principal, req.session_id, req.sequence_id)
        table, n = self.manager.block_table(info.id, req.sequence_id)
        return pb.GetBlockTableResponse(sequence_id=req.sequence_id, epoch=self.epoch,
                                        block_ids=table, num_tokens=n,
                                        block_size=self.spec.block_size)

    def inspect(self, principal: Principal, req: pb.InspectRequest) -> pb.InspectResponse:
        info = self.sessions.owning(principal, req.session_id, req.sequence_id)
        if req.max_positions > 65536:
            raise InvalidArgument("max_positions is at most 65536", field="max_positions")
        m = self.manager
        positions = m.inspect(info.id, req.sequence_id, req.start_position,
                              req.max_positions or 65536)
        table, n = m.block_table(info.id, req.sequence_id)
        resp = pb.InspectResponse(sequence_id=req.sequence_id, epoch=self.epoch,
                                  block_size=self.spec.block_size, num_tokens=n)
        return convert.inspect_response(
            resp, positions, m.sequence_blocks(info.id, req.sequence_id))

    def list_sequences(self, principal: Principal, req: pb.ListSequencesRequest
                       ) -> pb.ListSequencesResponse:
        return self.index.answer(principal, req, epoch=self.epoch)

    def stats(self, principal: Principal) -> pb.StatsResponse:
        """The pool and the caller's own figures (``blockd.runtime.stats``: who sees what)."""
        return stats.answer(principal, self.partitions, self.sessions, epoch=self.epoch,
                            block_size=self.spec.block_size)
