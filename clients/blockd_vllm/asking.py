"""The asks: a new request's admit, from vLLM adding the request to vLLM's answer for it.

``on_new_request`` (``new_request``) queues a request's admit, and sends it at once when blockd
is owed nothing; ``get_num_new_matched_tokens`` (``num_new_matched_tokens``) answers None while
the admit is in flight (an idle engine waits ``IDLE_WAIT_S`` at most for it first), then the
hit blockd verified and pinned, or ``(n, True)`` while blockd fetches the prefix from its remote
tier; an admit refused for room is asked again for the cached prefix alone (``_hit_only``), a
"pending" one is turned into the tokens it promises (``_promise``). A mixin of
``SchedulerSide`` (``blockd_vllm.scheduler``, which documents the whole flow), whose state it
reads and changes under the side's lock; the Steps go through the side's ``_send``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from blockd_client import requests as rq
from blockd_vllm.admits import Admits, Pending
from blockd_vllm.copies import Copies
from blockd_vllm.outbox import Steps
from blockd_vllm.plan import Plan
from blockd_vllm.remote_loads import RemoteLoads
from blockd_vllm.resolution import finishing
from blockd_vllm.settings import Settings

#: The longest an idle engine's ask waits for an admit's answer before vLLM steps again.
IDLE_WAIT_S = 0.05


def hook(method: Any) -> Any:
    """A hook vLLM's scheduler thread calls: run under the side's lock, its time counted (an
    idle engine's wait for an answer apart: ``idle_wait_ns``)."""
    def run(self: Any, *args: Any) -> Any:
        t0, waited = time.perf_counter_ns(), self.counters["idle_wait_ns"]
        try:
            with self._lock:
                return method(self, *args)
        finally:
            self.counters["scheduler_ns"] += (time.perf_counter_ns() - t0
                                              - (self.counters["idle_wait_ns"] - waited))
    run.__doc__ = method.__doc__
    return run


class Asks:
    settings: Settings
    B: int
    namespace: Any
    link: Any
    plans: dict[str, Plan]
    to_release: list[str]
    dirty: set[str]
    counters: Counter[str]
    copies: Copies
    admits: Admits
    remote: RemoteLoads
    steps: Steps
    _running: set[str]

    @property
    def session(self) -> Any:
        raise NotImplementedError

    @property
    def degraded(self) -> bool:
        raise NotImplementedError

    def _idle(self) -> bool:
        raise NotImplementedError

    def _send(self, ops: list[Any], releases: list[str], grow: list[Any], rids: list[str],
              num_admits: int) -> None:
        raise NotImplementedError

    def eligible(self, request: Any) -> bool:
        """Whether a request's K/V is fully determined by its token ids (no images, no prompt
        embeddings) and it has a full block to share."""
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None or getattr(request, "prompt_embeds", None) is not None:
            return False
        if getattr(request, "mm_features", None):
            return False
        return len(tokens) > self.B

    @hook
    def num_new_matched_tokens(self, request: Any, num_computed: int
                               ) -> tuple[int | None, bool]:
        """vLLM's ``(external hit, load asynchronously)``: ``(None, False)`` while blockd has
        not answered the request's admit (vLLM skips the request this step and asks again);
        ``(n, True)`` while blockd fetches its prefix from the remote tier
        (``blockd_vllm.remote_loads``)."""
        rid = request.request_id
        again = self.remote.asked_again(rid, num_computed)
        if again is not None:
            return again, True
        plan = self.plans.get(rid)
        if plan is not None and plan.abandoned:
            # Asked again, so not scheduled since: nothing was loaded; start over.
            self.plans.pop(rid)
            if plan.epoch == self.session.epoch:
                self.to_release.append(plan.seq_id)
            plan = None
        if plan is None:
            if not self.eligible(request):
                return 0, False
            if self.degraded and rid not in self.admits.in_flight:
                self.admits.finished(rid)  # a pending answer of it is let go
                return 0, False
            idle = not self._running
            arrived = rid in self.admits.queued  # on arrival (``new_request``), not sent yet
            answer = self.admits.ask(request, None if idle else self.settings.admit_wait_s)
            if answer is None and idle and arrived:
                self._send_admits()  # with those that arrived with it, in one Step
            if answer is None and idle and rid in self.admits.in_flight:
                answer = self._await_answer(request)
            if answer is None:
                pending = self.admits.pending(rid)
                if pending is not None:
                    n = self.remote.promise(request, pending, num_computed)
                    if n is not None:
                        return n, True
                    self.admits.again(request, wait=False)  # nothing to wait for
                return None, False
            if not isinstance(answer, Plan):
                return answer, False  # compute everything
            plan = self.plans[rid] = answer
        plan.local_tokens = num_computed
        return max(0, plan.hit_tokens - num_computed), False

    @hook
    def new_request(self, request: Any) -> None:
        """vLLM added ``request`` (``on_new_request``: before a ``schedule()`` asks about it).
        When nothing else is owed to blockd (no Step in flight, no commit or release waiting,
        every copy reported), its admit leaves at once: on an idle engine the first request's
        answer is back about when ``schedule()`` asks for it, instead of an empty step later.
        Otherwise it only queues, and goes with the Step of the next ``schedule()``, behind
        what an idle engine's finished requests still owe (their commits: the next turn of a
        conversation must hit the previous one). Requests arriving together at an idle engine:
        the first leaves at once, the others queue behind it; ``schedule()``'s first ask of
        one of them sends them all in one Step and waits for it, so they all run in the
        engine's first step rather than a step after the first request."""
        rid = request.request_id
        if (not self.eligible(request) or self.degraded or rid in self.plans
                or rid in self.admits.in_flight):
            return
        self.admits.queue(request)
        self._send_admits()

    def _send_admits(self) -> None:
        """Send the queued admits in one Step now, when nothing else is owed to blockd."""
        if (self.admits.queued and not self.steps.outbox.busy and not self.dirty
                and not self.to_release and self._idle() and not finishing(self.plans)):
            rids, admits = self.admits.take()
            self._send(admits, [], [], rids, len(admits))

    def _await_answer(self, request: Any) -> Plan | int | None:
        """An idle engine waits for the answer of a new request's admit in flight
        (``_idle_wait``), so the request can run in this very step."""
        rid = request.request_id
        self._idle_wait(lambda: rid not in self.admits.in_flight)
        return self.admits.ask(request)

    def _idle_wait(self, done: Any) -> None:
        """Wait (``IDLE_WAIT_S`` at most) until ``done()`` or blockd stops answering. Only when
        the engine has nothing to run: vLLM would otherwise step again at once, through the
        engine core and every worker, as fast as they go (an empty step still runs the
        connector's hooks), taking the CPU the daemon needs to answer what the engine waits
        for."""
        self.counters["idle_wait_ns"] += self.steps.outbox.wait_applied(
            lambda: done() or self.degraded, IDLE_WAIT_S)

    def _adopt(self, rid: str, plan: Plan) -> None:
        """The answer of an admit its request stopped waiting for (``admit_wait_s``): vLLM
        computes the whole prompt, so the plan loads nothing (its hit is computed too) and
        saves the rest, from vLLM's blocks, from the next step that runs the request."""
        plan.hit_tokens = 0
        self.plans[rid] = plan
        self.counters["late_plans"] += 1

    def _release_unused(self, plan: Plan) -> None:
        """An admitted plan no request took (it ended first, or blockd went away)."""
        if plan.epoch == self.session.epoch:
            self.to_release.append(plan.seq_id)

    def _hit_only(self, request: Any) -> None:
        """No room for the whole prompt: pin just the cached prefix (loads, no saves)."""
        tokens = list(request.prompt_token_ids)
        ns = self.namespace.for_request(request)
        rid = request.request_id

        def call() -> Any:
            hit = self.link.call(self.session.lookup, ns, tokens)
            return self.steps.call([rq.admit(tokens[:hit + 1], ns, rid)]) if hit else None

        def then(res: Any) -> None:
            outcome = self.steps.applied(res)[0] if res is not None else None
            result = outcome.results[0] if outcome is not None else None
            self.admits.settle(rid, self.admits.hit_only(request, result, self.session))

        self.steps.outbox.put(call, then)

    def _promise(self, request: Any, blocks: int) -> None:
        """blockd fetches ``blocks`` blocks after its local hit: the tokens it expects to hold
        (asked off the scheduler thread: a Lookup of the local hit)."""
        tokens = list(request.prompt_token_ids)
        ns = self.namespace.for_request(request)
        full = (len(tokens) - 1) // self.B * self.B

        def then(hit: Any) -> None:
            promised = min(full, int(hit or 0) + blocks * self.B)
            self.admits.settle(request.request_id, Pending(promised))

        self.steps.outbox.put(lambda: self.link.call(self.session.lookup, ns, tokens), then)
