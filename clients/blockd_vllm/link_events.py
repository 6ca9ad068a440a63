"""What the link tells the scheduler side: blockd stopped answering, a Step that went unanswered
was answered late, the pool's epoch changed. Called on the outbox's or the heartbeat thread (the
link's lock held), each under the side's lock; a mixin of ``SchedulerSide``, whose state it
changes (``blockd_vllm.scheduler`` documents it)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from blockd_client import EpochChanged
from blockd_vllm.admits import Admits
from blockd_vllm.copies import Copies
from blockd_vllm.outbox import Steps
from blockd_vllm.plan import Plan

log = logging.getLogger("blockd_vllm")


def under_lock(method: Any) -> Any:
    """Run ``method`` under the side's lock (from the link's or the outbox's thread)."""
    def run(self: Any, *args: Any) -> Any:
        with self._lock:
            return method(self, *args)
    run.__doc__ = method.__doc__
    return run


class LinkEvents:
    _lock: threading.RLock
    plans: dict[str, Plan]
    dirty: set[str]
    to_release: list[str]
    counters: Any
    admits: Admits
    steps: Steps
    copies: Copies
    _told: int

    @property
    def session(self) -> Any:
        raise NotImplementedError

    @under_lock
    def lost(self) -> None:
        """blockd stopped answering. A plan may still owe vLLM its loads (the tokens were
        promised in this very schedule): it is kept, so they run from the worker's mapping
        (which holds the bytes); it saves and commits nothing more, and is released once
        blockd answers (same epoch) or dropped (new epoch)."""
        for rid, plan in self.plans.items():
            plan.abandoned = True
            self.dirty.add(rid)
        self.admits.drop_plans(release=True)

    @under_lock
    def late_answer(self, outcome: Any) -> None:
        """The answer of the Step that went unanswered when blockd stopped answering, got once
        it answers again (``Session.settle``): blockd applied it (then, or now). Its requests
        were computed without the cache, so the sequences its admits created are released
        (nothing else names them: left, they would hold their blocks until the session
        ends); its commits and releases took effect with its fence, announced here."""
        for res in outcome.results:
            if not res.status.code and res.WhichOneof("result") == "admit":
                self.to_release.append(res.admit.sequence_id)
                self.counters["late_admits_released"] += 1
        self.steps.announced = max(self.steps.announced, outcome.fence)

    @under_lock
    def epoch_changed(self, err: EpochChanged) -> None:
        log.warning("blockd_vllm: blockd's pool epoch changed (%d -> %d): %d plans abandoned, "
                    "their requests compute what they did not load yet", err.old, err.new,
                    len(self.plans))
        for rid, plan in self.plans.items():  # loads still run from the old mapping
            plan.abandoned = True
            self.dirty.add(rid)
        self.admits.drop_plans(release=False)
        self.to_release.clear()  # sequences of the old epoch no longer exist
        # The new session's fences start again; copies in flight concern the old pool only.
        self.steps.announced = 0
        self._told = 0
        self.copies.worker_step = self.copies.step_no
