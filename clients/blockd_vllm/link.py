"""The scheduler side's connection to blockd: one session, and what happens when blockd goes.

``Link`` attaches at engine start (retrying until ``connect_timeout_s``; a refusal a retry will
not fix, such as a bad token, a foreign tenant or a layout mismatch, refuses to start with the
key and both values named), sends its Steps over one long-lived StepStream (``blockd_client``'s
``StepStreamer``: no unary call's setup per Step, in either process; reopened, and the Step
resent with its step_id, exactly once applied, when the stream breaks), makes every call with a
short deadline, and turns failures into
states instead of exceptions: *degraded* while blockd does not answer (tried again every
``retry_interval_s``), a re-attached session after an epoch change. Its owner hears about both
(``Listener``) and gets a periodic ``tick`` on the heartbeat thread, which also keeps the lease
while the engine is idle. ``lock`` serializes every call of the session (the outbox's, the
heartbeat thread's); the listener is called with it held and takes its own lock after it, never
the other way round (``blockd_vllm.outbox``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import BlockdError, Client, EpochChanged, StepOutcome
from blockd_client.errors import UNANSWERED
from blockd_vllm.layout import KvShape
from blockd_vllm.settings import Settings

log = logging.getLogger("blockd_vllm")
T = TypeVar("T")

#: How often the heartbeat thread ticks (seconds).
TICK_S = 0.05
#: Statuses that mean "blockd is not reachable now" (degrade, try again later): the call went
#: unanswered, and a Step may have been applied all the same (``Session.settle``).
UNREACHABLE = UNANSWERED
#: Statuses at start that a retry will not fix: refuse to start.
FATAL_AT_START = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.INVALID_ARGUMENT})


def until_answered(settings: Settings, call: Callable[[], T]) -> T:
    """``call()`` at engine start, tried again while blockd does not answer, for at most
    ``connect_timeout_s`` (RuntimeError naming the target then); a refusal a retry will not
    fix (``FATAL_AT_START``) is raised at once, as the BlockdError."""
    deadline = time.monotonic() + settings.connect_timeout_s
    while True:
        try:
            return call()
        except BlockdError as err:
            if err.status in FATAL_AT_START:
                raise
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"blockd_vllm: blockd at kv_connector_extra_config.target="
                    f"{settings.target!r} did not answer within connect_timeout_s="
                    f"{settings.connect_timeout_s:g} ({err.status.name}: {err.message})"
                ) from None
            time.sleep(0.2)


def kv_layout(shape: KvShape) -> Any:
    """The layout an Attach declares for ``shape``."""
    from blockd_gpu.layout import KvLayout

    return KvLayout(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                    head_dim=shape.head_dim, block_size=shape.block_size, dtype=shape.dtype)


def start_error(settings: Settings, shape: KvShape, err: BlockdError) -> str:
    """An Attach refused at engine start, naming the extra-config key (or the KV layout, with
    vLLM's) and blockd's reason."""
    where = {grpc.StatusCode.UNAUTHENTICATED: "kv_connector_extra_config.token_file",
             grpc.StatusCode.PERMISSION_DENIED: "kv_connector_extra_config.tenant",
             grpc.StatusCode.NOT_FOUND: "kv_connector_extra_config.tenant"}.get(
                 err.status, "the engine's KV layout")
    detail = err.message
    if err.field.startswith("layout."):
        detail = f"{err.message} (vLLM: {shape.describe()})"
    return (f"blockd_vllm: blockd at {settings.target!r} refused to attach tenant "
            f"{settings.tenant!r}: {err.status.name} on {where}: {detail}")


def detach_session(settings: Settings, session_id: str) -> bool:
    """Close ``session_id`` (an engine's session) from any process that has the engine's
    settings; False when blockd did not answer or the session is gone already."""
    client = Client(settings.target, token_file=settings.token_file,
                    timeout=settings.rpc_timeout_s, retries=1, backoff=0.02,
                    reconnect_s=0.0)
    try:
        client.call(client.stub.Detach, pb.DetachRequest(session_id=session_id))
        return True
    except BlockdError as err:
        log.debug("blockd_vllm: detaching session %s: %s", session_id, err)
        return False
    finally:
        client.close()


class Listener(Protocol):
    def lost(self) -> None: ...
    def late_answer(self, outcome: StepOutcome) -> None: ...
    def epoch_changed(self, err: EpochChanged) -> None: ...
    def tick(self) -> bool: ...


class Link:
    def __init__(self, settings: Settings, shape: KvShape, counters: Counter[str]) -> None:
        self.settings = settings
        self.shape = shape
        self.counters = counters
        self.lock = threading.RLock()
        self.listener: Listener | None = None
        self._down_since: float | None = None
        self._next_try = 0.0
        #: Why blockd ended the session for good ("" while it lasts): its worker detached it
        #: (the engine is shutting down) or a tenants reload revoked it. No call is made then.
        self.ended = ""
        #: Counts blockd's comebacks and epoch changes (``PoolRef.generation``).
        self.generation = 0
        self.client = Client(settings.target, token_file=settings.token_file,
                             timeout=settings.rpc_timeout_s, retries=1, backoff=0.02,
                             reconnect_s=0.0)
        self.session = self._attach_at_start()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeats, name="blockd-vllm-heartbeat",
                                      daemon=True)

    def start(self, listener: Listener) -> None:
        self.listener = listener
        self._beat.start()

    # -- start ---------------------------------------------------------------------------------

    def _attach_at_start(self) -> Any:
        try:
            session = until_answered(self.settings, lambda: self.client.attach(
                self.settings.tenant, kv_layout(self.shape), tp_size=self.shape.tp_size,
                map_pool=False, tables=False, stream=True,
                worker_name=self.settings.worker_name, lease_ms=self.settings.lease_ms))
        except BlockdError as err:
            self.client.close()  # the engine is ending: leave no channel behind
            raise RuntimeError(start_error(self.settings, self.shape, err)) from None
        except BaseException:
            self.client.close()
            raise
        log.info("blockd_vllm: attached to %s as tenant %s (session %s, epoch %d, pool %s)",
                 self.settings.target, self.settings.tenant, session.session_id,
                 session.epoch, self.shape.describe())
        return session

    # -- calls ---------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._down_since is not None or bool(self.ended)

    def call(self, fn: Any, *args: Any) -> Any:
        """One session call; None when blockd is unreachable (the link degrades), the epoch
        changed (the session re-attached) or blockd refused it (counted, said once per kind):
        the cache never fails a request."""
        with self.lock:
            if self.ended or (self._down_since is not None and not self._try_again()):
                return None
            try:
                return fn(*args)
            except EpochChanged as err:
                self._new_epoch(err)
            except BlockdError as err:
                if err.status in UNREACHABLE:
                    self._go_down(err, getattr(fn, "__name__", "a call"))
                elif not self._end(err):
                    key = f"rpc_{err.status.name.lower()}"
                    self.counters[key] += 1
                    if self.counters[key] == 1:
                        log.warning("blockd_vllm: blockd refused a call (%s); the request is "
                                    "computed without the cache", err)
            return None

    def _try_again(self) -> bool:
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self.settings.retry_interval_s
        try:
            self.session.heartbeat()
        except EpochChanged as err:
            self._new_epoch(err)
        except BlockdError as err:
            self.counters["reconnect_failures"] += 1
            log.debug("blockd_vllm: blockd still unreachable: %s", err)
            return False
        late = None
        try:
            # The Step that went unanswered may have been applied: its answer first (before
            # any new Step supersedes it), e.g. the sequences its admits created.
            late = self.session.settle()
        except EpochChanged as err:
            self._new_epoch(err)
        except BlockdError as err:
            if err.status in UNREACHABLE:
                self.counters["reconnect_failures"] += 1
                return False
            if self._end(err):
                return False
            log.warning("blockd_vllm: blockd refused the unanswered Step sent again (%s)", err)
        if late is not None:
            self.counters["late_answers"] += 1
            if self.listener is not None:
                self.listener.late_answer(late)
        down = now - (self._down_since or now)
        self._down_since = None
        self.generation += 1
        log.warning("blockd_vllm: blockd at %s is back after %.1f s: the cache is used again",
                    self.settings.target, down)
        return True

    def _go_down(self, err: BlockdError, what: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._next_try = self._down_since + self.settings.retry_interval_s
            self.counters["degraded_episodes"] += 1
            log.warning("blockd_vllm: blockd at %s unreachable (%s on %s: %s): requests are "
                        "computed without the cache until it answers again",
                        self.settings.target, err.status.name, what, err.message)
        if self.listener is not None:
            self.listener.lost()

    def _end(self, err: BlockdError) -> bool:
        """Whether ``err`` says blockd ended the session for good (FAILED_PRECONDITION on
        ``session_id``: detached by the engine's worker at shutdown, or revoked by a tenants
        reload). Re-attaching would leave a session nobody detaches; every later request is
        computed without the cache."""
        if err.status != grpc.StatusCode.FAILED_PRECONDITION or err.field != "session_id":
            return False
        if not self.ended:
            self.ended = err.message
            self._stop.set()
            log.log(logging.INFO if "detached" in err.message else logging.WARNING,
                    "blockd_vllm: blockd ended the session (%s): requests are computed "
                    "without the cache", err.message)
        return True

    def _new_epoch(self, err: EpochChanged) -> None:
        self.counters["epoch_changes"] += 1
        self._down_since = None
        self.generation += 1
        if self.listener is not None:
            self.listener.epoch_changed(err)

    # -- the heartbeat thread ------------------------------------------------------------------

    def _heartbeats(self) -> None:
        """Keep the lease while the engine is idle, let the owner finish what an idle engine
        left (``tick``), and reconnect after an outage."""
        period = max(0.2, self.session.state.attach.lease_ms / 3000.0)
        last_beat = time.monotonic()
        while not self._stop.wait(TICK_S):
            if not self.lock.acquire(timeout=period):
                continue
            try:
                now = time.monotonic()
                if self._down_since is not None:
                    if now >= self._next_try:
                        self._try_again()
                    continue
                assert self.listener is not None
                if self.listener.tick() or now - last_beat >= period:
                    self.session.heartbeat()
                    last_beat = now
            except EpochChanged as err:
                self._new_epoch(err)
            except BlockdError as err:
                if err.status in UNREACHABLE:
                    self._go_down(err, "heartbeat")
                else:
                    self._end(err)
            except Exception:  # never let the thread die silently
                log.exception("blockd_vllm: heartbeat failed")
            finally:
                self.lock.release()

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            try:
                if self._down_since is None and not self.ended:
                    self.session.detach()
            except BlockdError:
                pass
            self.client.close()
