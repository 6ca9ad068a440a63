"""Loads from blockd's remote tier through vLLM's async-load path (``(n, True)``).

An admit sent with ``wait_for_remote`` is answered "pending" while blockd fetches the prompt's
prefix from the cluster (``blockd.runtime.remote``). The connector then promises vLLM the tokens
blockd expects to hold once the fetch lands (its local hit plus the blocks being fetched,
``Pending.promised``) and answers ``(promised - vLLM's local hit, True)``: vLLM allocates blocks
for them and parks the request in ``WAITING_FOR_REMOTE_KVS`` (it schedules nothing of it and
never asks again), and every ``schedule()`` after that asks blockd again, off the scheduler
thread, until the admit is no longer pending (the fetch landed, missed or failed) or
``remote_wait_s`` passed (then it admits what arrived). The step after that answer loads what
blockd holds into the blocks vLLM allocated and reports the request in ``finished_recving``;
every promised block blockd does not hold (a miss, a corrupt value, a killed master, a
``FLUSHALL``, a deadline, blockd unreachable) is reported in ``get_block_ids_with_load_errors``
in that same step: vLLM (``kv_load_failure_policy`` 'recompute', which the connector sets)
truncates the request's computed tokens at the first of them and computes the rest. A fetch
never fails a request nor changes a token. A request aborted while it waits keeps its blocks in
vLLM until its ``finished_recving`` (vLLM's rule), which the next step reports.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from blockd_vllm.admits import Admits, Pending
from blockd_vllm.metadata import BlockdMetadata
from blockd_vllm.plan import Plan


@dataclass
class RemoteLoad:
    """A request answered ``(n, True)``."""

    request: Any
    #: vLLM's block-aligned local hit, and the tokens promised (local hit + n).
    local: int
    promised: int
    #: The request's vLLM blocks (``update_state_after_alloc``); empty: not allocated yet.
    vblocks: list[int] = field(default_factory=list)
    cancelled: bool = False


class RemoteLoads:
    def __init__(self, B: int, counters: Counter[str]) -> None:
        self.B = B
        self.counters = counters
        self.loads: dict[str, RemoteLoad] = {}

    def promise(self, request: Any, pending: Pending, local: int) -> int | None:
        """The tokens to answer vLLM ``(n, True)`` for, or None: blockd's promise adds
        nothing to vLLM's local hit (the caller admits at once)."""
        n = pending.promised // self.B * self.B - local
        if n <= 0:
            return None
        self.loads[request.request_id] = RemoteLoad(request, local, local + n)
        self.counters["async_loads"] += 1
        return n

    def asked_again(self, rid: str, local: int) -> int | None:
        """vLLM asks again for a request it was promised ``(n, True)`` for: it could not
        allocate its blocks then (``update_state_after_alloc`` did not come). The same promise,
        from its local hit now, or None (not one of them)."""
        load = self.loads.get(rid)
        if load is None or load.vblocks:
            return None
        load.local = local
        return max(0, load.promised - local) or None

    def allocated(self, rid: str, vblocks: list[int]) -> bool:
        load = self.loads.get(rid)
        if load is None:
            return False
        load.vblocks = list(vblocks)
        return True

    def finished(self, rid: str) -> bool:
        """The request ended while it waited; True when it was one of them."""
        load = self.loads.get(rid)
        if load is None:
            return False
        if load.vblocks:
            load.cancelled = True  # vLLM frees its blocks at its finished_recving
        else:
            del self.loads[rid]
        return True

    def poll(self, meta: BlockdMetadata, admits: Admits, plans: dict[str, Plan],
             degraded: bool) -> None:
        """Every step: ask blockd again for the requests that wait, and finish those answered
        (their loads and load errors in ``meta``, ``meta.recv``)."""
        for rid, load in list(self.loads.items()):
            if not load.vblocks:
                continue
            if load.cancelled:
                meta.recv.append(rid)
                del self.loads[rid]
                continue
            answer: Plan | int | None = 0 if degraded and rid not in admits.in_flight else \
                admits.ask(load.request)
            if answer is None:
                if admits.pending(rid) is not None:
                    admits.again(load.request)  # still fetching: ask again next Step
                continue
            self._land(meta, rid, load, answer if isinstance(answer, Plan) else None, plans)

    def _land(self, meta: BlockdMetadata, rid: str, load: RemoteLoad, plan: Plan | None,
              plans: dict[str, Plan]) -> None:
        B = self.B
        held = load.local
        if plan is not None:
            held = max(held, min(plan.hit_tokens, load.promised) // B * B)
            plan.local_tokens = load.local
            plan.scheduled = True  # its loads go in this step
            plans[rid] = plan
            for j in range(load.local // B, held // B):
                meta.load_vllm.append(load.vblocks[j])
                meta.load_blockd.append(plan.table[j])
                meta.load_session.append(plan.session_id)
        missed = [load.vblocks[j] for j in range(held // B, load.promised // B)]
        meta.load_failed.extend(missed)
        meta.recv.append(rid)
        self.counters["async_load_blocks"] += (held - load.local) // B
        self.counters["async_load_missed_blocks"] += len(missed)
        del self.loads[rid]
