"""The daemon's configuration: one typed tree, read from YAML, flags and environment.

Precedence, lowest first: the defaults below, the YAML file (``--config``), environment variables
``BLOCKD_<SECTION>_<FIELD>`` (read here and nowhere else), then command-line flags
``--<section>-<field>``. Flags and environment variables map 1:1 onto the fields below.

Every field is declared with ``option(default, "what it does")`` (``blockd.options``, the
mechanism): that one description is the flag's ``--help`` line, the row of the table in
docs/operations.md (``tools/config_docs.py`` writes it) and the hint in an error about the
field. A refused value names the field and where it came from (the YAML file, the environment
variable or the flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from blockd import options, wire
from blockd.core.errors import InvalidArgument
from blockd.core.spec import PoolSpec
from blockd.events_config import PLACEHOLDER as PLACEHOLDER
from blockd.events_config import EventsConfig as EventsConfig
from blockd.handles_config import HandlesConfig
from blockd.metrics_config import MetricsConfig as MetricsConfig
from blockd.options import Setting, option
from blockd.options import check_address as _check_address
from blockd.paths import default_handle_socket, default_unix_socket, runtime_dir  # noqa: F401 (re-exported)
from blockd.runtime.budgets import PARSE_BYTES_PER_UNIT
from blockd.tiers_config import TiersConfig
from blockd.tracing_config import TracingConfig

ENV_PREFIX = "BLOCKD_"
#: ``BLOCKD_*`` variables that are not the daemon's configuration but blockctl's and
#: ``blockd_client``'s (so a daemon started beside them does not warn about them).
CLIENT_ENV = ("BLOCKD_TARGET", "BLOCKD_TOKEN", "BLOCKD_TOKEN_FILE", "BLOCKD_HANDLE_SOCKET")
#: The longest Unix socket path the kernel takes (``sun_path`` is 108 bytes, NUL included).
MAX_UNIX_PATH = 107
LOG_LEVELS, LOG_FORMATS = ("DEBUG", "INFO", "WARNING", "ERROR"), ("kv", "json")


def _check_socket_path(cfg: Any, name: str, where: str) -> None:
    """Made absolute (so workers and blockctl elsewhere find it) and short enough to bind."""
    value = getattr(cfg, name)
    if not value:
        return
    path = os.path.abspath(value)
    if len(path.encode()) > MAX_UNIX_PATH:
        raise InvalidArgument(f"{where}: {path!r} is {len(path.encode())} bytes; a Unix socket "
                              f"path is at most {MAX_UNIX_PATH}", field=where)
    object.__setattr__(cfg, name, path)


def _check_positive(cfg: Any, section: str, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not value > 0:
            raise InvalidArgument(f"{section}.{name}: must be positive, got {value}",
                                  field=f"{section}.{name}")


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the gRPC server listens."""

    unix_socket: str = option(
        factory=default_unix_socket,
        doc="Unix socket for workers and blockctl on the same node (\"\" disables it). The "
            "default is ${XDG_RUNTIME_DIR:-/tmp}/blockd-<uid>/blockd.sock; a path held by a "
            "running daemon is refused.")
    tcp_address: str = option(
        "127.0.0.1:50051",
        "host:port for health checks and remote clients (\"\" disables TCP; port 0 picks one). "
        "Plaintext only on loopback: any other address needs tls_cert and tls_key.")
    tls_cert: str = option("", "PEM server certificate (chain) for TCP (\"\": plaintext TCP).")
    tls_key: str = option("", "PEM private key of tls_cert.")
    tls_client_ca: str = option("", "PEM CA: TCP clients need a certificate it signed (mTLS).")
    socket_mode: str = option("0660", "Mode of the Unix sockets, set whatever the umask: "
                                      "\"0660\" (owner and group) or \"0600\" (owner only).")
    handle_connections: int = option(16, "Most handle-socket connections served at once.")
    handle_timeout_s: float = option(2.0, "Seconds one handle-socket connection may take, "
                                          "request and answer; a slower client is cut off.")
    handle_socket: str = option(
        factory=default_handle_socket,
        doc="Unix socket from which attached workers receive the pool's file descriptors "
            "(\"\" disables it). The default is ${XDG_RUNTIME_DIR:-/tmp}/blockd-<uid>/"
            "blockd-pool.sock.")
    grace_seconds: float = option(
        5.0, "Seconds attached workers get to finish after SIGTERM before the server stops.")
    max_message_bytes: int = option(
        0, "Largest gRPC request or response message, bytes. 0: the largest request "
           "max_work_per_call admits (32 bytes per work unit: 4 MiB at its default); a larger "
           "one is refused by gRPC, one between is charged to its sender and refused.")
    max_operations_per_step: int = option(4096, "Most operations in one Step.")
    max_tokens_per_operation: int = option(
        1 << 20, "Most token ids in one operation (an admitted prompt or an append).")
    max_sessions: int = option(1024, "Most concurrently attached sessions.")
    max_queued_calls_per_tenant: int = option(
        64, "Most calls of one tenant waiting at once, for a turn or as held refusals; beyond, "
            "RESOURCE_EXHAUSTED (\"queue\") at once: a tenant's concurrency holds no more.")
    max_work_per_call: int = option(
        1 << 17, "Most work units one Step or Lookup may cost (about one per token id, 256 per "
                 "admit, 64 per other operation; a unit is ~0.1 us of the event loop every "
                 "tenant shares): a call beyond it is refused (RESOURCE_EXHAUSTED, \"work\").")
    gil_switch_interval_ms: float = option(0.5, "sys.setswitchinterval, ms: how long the loop "
                                           "waits for the lock gRPC's poller thread holds.")
    check_invariants: bool = option(
        False, "Check every block-manager invariant after each mutating call (O(num_blocks): "
               "for tests and debugging; a violation is logged and answered with INTERNAL).")
    invariant_check_interval_ms: float = option(
        0.0, "Check every invariant every this many milliseconds, between calls (0: never); "
             "cheaper than check_invariants under load. Violations are logged and counted in "
             "blockd_invariant_violations_total, and the daemon keeps serving.")
    enable_echo: bool = option(
        False, "Also serve /blockd.bench.Echo/Echo (returns its request bytes): the transport "
               "baseline of the Step benchmark. Off in production.")

    def __post_init__(self) -> None:
        _check_socket_path(self, "unix_socket", "server.unix_socket")
        _check_socket_path(self, "handle_socket", "server.handle_socket")
        if self.unix_socket and self.unix_socket == self.handle_socket:
            raise InvalidArgument("server.handle_socket: must differ from server.unix_socket",
                                  field="server.handle_socket")
        _check_address(self.tcp_address, "server.tcp_address")
        if not self.grace_seconds >= 0:
            raise InvalidArgument(f"server.grace_seconds: must not be negative, got "
                                  f"{self.grace_seconds}", field="server.grace_seconds")
        if self.max_message_bytes == 0:  # every byte gRPC admits is one the bound admits
            object.__setattr__(self, "max_message_bytes",
                               PARSE_BYTES_PER_UNIT * self.max_work_per_call)
        _check_positive(self, "server", "max_message_bytes", "max_operations_per_step",
                        "max_tokens_per_operation", "max_sessions", "max_work_per_call",
                        "max_queued_calls_per_tenant",
                        "handle_connections", "handle_timeout_s", "gil_switch_interval_ms")
        if not self.invariant_check_interval_ms >= 0:
            raise InvalidArgument("server.invariant_check_interval_ms: must not be negative, "
                                  f"got {self.invariant_check_interval_ms}",
                                  field="server.invariant_check_interval_ms")


@dataclass(frozen=True)
class PoolConfig:
    """The KV pool: its memory and its layout (what workers' kernels must match).

    The layout fields follow ``blockd.wire``'s rules, the ones ``PoolSpec`` and the workers'
    ``KvLayout`` apply: a config no worker could attach to is refused at load.
    """

    backend: str = option("host", "\"host\" (POSIX shared memory) or \"cuda\" (CUDA VMM through "
                                  "cuda-python).")
    block_size: int = option(16, "Tokens per block: a power of two in 1..256.")
    num_blocks: int = option(1024, "Physical blocks in the pool (the default is 64 MiB with "
                                   "the default layout).")
    num_layers: int = option(4, "Transformer layers whose K/V the pool holds.")
    num_kv_heads: int = option(4, "KV heads per layer held by one tensor-parallel shard.")
    head_dim: int = option(64, "Elements per attention head.")
    dtype: str = option("float16", "KV element type: float32, float16 or bfloat16 (float8_e4m3 "
                                   "is refused: the kernels have no FP8 path).")
    tp_size: int = option(1, "Tensor-parallel shards: the pool holds one plane per shard.")
    prefault: bool = option(False, "Touch every page at creation, so the first steps do not "
                                   "pay for page faults.")
    fence_poll_ms: float = option(2.0, "How often the daemon reads the fence pages of sessions "
                                       "with a fence announced and not completed, "
                                       "milliseconds (with none, it sleeps until a Step "
                                       "announces one).")
    fence_poll_max_ms: float = option(
        16.0, "While fences stay pending without completing, the polls back off, doubling "
              "from fence_poll_ms up to this many milliseconds; the first completion brings "
              "them back to fence_poll_ms. A fence completes at most this much after its "
              "worker published it; equal to fence_poll_ms: a fixed interval.")

    def __post_init__(self) -> None:
        if self.backend not in wire.BACKENDS:
            raise InvalidArgument(f"pool.backend: {self.backend!r} is unknown; use one of "
                                  f"{', '.join(map(repr, wire.BACKENDS))}", field="pool.backend")
        if not self.fence_poll_ms > 0:
            raise InvalidArgument(f"pool.fence_poll_ms: must be positive, got "
                                  f"{self.fence_poll_ms}", field="pool.fence_poll_ms")
        if not self.fence_poll_max_ms >= self.fence_poll_ms:
            raise InvalidArgument(f"pool.fence_poll_max_ms: must be at least fence_poll_ms "
                                  f"({self.fence_poll_ms}), got {self.fence_poll_max_ms}",
                                  field="pool.fence_poll_max_ms")
        try:
            spec = self.spec()
        except InvalidArgument as exc:
            raise InvalidArgument(f"pool.{exc.message}", field=f"pool.{exc.field}") from None
        object.__setattr__(self, "dtype", spec.dtype)  # "bf16" is stored as "bfloat16"

    def spec(self) -> PoolSpec:
        """The pool's shape as the core and the pools take it."""
        return PoolSpec(block_size=self.block_size, num_blocks=self.num_blocks,
                        num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype=self.dtype, tp_size=self.tp_size)


@dataclass(frozen=True)
class CacheConfig:
    """Prefix caching."""

    enable_prefix_cache: bool = option(True, "Share full blocks between requests with the same "
                                             "prefix.")
    scrub_always: bool = option(False, "Zero every reused block, whatever the tenants' "
                                       "policies say.")
    preemption: str = option(
        "priority", "When the pool is exhausted: \"priority\" preempts running sequences of "
                    "strictly lower (tenant priority, request priority) to make room; \"off\" "
                    "only answers RESOURCE_EXHAUSTED and leaves preemption to the workers.")

    def __post_init__(self) -> None:
        if self.preemption not in ("priority", "off"):
            raise InvalidArgument(
                f"cache.preemption: must be 'priority' or 'off', got {self.preemption!r}",
                field="cache.preemption")


@dataclass(frozen=True)
class LeaseConfig:
    """Session leases: a worker that stops calling is reaped."""

    default_ms: int = option(10_000, "Lease of a session whose Attach asks for none, "
                                     "milliseconds.")
    min_ms: int = option(500, "Shortest lease granted (shorter requests get this), "
                              "milliseconds.")
    max_ms: int = option(300_000, "Longest lease granted (longer requests get this), "
                                  "milliseconds.")
    reap_interval_ms: int = option(200, "How often expired sessions are looked for, "
                                        "milliseconds.")

    def __post_init__(self) -> None:
        _check_positive(self, "lease", "default_ms", "min_ms", "max_ms", "reap_interval_ms")
        if self.min_ms > self.max_ms:
            raise InvalidArgument(f"lease.min_ms: {self.min_ms} is above lease.max_ms "
                                  f"({self.max_ms})", field="lease.min_ms")


@dataclass(frozen=True)
class TenantsConfig:
    """Tenants and worker credentials."""

    file: str = option(
        "", "YAML file of tenants and workers (reloaded on SIGHUP). \"\": one tenant "
            "\"default\" that anonymous callers act for (a laptop default; see "
            "allow_anonymous).")
    allow_anonymous: bool = option(
        True, "Accept calls without a credential as the \"default\" tenant (only without a "
              "tenants file).")
    work_units_per_second: float = option(
        10_000_000.0, "Work units per second each tenant may spend on Steps, Lookups and "
                      "Attaches (a token bucket per tenant; see server.max_work_per_call for "
                      "the unit). Beyond it a call is refused with RESOURCE_EXHAUSTED "
                      "(\"rate\") and a retry hint. 0: no budget.")
    work_units_burst: float = option(
        2_000_000.0, "Work units a tenant may spend at once after being idle (the bucket's "
                     "size); a call costing more needs a full bucket.")
    rate_refusal_hold_ms: int = option(
        250, "A refusal for rate is answered once its retry hint has passed, up to this long "
             "(at most 8 held per tenant; 0: at once): ignoring the hints makes no flood.")

    def __post_init__(self) -> None:
        _check_positive(self, "tenants", "work_units_burst")
        for name in ("work_units_per_second", "rate_refusal_hold_ms"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"tenants.{name}: must not be negative",
                                      field=f"tenants.{name}")


@dataclass(frozen=True)
class StateConfig:
    """Crash recovery: where the pool and the journal outlive the daemon process."""

    dir: str = option(
        "", "A private directory (created 0700) on a tmpfs, e.g. a Kubernetes emptyDir with "
            "medium: Memory, holding the host pool, the fence pages, the snapshot and the "
            "journal: a daemon restarted after a crash (even kill -9) resumes with the same "
            "epoch, sequences and cached prefixes. \"\": no recovery (a restart starts a new "
            "epoch).")
    snapshot_min_bytes: int = option(
        64 * 1024 * 1024, "Journal bytes that trigger a snapshot (compaction); at least twice "
                          "the last snapshot's size, so compaction costs O(1) per journalled "
                          "byte.")
    reserve_bytes: int = option(
        16 * 1024 * 1024, "Free space kept in state.dir: new work (Steps, attaches) is refused "
                          "with RESOURCE_EXHAUSTED \"state dir full\" while less than this "
                          "plus the last snapshot's size is free, so the records that free "
                          "blocks (detaches, fences) and the next snapshot still fit.")


@dataclass(frozen=True)
class LogConfig:
    """The daemon's log: one line per record on stderr."""

    level: str = option("INFO", "Least severe level logged: DEBUG, INFO, WARNING or ERROR.")
    format: str = option("kv", "\"kv\" (logfmt: key=value pairs) or \"json\" (one object per "
                               "line, every field a key).")

    def __post_init__(self) -> None:
        level = str(self.level).upper()
        if level not in LOG_LEVELS:
            raise InvalidArgument(f"log.level: must be one of {', '.join(LOG_LEVELS)}, got "
                                  f"{self.level!r}", field="log.level")
        object.__setattr__(self, "level", level)
        if self.format not in LOG_FORMATS:
            raise InvalidArgument(f"log.format: must be 'kv' or 'json', got {self.format!r}",
                                  field="log.format")


@dataclass(frozen=True)
class Config:
    """The whole configuration."""

    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    state: StateConfig = field(default_factory=StateConfig)
    log: LogConfig = field(default_factory=LogConfig)
    handles: HandlesConfig = field(default_factory=HandlesConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        self.tiers.check_pool(self.pool.spec().slot_bytes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- reading it (blockd.options is the mechanism) --------------------------------------------

#: Fields whose default depends on the machine (the user's runtime directory).
COMPUTED_DEFAULTS = ("server.unix_socket", "server.handle_socket")


def settings() -> Iterator[Setting]:
    """Every field, in declaration order, with its default and its description."""
    return options.settings(Config, ENV_PREFIX)


def describe(key: str) -> str:
    """The description of ``section.field`` ("" for no such field)."""
    return next((s.help for s in settings() if s.key == key), "")


def markdown_table() -> str:
    """The reference table of docs/operations.md (``tools/config_docs.py`` writes it there)."""
    return options.markdown_table(Config, ENV_PREFIX, COMPUTED_DEFAULTS)


def from_env(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``BLOCKD_<SECTION>_<FIELD>`` variables as overrides. The only place env is read."""
    return options.from_env(Config, environ, ENV_PREFIX)


def unknown_env(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``BLOCKD_*`` variables that configure nothing (a typo is silently ignored otherwise):
    each with the closest real name, or ""."""
    return options.unknown_env(Config, os.environ if environ is None else environ, ENV_PREFIX,
                               CLIENT_ENV)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and one flag per field (``--pool-num-blocks``), helped by its doc."""
    options.add_flags(parser, Config, ENV_PREFIX)


def load(args: argparse.Namespace | None = None,
         environ: Mapping[str, str] | None = None) -> Config:
    """Defaults <- YAML file <- environment <- flags. A refusal (``InvalidArgument``) is one
    line that starts with the field and names where the value came from."""
    return options.load(Config, args, environ, ENV_PREFIX)  # type: ignore[no-any-return]
