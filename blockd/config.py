"""The daemon's configuration: one typed tree, read from YAML, flags and environment.

Precedence, lowest first: the defaults below, the YAML file (``--config``), environment variables
``BLOCKD_<SECTION>_<FIELD>`` (read here and nowhere else), then command-line flags
``--<section>-<field>``. Flags and environment variables map 1:1 onto the fields below.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from blockd import wire
from blockd.core.errors import InvalidArgument
from blockd.core.spec import PoolSpec

ENV_PREFIX = "BLOCKD_"


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the gRPC server listens."""

    #: Unix socket for workers on the same node ("" disables it).
    unix_socket: str = "run/blockd.sock"
    #: host:port for health checks and remote clients ("" disables TCP; port 0 picks one).
    tcp_address: str = "127.0.0.1:50051"
    #: Unix socket from which attached workers receive the pool's file descriptor.
    handle_socket: str = "run/blockd-pool.sock"
    #: Seconds in-flight calls get to finish after SIGTERM before the server stops.
    grace_seconds: float = 5.0
    #: Largest request or response message, bytes.
    max_message_bytes: int = 16 * 1024 * 1024
    #: Most operations in one Step.
    max_operations_per_step: int = 4096
    #: Most token ids in one operation (an admitted prompt or an append).
    max_tokens_per_operation: int = 1 << 20
    #: Most concurrently attached sessions.
    max_sessions: int = 1024
    #: Check every invariant of the block manager after each mutating call (O(num_blocks):
    #: for tests and debugging; a violation is logged and answered with INTERNAL).
    check_invariants: bool = False
    #: Check every invariant every this many milliseconds, between calls (0: never). Cheaper
    #: than ``check_invariants`` under load; violations are logged and counted in
    #: ``blockd_invariant_violations_total``, and the daemon keeps serving.
    invariant_check_interval_ms: float = 0.0
    #: Also serve ``/blockd.bench.Echo/Echo`` (returns its request bytes): the transport
    #: baseline the Step benchmark compares against. Off in production.
    enable_echo: bool = False


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint."""

    #: host:port serving /metrics ("" disables it; port 0 picks one).
    address: str = "127.0.0.1:9400"


@dataclass(frozen=True)
class PoolConfig:
    """The KV pool: its memory and its layout (what workers' kernels must match).

    The layout fields follow ``blockd.wire``'s rules, the ones ``PoolSpec`` and the workers'
    ``KvLayout`` apply: a config no worker could attach to is refused at load.
    """

    #: "host" (POSIX shared memory) or "cuda" (CUDA VMM through cuda-python).
    backend: str = "host"
    #: Tokens per block: a power of two in 1..256.
    block_size: int = 16
    #: Physical blocks (the default is 64 MiB with the layout below).
    num_blocks: int = 1024
    num_layers: int = 4
    #: KV heads per tensor-parallel shard.
    num_kv_heads: int = 4
    head_dim: int = 64
    #: float32, float16 or bfloat16 (float8_e4m3 is refused: the kernels have no FP8 path).
    dtype: str = "float16"
    tp_size: int = 1
    #: Touch every page at creation, so the first steps do not pay for page faults.
    prefault: bool = False
    #: How often the daemon reads the sessions' fence pages, milliseconds.
    fence_poll_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.backend not in wire.BACKENDS:
            raise InvalidArgument(f"pool.backend: {self.backend!r} is unknown; use one of "
                                  f"{', '.join(map(repr, wire.BACKENDS))}", field="pool.backend")
        if not self.fence_poll_ms > 0:
            raise InvalidArgument(f"pool.fence_poll_ms: must be positive, got "
                                  f"{self.fence_poll_ms}", field="pool.fence_poll_ms")
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

    #: Share full blocks between requests with the same prefix.
    enable_prefix_cache: bool = True
    #: Zero every reused block, whatever the tenants' policies say.
    scrub_always: bool = False
    #: When the pool is exhausted: "priority" preempts running sequences of strictly lower
    #: (tenant priority, request priority) to make room (docs/decisions.md, "Daemon-side
    #: preemption"); "off" only answers RESOURCE_EXHAUSTED and leaves preemption to workers.
    preemption: str = "priority"

    def __post_init__(self) -> None:
        if self.preemption not in ("priority", "off"):
            raise InvalidArgument(
                f"cache.preemption must be 'priority' or 'off', got {self.preemption!r}",
                field="cache.preemption")


@dataclass(frozen=True)
class LeaseConfig:
    """Session leases: a worker that stops calling is reaped."""

    default_ms: int = 10_000
    min_ms: int = 500
    max_ms: int = 300_000
    #: How often expired sessions are looked for.
    reap_interval_ms: int = 200


@dataclass(frozen=True)
class TenantsConfig:
    """Tenants and worker credentials."""

    #: YAML file of tenants and workers (reloaded on SIGHUP). "" = one tenant "default" that
    #: anonymous callers act for: a laptop default, refused unless ``allow_anonymous``.
    file: str = ""
    #: Accept calls without a credential as the "default" tenant (only without a tenants file).
    allow_anonymous: bool = True


@dataclass(frozen=True)
class EventsConfig:
    """Block events in vLLM's KV-events wire format over ZMQ (docs/kv_events.md)."""

    #: ZMQ PUB endpoint to bind, e.g. "tcp://*:5557" ("" disables publishing; a port of "*"
    #: picks a free one).
    zmq_endpoint: str = ""
    #: Connect the PUB socket to ``zmq_endpoint`` instead of binding it: for a consumer that
    #: binds and collects many publishers (llm-d's indexer on "tcp://*:5557").
    zmq_connect: bool = False
    #: ZMQ ROUTER endpoint that replays missed batches, e.g. "tcp://*:5558" ("" disables it).
    replay_endpoint: str = ""
    #: First frame of every message (llm-d's indexer expects "kv@<pod-id>@<model-name>").
    topic: str = "kv-events"
    #: Longest time an event waits for others to share its batch, milliseconds.
    batch_ms: float = 10.0
    #: Most events in one batch.
    max_batch: int = 512
    #: Batches kept for replay (the oldest are dropped first).
    replay_buffer: int = 10000
    #: ZMQ send high-water mark of the PUB socket: messages queued per slow subscriber before
    #: further ones are dropped for it (it sees a gap and replays).
    hwm: int = 100000
    #: Publish ``extra_keys`` (("blockd", namespace label, tenant label) per block). Off for
    #: consumers that read that field as something else (see docs/kv_events.md).
    extra_keys: bool = True


@dataclass(frozen=True)
class StateConfig:
    """Crash recovery: where the pool and the journal outlive the daemon process."""

    #: A private directory (created 0700) on a tmpfs, e.g. a Kubernetes emptyDir with
    #: ``medium: Memory``. The host pool, the fence pages, the snapshot and the journal live
    #: there, so a daemon restarted after a crash (even ``kill -9``) resumes with the same
    #: epoch, sequences and cached prefixes. Empty: no recovery (an anonymous pool; a restart
    #: starts a new epoch).
    dir: str = ""
    #: Journal bytes that trigger a snapshot (compaction); at least twice the last snapshot's
    #: size, so compaction costs O(1) per journalled byte.
    snapshot_min_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class LogConfig:
    #: DEBUG, INFO, WARNING or ERROR.
    level: str = "INFO"
    #: "kv" (key=value) or "json".
    format: str = "kv"


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in fields(Config)]


def _convert(value: Any, typ: Any, where: str) -> Any:
    if isinstance(typ, types.UnionType):  # pragma: no cover - no optional fields today
        typ = typing.get_args(typ)[0]
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if typ is int and isinstance(value, bool):
            raise ValueError("a boolean is not an integer")
        return typ(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{where}: {exc}", field=where) from None


def _merge(base: Config, overrides: Mapping[str, Mapping[str, Any]], source: str) -> Config:
    sections = {}
    for name, cls in _sections():
        section = getattr(base, name)
        given = overrides.get(name) or {}
        if not isinstance(given, Mapping):
            raise InvalidArgument(f"{source}: section {name!r} must be a mapping", field=name)
        hints = typing.get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        unknown = set(given) - known
        if unknown:
            raise InvalidArgument(f"{source}: unknown keys in {name}: {sorted(unknown)}",
                                  field=f"{name}.{sorted(unknown)[0]}")
        changes = {k: _convert(v, hints[k], f"{name}.{k}") for k, v in given.items()}
        sections[name] = dataclasses.replace(section, **changes)
    unknown_sections = set(overrides) - set(sections)
    if unknown_sections:
        raise InvalidArgument(f"{source}: unknown sections {sorted(unknown_sections)}",
                              field=sorted(unknown_sections)[0])
    return Config(**sections)


def from_env(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``BLOCKD_<SECTION>_<FIELD>`` variables as overrides. The only place env is read."""
    out: dict[str, dict[str, str]] = {}
    for name, cls in _sections():
        for f in fields(cls):
            key = f"{ENV_PREFIX}{name}_{f.name}".upper()
            if key in environ:
                out.setdefault(name, {})[f.name] = environ[key]
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field: ``--pool-num-blocks`` sets ``pool.num_blocks``."""
    parser.add_argument("--config", help="YAML configuration file")
    for name, cls in _sections():
        group = parser.add_argument_group(name, (cls.__doc__ or "").strip().splitlines()[0])
        for f in fields(cls):
            flag = f"--{name}-{f.name}".replace("_", "-")
            group.add_argument(flag, dest=f"cfg__{name}__{f.name}", default=None,
                               metavar=type(f.default).__name__.upper(),
                               help=f"(default: {f.default!r})")


def load(args: argparse.Namespace | None = None,
         environ: Mapping[str, str] | None = None) -> Config:
    """Defaults <- YAML file <- environment <- flags."""
    cfg = Config()
    path = getattr(args, "config", None) if args is not None else None
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"{path}: the top level must be a mapping", field="config")
        cfg = _merge(cfg, data, str(path))
    cfg = _merge(cfg, from_env(os.environ if environ is None else environ), "environment")
    if args is not None:
        flags: dict[str, dict[str, Any]] = {}
        for key, value in vars(args).items():
            if key.startswith("cfg__") and value is not None:
                _, section, name = key.split("__")
                flags.setdefault(section, {})[name] = value
        cfg = _merge(cfg, flags, "flags")
    return cfg
