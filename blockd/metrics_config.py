"""The ``metrics`` section of the configuration: the Prometheus listener (``/metrics``,
``/healthz``, ``/``).

Its own module because ``blockd.config`` is at the size limit; ``blockd.config.Config`` holds it
as ``metrics`` (``blockd.server.metrics`` renders with it, ``blockd.server.metrics_http`` serves
it). Values are checked here against each other; the files named (token, TLS material) are read
when the daemon starts, before anything is bound, each a one-line refusal naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockd import tls_files
from blockd.core.errors import InvalidArgument
from blockd.options import check_address, option


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint."""

    address: str = option("127.0.0.1:9400",
                          "host:port serving /metrics and /healthz (\"\" disables it; port 0 "
                          "picks one).")
    max_connections: int = option(16, "Most HTTP connections open at once (more: closed).")
    request_timeout_s: float = option(5.0, "Seconds one HTTP connection may take, request and "
                                           "answer (a TLS handshake included); a slower client "
                                           "is cut off.")
    cache_ms: float = option(
        1000.0, "Milliseconds one rendering of /metrics is reused: every scrape within it gets "
                "the same bytes, so any number of scrapers costs the event loop one rendering "
                "per interval (0: render every scrape).")
    tenant_labels: bool = option(
        True, "Label per-tenant series with the tenant id. false: each such family is one "
              "series summed over the tenants, and no tenant id is in the exposition.")
    bearer_token_file: str = option(
        "", "File holding the token that /metrics and / require (\"Authorization: Bearer "
            "<token>\", Prometheus' authorization.credentials_file; 401 otherwise); /healthz "
            "stays open for probes. Read at start and on SIGHUP (a file that no longer reads "
            "keeps the previous token, logged). \"\": no token.")
    tls_cert: str = option("", "PEM certificate (chain) of the metrics listener: HTTPS "
                               "(\"\": plain HTTP).")
    tls_key: str = option("", "PEM private key of metrics.tls_cert.")
    tls_client_ca: str = option("", "PEM CA: scrapers need a certificate it signed (mTLS).")

    def __post_init__(self) -> None:
        check_address(self.address, "metrics.address")
        for name in ("max_connections", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"metrics.{name}: must be positive, got "
                                      f"{getattr(self, name)}", field=f"metrics.{name}")
        if not self.cache_ms >= 0:
            raise InvalidArgument(f"metrics.cache_ms: must be >= 0 (0: no cache), got "
                                  f"{self.cache_ms}", field="metrics.cache_ms")
        pair = tls_files.missing(self)
        if pair:
            name, needs = pair
            raise InvalidArgument(f"metrics.{needs}: needed with metrics.{name}",
                                  field=f"metrics.{needs}")

    @property
    def authenticated(self) -> bool:
        """Whether a scraper must prove who it is (a token, or a client certificate)."""
        return bool(self.bearer_token_file or self.tls_client_ca)
