"""New requests' admits: asked inside ``schedule()``, sent together, answered at the next ask.

vLLM's scheduler asks ``get_num_new_matched_tokens`` once per waiting request per
``schedule()``, and an answer of None means "cannot tell yet": the request is skipped this step
and asked again in the next one (``Scheduler.schedule``: ``skip_request``). So the first ask of a
request only queues its admit (``queue``; its arrival may have, ``on_new_request``) and answers
None; ``take`` hands every admit queued during one ``schedule()`` (or an idle engine's one
arrival) to one Step (sent off the scheduler thread, ``blockd_vllm.outbox``); ``answered`` files
blockd's answers, and the next ask returns its request's (None again while the Step is in
flight). Lifecycle of one request id: queued -> in flight -> answered -> taken by an ask (a plan
or "no hit"), or answered "pending" (blockd fetches its prefix from the remote tier: the caller
promises vLLM an async load and asks ``again`` until it is not). A request that ends before its
answer is taken never leaks its sequence: the answer, when it comes, is released.

An answer that comes late never splits vLLM's batches: once the engine runs other requests, a
request whose admit is asked again ``admit_wait_s`` after its first ask and still unanswered
gives up waiting (``ask``'s ``wait_s``): it is answered "no hit" and computed with the others,
and its admit's answer, when it comes, is *adopted* (the scheduler side saves the prompt from
vLLM's blocks: the work is the same, only a hit it may have had is computed).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import requests as rq
from blockd_vllm.namespace import EngineNamespace
from blockd_vllm.plan import Plan
from blockd_vllm.settings import Settings

log = logging.getLogger("blockd_vllm")

NO_ROOM = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@dataclass
class Pending:
    """The answer while blockd fetches the prompt's prefix from its remote tier: the tokens
    blockd expects to hold once the fetch lands (its local hit plus the blocks in flight)."""

    promised: int


#: The answer "compute everything" (not admitted, refused, blockd unreachable).
NO_HIT = 0
Answer = Plan | Pending | int


class Admits:
    def __init__(self, settings: Settings, namespace: EngineNamespace, B: int,
                 counters: Counter[str], release: Callable[[Plan], None],
                 adopt: Callable[[str, Plan], None]) -> None:
        self.settings = settings
        self.namespace = namespace
        self.B = B
        self.counters = counters
        #: Called with an admitted plan nobody will take (its request ended).
        self.release = release
        #: Called with the plan of a request that gave up waiting for it (``gave_up``).
        self.adopt = adopt
        self.queued: dict[str, Any] = {}
        self.in_flight: dict[str, Any] = {}
        self.answers: dict[str, Answer] = {}
        #: Requests that ended while their admit was in flight.
        self.cancelled: set[str] = set()
        #: Requests answered "pending" (a remote fetch), by when they first were.
        self._waiting: dict[str, float] = {}
        #: Requests whose admit was lost once to a re-attached session (``resend``).
        self._resent: set[str] = set()
        #: When each request's admit was first asked (``ask``'s ``wait_s``).
        self._asked: dict[str, float] = {}
        #: Requests computed without the cache while their admit was in flight: the answer,
        #: when it comes, is adopted (a plan) or let go.
        self.gave_up: set[str] = set()

    def ask(self, request: Any, wait_s: float | None = None) -> Plan | int | None:
        """The answer for ``request`` (a plan, or NO_HIT), or None: not answered yet.
        ``wait_s``: an admit in flight for that long since its first ask is given up (NO_HIT;
        None: wait for the answer)."""
        rid = request.request_id
        if rid in self.gave_up:
            return NO_HIT
        answer = self.answers.pop(rid, None)
        if isinstance(answer, (Plan, int)):
            return answer
        if isinstance(answer, Pending):
            self.answers[rid] = answer  # the caller decides: ``promise`` or ``again``
            return None
        if rid not in self.in_flight:
            self.queue(request)  # new: it goes with this schedule()'s Step
        elif wait_s is not None:
            now = time.monotonic()
            if now - self._asked.get(rid, now) >= wait_s:
                self.gave_up.add(rid)
                self.counters["admit_wait_expired"] += 1
                return NO_HIT
        return None

    def queue(self, request: Any) -> None:
        """Queue ``request``'s admit for the next Step (``take``); its first ask or arrival
        (``on_new_request``) starts its ``wait_s`` clock."""
        rid = request.request_id
        self.queued[rid] = request
        self._asked.setdefault(rid, time.monotonic())

    def pending(self, rid: str) -> Pending | None:
        """The "pending" answer of ``rid``, taken (the caller answers vLLM ``(n, True)``)."""
        answer = self.answers.get(rid)
        if isinstance(answer, Pending):
            del self.answers[rid]
            return answer
        return None

    def again(self, request: Any, wait: bool = True) -> None:
        """Ask blockd again for ``request`` in the next Step (a poll while its prefix is
        fetched; ``wait`` False: admit what is there now)."""
        rid = request.request_id
        if rid in self.in_flight or rid in self.queued:
            return
        if not wait:
            self._waiting[rid] = float("-inf")
        self.queued[rid] = request

    def take(self) -> tuple[list[str], list[pb.Operation]]:
        """The queued admits as operations of one Step; they are in flight from now on."""
        rids, ops = [], []
        for rid, request in self.queued.items():
            ops.append(rq.admit(list(request.prompt_token_ids),
                                self.namespace.for_request(request), rid,
                                wait_for_remote=self._may_wait(rid)))
            rids.append(rid)
            self.in_flight[rid] = request
        self.queued.clear()
        return rids, ops

    def _may_wait(self, rid: str) -> bool:
        """Whether request ``rid`` may still wait for a remote fetch (``remote_wait_s`` from
        its first "pending" answer)."""
        budget = self.settings.remote_wait_s
        first = self._waiting.setdefault(rid, time.monotonic())
        if budget <= 0 or first == float("-inf"):
            return False
        if time.monotonic() - first < budget:
            return True
        self.counters["remote_wait_expired"] += 1
        return False

    def resend(self, rids: list[str]) -> list[str]:
        """The Step carrying ``rids``' admits found the session gone (the daemon reaped it, or
        restarted) and was not applied; the link re-attached. Each admit goes again with the
        next Step, on the new session, once: a request whose admit is lost a second time is
        computed. Returns the requests that are not asked again (the caller files them)."""
        given_up = []
        for rid in rids:
            request = self.in_flight.get(rid)
            if (request is None or rid in self.cancelled or rid in self._resent
                    or rid in self.gave_up):
                given_up.append(rid)
                continue
            self._resent.add(rid)
            del self.in_flight[rid]
            self.queued[rid] = request
            self.counters["admits_resent"] += 1
        return given_up

    def answered(self, rids: list[str], results: Any, session: Any
                 ) -> tuple[list[Any], list[tuple[Any, int]]]:
        """File the admits' results (``results`` None: the Step did not apply, every one of
        them computes). Returns, still in flight, the requests refused for room (the caller
        tries them once more for the cached prefix alone, ``hit_only``) and those answered
        "pending" with the number of blocks being fetched (the caller asks blockd's local hit
        and settles them ``Pending``)."""
        no_room, pending = [], []
        for i, rid in enumerate(rids):
            request = self.in_flight[rid]
            res = results[i] if results is not None else None
            late = rid in self.gave_up  # computed already: a hit-only plan or a fetch is moot
            if res is not None and res.status.code == NO_ROOM and not late:
                self.counters["admit_no_room"] += 1
                no_room.append(request)
            elif res is not None and not res.status.code and res.admit.pending_remote_blocks:
                if late:
                    self.settle(rid, NO_HIT)  # nothing was admitted
                    continue
                self.counters["remote_pending"] += 1
                pending.append((request, int(res.admit.pending_remote_blocks)))
            else:
                self.settle(rid, self._answer(request, res, session))
        return no_room, pending

    def settle(self, rid: str, answer: Answer) -> None:
        """The final answer of an admit in flight."""
        self.in_flight.pop(rid, None)
        self._asked.pop(rid, None)
        if not isinstance(answer, Pending):
            self._waiting.pop(rid, None)
            self._resent.discard(rid)
        late = rid in self.gave_up
        self.gave_up.discard(rid)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            if isinstance(answer, Plan):
                self.release(answer)
            return
        if late:
            if isinstance(answer, Plan):
                self.adopt(rid, answer)
            return
        self.answers[rid] = answer

    def _answer(self, request: Any, res: Any, session: Any) -> Answer:
        if res is None:
            return NO_HIT
        if res.status.code:
            self.counters["admit_refused"] += 1
            log.warning("blockd_vllm: blockd refused request %s: %s (%s); it is computed "
                        "without the cache", request.request_id, res.status.message,
                        res.status.field)
            return NO_HIT
        a = res.admit
        self.counters["admitted"] += 1
        self.counters["hit_tokens"] += a.num_cached_tokens
        return Plan(a.sequence_id, session.epoch, len(request.prompt_token_ids),
                    a.num_cached_tokens, list(a.block_table),
                    saved=a.num_cached_tokens // self.B,
                    committed=a.num_cached_tokens // self.B, session_id=session.session_id,
                    request=request if self.settings.save_generated else None)

    def hit_only(self, request: Any, res: Any, session: Any) -> Answer:
        """The answer of the second try of a request refused for room: the cached prefix
        pinned alone (loads, no saves), or NO_HIT."""
        if res is None or res.status.code:
            return NO_HIT
        a = res.admit
        self.counters["hit_tokens"] += a.num_cached_tokens
        # Nothing past the hit is saved: num_prompt is the admitted length.
        return Plan(a.sequence_id, session.epoch, a.num_cached_tokens, a.num_cached_tokens,
                    list(a.block_table), saved=a.num_cached_tokens // self.B,
                    committed=a.num_cached_tokens // self.B, session_id=session.session_id)

    def finished(self, rid: str) -> None:
        """The request ended (or was aborted) before it took its answer."""
        self.queued.pop(rid, None)
        self._waiting.pop(rid, None)
        self._resent.discard(rid)
        if rid not in self.in_flight:
            self._asked.pop(rid, None)
            self.gave_up.discard(rid)
        else:
            self.cancelled.add(rid)
        answer = self.answers.pop(rid, None)
        if isinstance(answer, Plan):
            self.release(answer)

    def drop_plans(self, release: bool) -> None:
        """blockd went away or changed epoch: answered plans nobody took yet are let go
        (released when ``release``: same epoch), their requests compute."""
        for rid, answer in list(self.answers.items()):
            if isinstance(answer, Plan):
                if release:
                    self.release(answer)
                self.answers[rid] = NO_HIT
