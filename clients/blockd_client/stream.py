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
from typing import TYPE_CHECKING

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
        from blockd_client.client import Backoff

        with self._lock:
            backoff = None
            while True:
                if self._responses is None:
                    self._open()
                assert self._requests is not None and self._responses is not None
                self._requests.put(req)
                # The stream has no deadline; each round trip gets the client's timeout.
                responses = self._responses
                timer = threading.Timer(self.client.timeout, responses.cancel)  # type: ignore[attr-defined]
                timer.start()
                try:
                    return next(responses)
                except StopIteration:  # the daemon ended the stream (drained): reopen
                    self._drop()
                    err_code = grpc.StatusCode.UNAVAILABLE
                    err: grpc.RpcError | None = None
                except grpc.RpcError as exc:
                    self._drop()
                    if exc.code() == grpc.StatusCode.CANCELLED and timer.finished.is_set():
                        raise BlockdError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          f"no answer within {self.client.timeout} s") from None
                    err_code = exc.code()
                    err = exc
                finally:
                    timer.cancel()
                if err_code != grpc.StatusCode.UNAVAILABLE:
                    raise BlockdError.from_rpc(err) from None  # type: ignore[arg-type]
                c = self.client
                backoff = backoff or Backoff(c.retries, c.backoff, c.reconnect_s)
                delay = backoff.next_delay()
                if delay is None:
                    if err is None:
                        raise BlockdError(grpc.StatusCode.UNAVAILABLE,
                                          "the daemon closed the step stream")
                    raise BlockdError.from_rpc(err) from None
                time.sleep(delay)

    def close(self) -> None:
        with self._lock:
            self._drop()
