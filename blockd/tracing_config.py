"""The ``tracing`` section of the configuration: OpenTelemetry spans for each RPC, exported over
OTLP (``blockd.server.tracing`` starts it; docs/operations.md "Tracing").

Off by default (``otlp_endpoint`` ""), and then nothing of OpenTelemetry is imported: the
packages are the optional extra ``blockd[tracing]``, which the daemon alone (``make serve``)
does not install. Its own module because ``blockd.config`` is near the size limit;
``blockd.config.Config`` holds it as ``tracing``. Values are checked here against each other;
the files named (headers, TLS material) are read when the daemon starts, before anything is
bound, each a one-line refusal naming its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from blockd.core.errors import InvalidArgument
from blockd.options import option

#: ``tracing.protocol`` values: OTLP's own names (``OTEL_EXPORTER_OTLP_PROTOCOL``).
PROTOCOLS = ("grpc", "http/protobuf")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans for each BlockdService RPC."""

    otlp_endpoint: str = option(
        "", "OTLP receiver the spans go to (an OpenTelemetry Collector, Jaeger, Tempo): "
            "\"host:port\" or \"https://host:4317\" for grpc, a URL such as "
            "\"http://host:4318/v1/traces\" for http/protobuf. \"\": tracing off (nothing of "
            "OpenTelemetry is imported). On, it needs the extra blockd[tracing].")
    protocol: str = option("grpc", "OTLP transport: \"grpc\" or \"http/protobuf\".")
    insecure: bool = option(
        False, "grpc: plaintext to the receiver (a Collector beside the daemon). false: TLS, "
               "with the system's roots or tracing.ca_file. For http/protobuf the URL's scheme "
               "decides.")
    ca_file: str = option("", "PEM CA the receiver's certificate must chain to (\"\": the "
                              "system's roots).")
    client_cert: str = option("", "PEM client certificate (chain) presented to the receiver "
                                  "(mTLS).")
    client_key: str = option("", "PEM private key of tracing.client_cert.")
    headers_file: str = option(
        "", "File of headers sent with every export, one \"name: value\" a line (a backend's "
            "API key, from a mounted Secret); read at start, never logged. \"\": none.")
    service_name: str = option("blockd", "The spans' service.name resource attribute.")
    sampling_ratio: float = option(
        1.0, "Share of traces sampled, 0..1, where no caller decided: a call carrying a W3C "
             "traceparent is sampled as its caller's trace is (parent-based).")
    tenant_attribute: bool = option(
        False, "Put the call's tenant id on its span (blockd.tenant). false: no tenant id "
               "leaves the daemon in a span (as metrics.tenant_labels: false for /metrics).")
    max_queue_spans: int = option(
        2048, "Most finished spans waiting for export; a span finished while it is full is "
              "dropped and counted (blockd_trace_spans_dropped_total), never waited for.")
    max_batch_spans: int = option(512, "Most spans in one export request.")
    schedule_delay_ms: float = option(
        5000.0, "Longest a finished span waits before its batch is sent, milliseconds.")
    export_timeout_s: float = option(
        10.0, "Seconds one export (retries included) may take; also the longest a stopping "
              "daemon waits for its last spans to be sent.")

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise InvalidArgument(f"tracing.protocol: must be one of {', '.join(PROTOCOLS)}, "
                                  f"got {self.protocol!r}", field="tracing.protocol")
        _check_endpoint(self.otlp_endpoint, self.protocol)
        if not 0.0 <= self.sampling_ratio <= 1.0:
            raise InvalidArgument(f"tracing.sampling_ratio: must be in 0..1, got "
                                  f"{self.sampling_ratio}", field="tracing.sampling_ratio")
        for name in ("max_queue_spans", "max_batch_spans", "schedule_delay_ms",
                     "export_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"tracing.{name}: must be positive, got "
                                      f"{getattr(self, name)}", field=f"tracing.{name}")
        if self.max_batch_spans > self.max_queue_spans:
            raise InvalidArgument(f"tracing.max_batch_spans: {self.max_batch_spans} is above "
                                  f"tracing.max_queue_spans ({self.max_queue_spans})",
                                  field="tracing.max_batch_spans")
        if not self.service_name.strip():
            raise InvalidArgument("tracing.service_name: must not be empty",
                                  field="tracing.service_name")
        for name, needs in (("client_key", "client_cert"), ("client_cert", "client_key")):
            if getattr(self, name) and not getattr(self, needs):
                raise InvalidArgument(f"tracing.{needs}: needed with tracing.{name}",
                                      field=f"tracing.{needs}")
        if self.insecure and (self.ca_file or self.client_cert):
            raise InvalidArgument("tracing.insecure: true sends plaintext, so tracing.ca_file "
                                  "and tracing.client_cert would not be used; drop one",
                                  field="tracing.insecure")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)


def _check_endpoint(value: str, protocol: str) -> None:
    """grpc: ``host:port`` or an http(s) URL with a port; http/protobuf: an http(s) URL."""
    if not value:
        return
    where = "tracing.otlp_endpoint"
    if "://" in value:
        try:
            url = urlsplit(value)
            url.port  # noqa: B018 (raises ValueError on a bad port)
        except ValueError:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.hostname:
            raise InvalidArgument(f"{where}: expected http://HOST:PORT/... or "
                                  f"https://HOST:PORT/..., got {value!r}", field=where)
        return
    if protocol != "grpc":
        raise InvalidArgument(f"{where}: http/protobuf needs a URL (e.g. "
                              f"http://collector:4318/v1/traces), got {value!r}", field=where)
    host, sep, port = value.rpartition(":")
    if not host or not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidArgument(f"{where}: expected HOST:PORT with a port in 1..65535, got "
                              f"{value!r}", field=where)
