"""Finished spans to the OTLP exporter: a bounded queue the event loop never waits on, one
thread that sends them in batches, and the allowlist of what a span may carry out.

Imported only with tracing on (``blockd.server.tracing.start``): it needs the OpenTelemetry
SDK, the optional extra ``blockd[tracing]``.

Why not the SDK's ``BatchSpanProcessor``: it logs a warning for every span it drops once its
queue is full (a log line per RPC, on the event loop, exactly when the receiver is already
behind) and counts drops only in an OpenTelemetry meter, not in ``/metrics``. Here a span that
finds the queue full is dropped and counted (``dropped``), nothing else; ``on_end``, the only
part that runs on the event loop, is a length check and an append. The thread sends a batch
when ``max_batch`` spans wait or ``delay_s`` has passed; an export that fails (the receiver
down, slow past its timeout, refusing) costs that thread its time, never a call's.

What leaves the daemon is decided at export (``scrub``), whatever the instrumentation or a
later version of it records: the span's name (the RPC's full method name), kind, times, trace
context and parent, the attributes of ``ATTRIBUTES`` (plus ``TENANT`` where allowed), and
the status code without its description. Dropped: every other attribute (``rpc.user_agent``
or anything a caller wrote), events (the instrumentation records the abort's exception with
its message and traceback), links, and the status message (a status message may name a
session, a tenant or a field's value).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Status

log = logging.getLogger("blockd.tracing")

#: The span attributes exported: the RPC (semantic conventions' rpc.*) and the peer's address
#: (net.peer.*, absent over the Unix socket). Nothing of the request or its metadata.
ATTRIBUTES = frozenset({"rpc.system", "rpc.service", "rpc.method", "rpc.grpc.status_code",
                        "net.peer.ip", "net.peer.port", "net.peer.name"})
#: The call's tenant id (``tracing.tenant_attribute``).
TENANT = "blockd.tenant"


def scrub(span: ReadableSpan, keep: frozenset[str]) -> ReadableSpan:
    """``span`` with only what may leave the daemon (the module's docstring says what)."""
    attributes = {k: v for k, v in (span.attributes or {}).items() if k in keep}
    return ReadableSpan(name=span.name, context=span.context, parent=span.parent,
                        resource=span.resource, attributes=attributes, kind=span.kind,
                        status=Status(span.status.status_code), start_time=span.start_time,
                        end_time=span.end_time,
                        instrumentation_scope=span.instrumentation_scope)


class BoundedExport(SpanProcessor):
    """Spans queued from the event loop (at most ``max_queue``), sent from one thread."""

    def __init__(self, exporter: SpanExporter, *, max_queue: int, max_batch: int,
                 delay_s: float, timeout_s: float, keep: frozenset[str]) -> None:
        self._exporter = exporter
        self._max_queue = max_queue
        self._max_batch = max_batch
        self._delay_s = delay_s
        self._timeout_s = timeout_s
        self._keep = keep
        self._queue: deque[ReadableSpan] = deque()  # appended by the loop, popped by the thread
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._deadline = float("inf")  # of the last sends, once stopping
        #: Spans dropped because the queue was full (written by the loop only).
        self.dropped = 0
        #: Spans the receiver accepted, and spans of exports that failed (the thread only).
        self.exported = 0
        self.failed = 0
        #: Export requests that failed (the thread only).
        self.failed_exports = 0
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="blockd-span-export",
                                        daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        """On the event loop, at the end of every sampled call: never blocks."""
        if len(self._queue) >= self._max_queue or self._stopping.is_set():
            self.dropped += 1
            return
        self._queue.append(span)
        if len(self._queue) >= self._max_batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._send(all_queued=False)
        self._send(all_queued=True)  # the last spans, until the stop's deadline

    def _send(self, *, all_queued: bool) -> None:
        """One batch, more while a full batch waits (or, stopping, while any waits)."""
        first = True
        while self._queue and (first or all_queued or len(self._queue) >= self._max_batch):
            if time.monotonic() > self._deadline:
                return
            first = False
            batch: list[ReadableSpan] = []
            while self._queue and len(batch) < self._max_batch:
                batch.append(scrub(self._queue.popleft(), self._keep))
            self._export(batch)

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        try:
            ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception:  # an exporter bug must not end the thread
            log.exception("span export raised")
            ok = False
        if ok:
            if self._failing:
                log.info("span export works again")
                self._failing = False
            self.exported += len(batch)
            return
        if not self._failing:  # said once per outage; the counters say how long
            log.warning("span export failed: its spans are lost, and so are the next ones "
                        "until the receiver takes them (blockd_trace_export_failures_total)")
            self._failing = True
        self.failed += len(batch)
        self.failed_exports += 1

    def shutdown(self) -> None:
        """Send what is queued for at most ``timeout_s``, then stop (off the event loop: the
        caller runs it in a thread)."""
        if self._stopping.is_set():
            return
        self._deadline = time.monotonic() + self._timeout_s
        self._stopping.set()
        self._wake.set()
        self._thread.join(self._timeout_s)
        self._exporter.shutdown()  # ends an export still retrying
        self._thread.join(1.0)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._wake.set()
        return True
