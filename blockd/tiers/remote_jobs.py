"""What the remote tier asks its store, apart from the client that does it.

The settings of the cluster client, what it counts, and a fetch job: plain records without
redis-py, so that the runtime names them without importing redis-py (``blockd.runtime.remote``
imports ``blockd.tiers.redis_cluster``, and redis-py with it, only when a remote tier is
configured: redis-py 8 loads OpenTelemetry's API and metrics SDK at import, which a daemon
without a remote tier has no use for).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from blockd.tiers.histogram import Histogram


@dataclass(frozen=True)
class RedisSettings:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    timeout_s: float = 0.2
    ttl_s: int = 0
    retry_s: float = 1.0
    queue_values: int = 1024
    #: Fetches one tenant may have waiting (``blockd.tiers.fair_queue``).
    fetches_per_tenant: int = 64


@dataclass
class RemoteCounters:
    """What the remote tier did; read by the metrics collector (under no lock: each field is
    written by one thread, and a scrape may see a count one command late)."""

    errors: Counter[str] = field(default_factory=Counter)
    #: Values not written or fetches not made: ``publish_queue`` (full), ``fetch_budget`` (the
    #: tenant had ``fetches_per_tenant`` fetches waiting), ``down`` (no client).
    dropped: Counter[str] = field(default_factory=Counter)
    values_written: int = 0
    bytes_written: int = 0
    values_read: int = 0
    bytes_read: int = 0
    #: Seconds of each pipeline, by operation (``get``, ``set``).
    seconds: dict[str, Histogram] = field(
        default_factory=lambda: {"get": Histogram(), "set": Histogram()})
    up: bool = False
    connects: int = 0


@dataclass
class FetchJob:
    keys: list[bytes]
    #: Called on the fetcher thread with one raw value per key (None: no value) and the
    #: indices of the keys the cluster gave no answer for (a master down, a timeout): only the
    #: other Nones say that the cluster holds no such key.
    done: Callable[[list[bytes | None], frozenset[int]], None]
    #: Whose fetch it is: fetches are served tenant by tenant, in turn.
    tenant: str = ""
