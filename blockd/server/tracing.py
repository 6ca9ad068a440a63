"""OpenTelemetry spans for each BlockdService RPC (``tracing.*``; docs/operations.md "Tracing").

``start`` returns ``None`` with tracing off (``tracing.otlp_endpoint`` ""), having imported
nothing of OpenTelemetry: the daemon alone (``make serve``) does not install it. On, it
imports the optional extra ``blockd[tracing]`` (a missing package is a one-line refusal naming
the key and the package), reads the files the section names, and returns a ``Tracing``:

* ``interceptors``: opentelemetry-instrumentation-grpc's aio server interceptor (the sync one
  does not wrap grpc.aio handlers), one SERVER span per call of ``blockd.v1.BlockdService``
  named as its full method (``/blockd.v1.BlockdService/Step``), a StepStream one span for the
  stream, with ``rpc.grpc.status_code`` and the W3C trace context of the caller's metadata as
  its parent. Health and reflection calls get none (a probe every few seconds would be most
  of the spans).
* ``gate``: the fair gate, which tells a call's span its tenant (``TenantGate``) with
  ``tracing.tenant_attribute``; a plain ``FairGate`` otherwise.
* ``collector``: the ``blockd_trace_*`` series of ``/metrics``.

Spans are sampled parent-based with ``tracing.sampling_ratio`` and leave through
``blockd.server.span_export.BoundedExport`` (bounded queue, drops counted, an allowlist of
attributes: no metadata, so no ``authorization`` header, no session id, no request field).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

import blockd
from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import FailedPrecondition
from blockd.runtime.fair_gate import FairGate
from blockd.tracing_config import TracingConfig

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockdService"].full_name
KEY = "tracing.otlp_endpoint"
#: Module -> the package that ships it (what the refusal names).
PACKAGES = (
    ("opentelemetry.instrumentation.grpc", "opentelemetry-instrumentation-grpc"),
    ("opentelemetry.instrumentation", "opentelemetry-instrumentation"),
    ("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
    ("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http"),
    ("opentelemetry.sdk", "opentelemetry-sdk"),
    ("opentelemetry", "opentelemetry-api"),
)


class TenantGate(FairGate):
    """The fair gate, naming each call's tenant on its span as the call takes its turn: the
    gate key is the tenant the call acts for (``blockd.runtime.budgets.charge_key``), or
    ``@<credential>`` for a call that acts for none (nothing is named then). Heartbeat and
    Detach take no turn, so their spans carry no tenant."""

    def __init__(self, tag: Callable[[str], None]) -> None:
        super().__init__()
        self._tag = tag

    @asynccontextmanager
    async def turn(self, key: str, cost: int, *, resume: bool = False
                   ) -> AsyncIterator[Callable[[int], None]]:
        if not key.startswith("@"):
            self._tag(key)
        async with super().turn(key, cost, resume=resume) as spend:
            yield spend


@dataclass
class Tracing:
    """What ``blockd.server.app`` wires in with tracing on."""

    interceptors: tuple[grpc.aio.ServerInterceptor, ...]
    gate: FairGate
    export: Any  # span_export.BoundedExport (its module imports the SDK)
    provider: Any  # opentelemetry.sdk.trace.TracerProvider

    async def close(self) -> None:
        """The last spans sent (at most ``tracing.export_timeout_s``), off the event loop."""
        await asyncio.to_thread(self.provider.shutdown)

    def collector(self) -> TraceCollector:
        return TraceCollector(self.export)


class TraceCollector:
    """``blockd_trace_*``: what became of the spans (a prometheus_client collector)."""

    def __init__(self, export: Any) -> None:
        self.export = export

    def collect(self) -> Iterator[Metric]:
        e = self.export
        for name, value, text in (
                ("blockd_trace_spans_exported", e.exported, "Spans the OTLP receiver took."),
                ("blockd_trace_spans_dropped", e.dropped,
                 "Spans dropped before export: the queue (tracing.max_queue_spans) was full."),
                ("blockd_trace_spans_failed", e.failed,
                 "Spans of exports that failed (the receiver down, slow or refusing)."),
                ("blockd_trace_export_failures", e.failed_exports,
                 "Export requests that failed.")):
            c = CounterMetricFamily(name, text)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("blockd_trace_spans_queued", "Finished spans waiting for export.")
        g.add_metric([], e.queued)
        yield g


def missing(exc: ImportError) -> FailedPrecondition:
    """The refusal of tracing without its packages: names the key and the package."""
    name = exc.name or "opentelemetry"
    package = next((pkg for mod, pkg in PACKAGES if name == mod or name.startswith(mod + ".")),
                   name)
    return FailedPrecondition(
        f"{KEY}: tracing needs the Python package {package} ({name} cannot be imported); "
        f"install the extra: pip install 'blockd[tracing]'", field=KEY)


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise FailedPrecondition(f"{key}: {path}: {exc.strerror or exc}", field=key) from None


def read_headers(path: str) -> dict[str, str]:
    """``tracing.headers_file``: ``name: value`` lines (blank and ``#`` lines skipped); names
    lower-cased (gRPC metadata keys are). A refusal names the line, never its content."""
    key = "tracing.headers_file"
    headers: dict[str, str] = {}
    try:
        text = _read(path, key).decode()
    except UnicodeDecodeError:
        raise FailedPrecondition(f"{key}: {path}: not UTF-8 text", field=key) from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        if not sep or not name or not all(c.isalnum() or c in "-_." for c in name):
            raise FailedPrecondition(f"{key}: {path} line {n}: expected \"name: value\"",
                                     field=key)
        headers[name] = value.strip()
    return headers


def _exporter(cfg: TracingConfig) -> Any:
    """The OTLP exporter of ``tracing.protocol``, its files read now (refused on their key)."""
    headers = read_headers(cfg.headers_file) if cfg.headers_file else {}
    return (_grpc_exporter if cfg.protocol == "grpc" else _http_exporter)(cfg, headers)


def _grpc_exporter(cfg: TracingConfig, headers: dict[str, str]) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise missing(exc) from None
    creds = None
    if not cfg.insecure and not cfg.otlp_endpoint.startswith("http://"):
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(cfg.ca_file, "tracing.ca_file") if cfg.ca_file else None,
            private_key=_read(cfg.client_key, "tracing.client_key") if cfg.client_key
            else None,
            certificate_chain=_read(cfg.client_cert, "tracing.client_cert") if cfg.client_cert
            else None)
    return OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=cfg.insecure,
                            credentials=creds, headers=headers, timeout=cfg.export_timeout_s)


def _http_exporter(cfg: TracingConfig, headers: dict[str, str]) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise missing(exc) from None
    for path, key in ((cfg.ca_file, "tracing.ca_file"), (cfg.client_cert, "tracing.client_cert"),
                      (cfg.client_key, "tracing.client_key")):
        if path:
            _read(path, key)  # unreadable: refused now, not at the first export
    return OTLPSpanExporter(endpoint=cfg.otlp_endpoint, certificate_file=cfg.ca_file or None,
                            client_certificate_file=cfg.client_cert or None,
                            client_key_file=cfg.client_key or None, headers=headers,
                            timeout=cfg.export_timeout_s)


def start(cfg: TracingConfig) -> Tracing | None:
    """Tracing as configured (``None`` when off: nothing imported); a refusal names its key."""
    if not cfg.enabled:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.instrumentation import grpc as instrumentation
        from opentelemetry.instrumentation.grpc import filters
        from opentelemetry.sdk import resources
        from opentelemetry.sdk import trace as sdk
        from opentelemetry.sdk.trace import sampling

        from blockd.server import span_export
    except ImportError as exc:
        raise missing(exc) from None
    exporter = _exporter(cfg)
    keep = span_export.ATTRIBUTES | ({span_export.TENANT} if cfg.tenant_attribute
                                     else frozenset())
    export = span_export.BoundedExport(
        exporter, max_queue=cfg.max_queue_spans, max_batch=cfg.max_batch_spans,
        delay_s=cfg.schedule_delay_ms / 1000, timeout_s=cfg.export_timeout_s, keep=keep)
    provider = sdk.TracerProvider(
        sampler=sampling.ParentBased(sampling.TraceIdRatioBased(cfg.sampling_ratio)),
        resource=resources.Resource.create({"service.name": cfg.service_name,
                                            "service.version": blockd.__version__}),
        shutdown_on_exit=False)
    provider.add_span_processor(export)
    interceptor = instrumentation.aio_server_interceptor(  # type: ignore[no-untyped-call]
        tracer_provider=provider, filter_=filters.service_name(SERVICE_NAME))
    gate = FairGate()
    if cfg.tenant_attribute:
        tenant = span_export.TENANT
        gate = TenantGate(lambda key: trace.get_current_span().set_attribute(tenant, key))
    return Tracing((interceptor,), gate, export, provider)
