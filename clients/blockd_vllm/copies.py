"""What each step copies between blockd's pool and vLLM's blocks, and which steps' saves the
workers have reported.

A step's metadata carries loads (blockd -> vLLM, promised to vLLM at the admit's answer) and
saves (vLLM -> blockd): of the prompt blocks the step completes, of generated blocks appended
before it (``blockd_vllm.plan``: saved in the first step after the append's answer that runs
the request, when vLLM's blocks hold their K/V), and of requests that ended with such blocks
unsaved (``held``: from the vLLM blocks vLLM kept for them, then let go through ``sent``).
A step that copies (loads or saves) is numbered; the workers report numbered steps back
(``SaveReport``), and a plan commits only once none of its steps is unreported. A step that
copies nothing (most decode steps) has no number: its workers report nothing, and it never
keeps the scheduler side from counting every copy done (``idle``). The appends of generated tokens
(``Growth``) are planned here and their answers applied here (``grown``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from blockd.api.v1 import blockd_pb2 as pb
from blockd_vllm.metadata import BlockdMetadata
from blockd_vllm.plan import Plan


@dataclass
class Growth:
    """Generated tokens of one request to append in this step's Step (saved once answered)."""

    rid: str
    plan: Plan
    tokens: list[int]


class Copies:
    def __init__(self, B: int, counters: Counter[str]) -> None:
        self.B = B
        self.counters = counters
        self.step_no = 0
        #: The last numbered step the workers reported back.
        self.worker_step = 0
        #: ``step -> requests`` with saves handed out in that step and not reported yet, so
        #: a save report touches only its own plans.
        self.saving: dict[int, set[str]] = {}

    def idle(self) -> bool:
        """Every step handed to the workers has been reported back: no copy is in flight."""
        return self.worker_step >= self.step_no

    def number(self, meta: BlockdMetadata) -> int:
        if not meta.step:
            self.step_no += 1
            meta.step = self.step_no
        return meta.step

    def plan(self, meta: BlockdMetadata, rid: str, plan: Plan, computed: int, n: int,
             vblocks: Any, grow: list[Growth]) -> bool:
        """This step's loads of ``plan``, the saves of the prompt blocks it completes and of
        generated blocks appended before (``computed``: the tokens computed before this step,
        ``n`` the tokens it computes; ``vblocks()``: the request's vLLM blocks, None: no saves)
        and, in ``grow``, the generated tokens whose blocks it completes (blockd's blocks for
        them come with the answer of the Step that appends them). True when the plan changed
        (its first step, a load or a save handed out, tokens to append): only then may it be
        ready to commit or release; a decode step that does none of these leaves it as it
        was, so the scheduler side does not look at it again. The scheduler side does not even
        call it for a plan ``Plan.quiet`` says has nothing to do in this step."""
        changed = not plan.scheduled or bool(plan.loads)
        if plan.loads:
            for v, b in plan.loads:
                meta.load_vllm.append(v)
                meta.load_blockd.append(b)
                meta.load_session.append(plan.session_id)
            plan.loads = []
        plan.scheduled = True
        if vblocks is None or plan.abandoned:
            return changed
        end = computed + n
        if plan.saved < plan.num_prompt // self.B:  # else no prompt block is left to save
            blocks = plan.prompt_saves(end, self.B)
            if blocks:
                self.save(meta, rid, plan, list(blocks), vblocks())
                changed = True
        if plan.to_save and plan.savable(computed, self.B):
            self.counters["generated_blocks"] += len(plan.to_save)
            self.save(meta, rid, plan, plan.to_save, vblocks())
            plan.to_save = []
            changed = True
        tokens = plan.generated(end, self.B)
        if tokens:
            grow.append(Growth(rid, plan, tokens))
            changed = True
        return changed

    def grown(self, grow: list[Growth], result: Any) -> set[str]:
        """The answer of the Step that appended ``grow`` (``result``: its append_batch
        operation's, None when the Step did not apply): each plan grows by the blocks blockd
        gave, saved by the next step that runs the request; an append blockd refused ends that
        request's growth. The requests concerned (their plans may now resolve)."""
        ok = result is not None and not result.status.code
        res = result.append_batch if ok else pb.AppendBatchResult()
        errors = {e.index for e in res.errors}
        deltas = {d.index: d.delta for d in res.deltas}
        for i, g in enumerate(grow):
            plan = g.plan
            plan.appending = 0
            if not ok or i in errors or plan.abandoned:
                self.counters["generated_refused"] += 1
                plan.request = None  # its sequence holds what it held; nothing more grows
                continue
            d = deltas.get(i)
            plan.grew(len(g.tokens), d.start_index if d is not None else None,
                      list(d.block_ids) if d is not None else [], self.B)
            if plan.finished and not plan.held:
                plan.growth_lost = True  # vLLM freed the blocks holding their K/V
        return {g.rid for g in grow}

    def save(self, meta: BlockdMetadata, rid: str, plan: Plan, blocks: list[int],
             vblocks: list[int]) -> None:
        for j in blocks:
            meta.save_vllm.append(vblocks[j])
            meta.save_blockd.append(plan.table[j])
        self.counters["save_blocks"] += len(blocks)
        plan.saved = max(plan.saved, blocks[-1] + 1)
        plan.pending.add(self.number(meta))
        self.saving.setdefault(meta.step, set()).add(rid)

    def hold(self, plan: Plan, kv_upto: int, block_ids: list[int], gone: bool,
             in_flight: bool) -> bool:
        """Whether vLLM keeps the blocks (``block_ids``) of ``plan``'s request, which ended with
        ``kv_upto`` tokens computed: until steps appended and saved every full block of it with
        K/V (``settle_held`` lets them go), or, ``in_flight``, until a save of it handed out
        earlier is reported (a CPU worker's copy thread may still read them). ``gone``: blockd
        went away, or the plan was lost or failed: nothing more is saved."""
        unsaved = bool(plan.appending or plan.to_save)
        if gone or plan.abandoned or plan.failed:
            plan.growth_lost = unsaved
            plan.to_save = []
            if not in_flight:
                return False
        elif not (unsaved or in_flight or plan.generated(kv_upto, self.B)):
            return False
        plan.held, plan.vblocks, plan.kv_upto = True, list(block_ids), kv_upto
        self.counters["held_requests"] += 1
        return True

    def settle_held(self, meta: BlockdMetadata, plans: dict[str, Plan], degraded: bool,
                    grow: list[Growth]) -> list[str]:
        """Requests that ended with generated blocks not saved yet: once their append is
        answered, save them from the vLLM blocks vLLM kept for them; blocks whose K/V the
        request computed and that were never appended (an append was still in flight in the
        steps that completed them) are appended now (``grow``), and saved in a later step. Then
        vLLM may free the blocks (``sent``: the worker reports the request in
        ``finished_sending`` after this step's saves). Never held beyond that: in degraded mode,
        or when the K/V is gone, the blocks are let go unsaved (nothing more commits). Returns
        the requests settled."""
        settled = []
        for rid, plan in plans.items():
            if not plan.held:
                continue
            gone = degraded or plan.abandoned
            if plan.appending and not gone:
                continue  # the append's answer is still to come
            if (plan.to_save and not gone and plan.savable(plan.kv_upto, self.B)
                    and plan.to_save[-1] < len(plan.vblocks)):
                self.counters["generated_blocks"] += len(plan.to_save)
                self.save(meta, rid, plan, plan.to_save, plan.vblocks)
                plan.to_save = []
            elif plan.to_save or plan.appending:
                plan.growth_lost = True
            if not (gone or plan.growth_lost):
                tokens = plan.generated(plan.kv_upto, self.B)
                if tokens and plan.num_tokens + len(tokens) <= len(plan.vblocks) * self.B:
                    grow.append(Growth(rid, plan, tokens))
                    continue  # still held: the append's answer, then the step saving it
            plan.held, plan.vblocks, plan.to_save = False, [], []
            meta.sent.append(rid)
            settled.append(rid)
        return settled

    def reported(self, report: Any, plans: dict[str, Plan]) -> set[str]:
        """A step's save report from the workers: the plans it concerns (a failed save marks
        its plan failed)."""
        self.worker_step = max(self.worker_step, report.done)
        touched: set[str] = set()
        for step_no in report.ok | report.failed:
            for rid in self.saving.pop(step_no, ()):
                plan = plans.get(rid)
                if plan is None or step_no not in plan.pending:
                    continue  # dropped, or a later plan of the same request
                plan.pending.discard(step_no)
                if step_no in report.failed and not plan.failed:
                    plan.failed = True
                    self.counters["save_failures"] += 1
                touched.add(rid)
        return touched
