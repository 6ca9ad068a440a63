"""The scheduler side's calls to blockd, made off vLLM's scheduler thread.

vLLM's ``schedule()`` runs the connector's scheduler hooks on the engine core's one thread; a
blockd round trip there is a stall of the whole engine. So the scheduler side never calls
blockd itself: it hands each call to the ``Outbox`` (``put``) and carries on. One thread makes
the calls, one at a time, in the order they were put (a commit before the release of the same
sequence, the Steps of one session in the order their fences were numbered), each under the
link's lock (``Link.call``: failures become states, never exceptions), and then applies its
result with ``then`` under the side's lock, before the next call starts: results are applied
in order, and no other call of the session (the heartbeat thread's) comes in between a call and
its result. Lock order: the link's lock, then the side's; the scheduler thread takes only the
side's, so it waits at most for a ``then`` (a few dictionary updates), never for blockd; the one
exception is an engine with nothing else to run, which may wait a bounded time for an answer
(``applied``, a condition over the side's lock: it is notified after every ``then``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("blockd_vllm")


class Outbox:
    def __init__(self, link_lock: Any, side_lock: Any, name: str = "blockd-vllm-outbox"
                 ) -> None:
        self._link_lock = link_lock
        self._side_lock = side_lock
        #: Notified (the side's lock held) after each ``then``; ``answers`` counts them.
        self.applied = threading.Condition(side_lock)
        self.answers = 0
        self._jobs: deque[tuple[Callable[[], Any], Callable[[Any], None]]] = deque()
        self._cv = threading.Condition()
        #: Jobs put and not yet applied (queued or running).
        self._open = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, call: Callable[[], Any], then: Callable[[Any], None]) -> None:
        """Make ``call()`` on the outbox thread, then ``then(result)`` under the side's lock
        (``result`` None when ``call`` raised: logged)."""
        with self._cv:
            self._jobs.append((call, then))
            self._open += 1
            self._cv.notify()

    def wait_applied(self, done: Callable[[], bool], timeout: float) -> int:
        """Wait, holding the side's lock (released meanwhile), until ``done()`` after some
        ``then``, or ``timeout``; the nanoseconds waited."""
        t0 = time.perf_counter_ns()
        self.applied.wait_for(done, timeout)
        return time.perf_counter_ns() - t0

    @property
    def busy(self) -> bool:
        """A call is queued or in flight."""
        return self._open > 0

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every job put so far is applied (tests, shutdown); False on timeout.
        Never call it holding the side's lock."""
        with self._cv:
            return self._cv.wait_for(lambda: self._open == 0, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop)
                if not self._jobs:
                    return
                call, then = self._jobs.popleft()
            with self._link_lock:
                try:
                    result = call()
                except Exception:  # never let the thread die: the job's owner must hear back
                    log.exception("blockd_vllm: a call to blockd failed")
                    result = None
                with self._side_lock:
                    try:
                        then(result)
                    except Exception:
                        log.exception("blockd_vllm: applying blockd's answer failed")
                    self.answers += 1
                    self.applied.notify_all()
            with self._cv:
                self._open -= 1
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Finish the calls already put (each bounded by the RPC deadline), then stop."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)


class Steps:
    """The session's Steps, sent through an ``Outbox``: each is numbered with its fence when
    it is made (``SessionState.request``), in the order they were put, and ``announced`` is
    the fence of the last one blockd answered (the only fence a worker may publish)."""

    def __init__(self, link: Any, side_lock: Any, counters: Any,
                 before: Callable[[], None]) -> None:
        self.link = link
        self.counters = counters
        #: Run under the side's lock right before each Step (the side reports fences done).
        self.before = before
        self._side_lock = side_lock
        self.outbox = Outbox(link.lock, side_lock)
        self.announced = 0

    def send(self, ops: list[Any], then: Callable[[Any, bool], None]) -> None:
        """Queue a Step of ``ops``; ``then(outcome, new_epoch)`` applies its answer (outcome
        None: not applied; new_epoch: because the session re-attached)."""
        self.outbox.put(lambda: self.call(ops), lambda res: then(*self.applied(res)))

    def call(self, ops: list[Any]) -> tuple[Any, bool]:
        """On the outbox thread (the link's lock held): one Step."""
        with self._side_lock:
            self.before()
        epochs = self.counters["epoch_changes"]
        outcome = self.link.call(self.link.session.step, ops)
        return outcome, self.counters["epoch_changes"] != epochs

    def applied(self, res: tuple[Any, bool] | None) -> tuple[Any, bool]:
        """Under the side's lock: a Step's answer (``call``'s result) counted, its fence
        announced, its per-operation refusals counted."""
        outcome, new_epoch = res if res is not None else (None, False)
        self.counters["blockd_steps"] += 1
        if outcome is not None:
            self.announced = outcome.fence
            for r in outcome.results:
                if r.status.code:
                    self.counters["op_refused"] += 1
        return outcome, new_epoch
