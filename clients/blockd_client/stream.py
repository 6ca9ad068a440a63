"""One long-lived ``StepStream`` per session that survives the daemon restarting.

The per-step path should not pay a unary call's setup per Step (and one channel with thousands
of unary calls in flight sheds some as CANCELLED). ``StepStreamer`` keeps one bidirectional
stream open: each ``round_trip`` sends one StepRequest and waits for its answer. When the stream
breaks with UNAVAILABLE (the daemon was killed or restarted, the connection reset) it opens a new
stream, with the client's backoff, and resends the same request: its step_id makes the daemon
answer it from its record if it had applied it, so the Step is applied exactly once. Any other
error ends that stream (the daemon aborts a stream on a bad request) and is raised; the next
round trip opens a fresh one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client.errors import BlockdError

if TYPE_CHECKING:
    from blockd_client.client import Client


class StepStreamer:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._requests: queue.Queue[pb.StepRequest | None] | None = None
        self._responses: Iterator[pb.StepResponse] | None = None
        #: Streams opened (1 + reconnects), for tests and logs.
        self.opened = 0
        # The stream has no deadline; each round trip gets the client's timeout from one
        # watchdog thread per streamer (a timer thread per Step would cost more than the Step).
        #: (monotonic deadline, the call to cancel) of the round trip in flight, if any.
        self._waiting: tuple[float, Any] | None = None
        self._wait_lock = threading.Lock()
        self._expired = False
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def _watch(self) -> None:
        tick = min(0.1, self.client.retry.timeout / 4)
        while not self._closed.wait(tick):
            with self._wait_lock:  # never cancel a round trip that has just been answered
                waiting = self._waiting
                if waiting is not None and time.monotonic() > waiting[0]:
                    self._expired = True
                    self._waiting = None
                    waiting[1].cancel()

    def _open(self) -> None:
        self._requests = queue.Queue()
        # No deadline on the stream itself: it lives as long as the session.
        self._responses = self.client.stub.StepStream(iter(self._requests.get, None),
                                                      metadata=self.client.metadata)
        self.opened += 1

    def _drop(self) -> None:
        if self._requests is not None:
            self._requests.put(None)  # ends grpc's request-iterator thread
        self._requests = self._responses = None

    def round_trip(self, req: pb.StepRequest) -> pb.StepResponse:
        policy = self.client.retry
        with self._lock:
            backoff = None
            while True:
                if self._responses is None:
                    self._open()
                assert self._requests is not None and self._responses is not None
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                      name="blockd-step-deadline")
                    self._watchdog.start()
                responses = self._responses
                with self._wait_lock:
                    self._expired = False
                    self._waiting = (time.monotonic() + policy.timeout, responses)
                self._requests.put(req)
                try:
                    return next(responses)
                except StopIteration:  # the daemon ended the stream (drained): reopen
                    self._drop()
                    err_code = grpc.StatusCode.UNAVAILABLE
                    err: grpc.RpcError | None = None
                except grpc.RpcError as exc:
                    self._drop()
                    if exc.code() == grpc.StatusCode.CANCELLED and self._expired:
                        raise BlockdError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          f"no answer within {policy.timeout} s") from None
                    err_code = exc.code()
                    err = exc
                finally:
                    with self._wait_lock:
                        self._waiting = None
                if err_code != grpc.StatusCode.UNAVAILABLE:
                    raise BlockdError.from_rpc(err) from None  # type: ignore[arg-type]
                backoff = backoff or policy.backoff_clock()
                delay = backoff.next_delay()
                if delay is None:
                    if err is None:
                        raise BlockdError(grpc.StatusCode.UNAVAILABLE,
                                          "the daemon closed the step stream")
                    raise BlockdError.from_rpc(err) from None
                time.sleep(delay)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            self._drop()
