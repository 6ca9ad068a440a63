"""Serve the daemon: gRPC on a Unix socket and TCP, health, reflection, metrics, signals.

The daemon's state is ``blockd.runtime``'s; this module wires it to the transports (gRPC, the
handle socket, the metrics HTTP endpoint, the ZMQ KV-event publisher) and runs the periodic
tasks (lease reaping, fence-page polling, the invariant checker) and the drain on SIGTERM.

A start claims what fails cheaply first (the Unix socket paths' locks, the TCP ports:
``blockd.server.endpoints``), then binds the ZMQ publisher, builds the pool and opens the
listeners. Everything taken is registered on one exit stack, so a failed start gives it all
back in reverse order (no socket or lock file is left behind, and no live daemon's is touched)
and raises the ``BlockdError`` naming the field, which the entry point prints in one line. A
stop releases the same stack after the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from blockd import logs, wire
from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import Config, ServerConfig
from blockd.core.errors import FailedPrecondition, Internal
from blockd.pools.handles import HandleServer
from blockd.runtime import fds
from blockd.runtime import startup as runtime
from blockd.runtime.daemon import Daemon
from blockd.runtime.kv_events import KvEventPublisher
from blockd.runtime.refusal_holds import RefusalHolds
from blockd.server import metrics_http, reflection, tracing
from blockd.server.endpoints import (
    SocketClaim,
    check_port,
    is_loopback,
    require_tls_off_loopback,
    set_socket_mode,
    split_address,
    tls_credentials,
)
from blockd.server.metrics import Metrics
from blockd.server.servicer import BlockdServicer, add_to_server

log = logging.getLogger("blockd.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockdService"].full_name


async def _echo(request: bytes, context: object) -> bytes:
    return request


async def every(interval_ms: float, fn: Callable[[], object], what: str) -> None:
    """Call ``fn`` every ``interval_ms`` until cancelled; a failure is logged, never fatal."""
    while True:
        await asyncio.sleep(interval_ms / 1000)
        try:
            fn()
        except Exception:
            log.exception("periodic task failed", extra=logs.fields(task=what))


async def poll_fences(interval_ms: float, max_ms: float, daemon: Daemon) -> None:
    """Read the sessions' fence pages while a fence is announced and not completed: every
    ``interval_ms`` after a completion, then backing off (doubling, up to ``max_ms``, which
    the config keeps >= ``interval_ms``) while none completes, as a step's copies run for a
    while and a worker publishes once per step: a fixed short interval wakes the daemon
    hundreds of times a second for nothing while an engine runs. With none pending, sleep
    until a Step announces one (``Daemon.on_fence``), so an idle daemon does not wake at
    all. A Step runs on this loop, between two awaits, so none can announce a fence between
    the last poll and the wait."""
    wake = asyncio.Event()
    daemon.on_fence = wake.set
    delay = interval_ms
    while True:
        await asyncio.sleep(delay / 1000)
        before = daemon.sessions.fences_completed
        try:
            pending = daemon.poll_fences()
        except Exception:
            log.exception("periodic task failed", extra=logs.fields(task="polling fence pages"))
            continue
        if not pending:
            wake.clear()
            await wake.wait()
            delay = interval_ms
        elif daemon.sessions.fences_completed != before:
            delay = interval_ms
        else:
            delay = min(delay * 2, max_ms)


def check_invariants(daemon: Daemon, metrics: Metrics) -> None:
    """One periodic invariant check: a violation (the core's ``Internal``, raised under
    ``python -O`` too) is counted and logged, and the daemon keeps serving."""
    metrics.invariant_checks += 1
    try:
        daemon.check_invariants()
    except Internal as exc:
        metrics.invariant_violations += 1
        log.error("invariant violated", extra=logs.fields(error=exc.message))


def _grpc_server(sc: ServerConfig, servicer: BlockdServicer, connections: int,
                 traced: tracing.Tracing | None = None
                 ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """``connections``: the most gRPC connections open at once (``fds.grpc_connections``):
    beyond, gRPC closes a new one at accept, so no flood of them exhausts the descriptors.
    ``traced``: its interceptor makes a span of every BlockdService call (``tracing.*``)."""
    server = grpc.aio.server(interceptors=traced.interceptors if traced else None, options=[
        ("grpc.max_receive_message_length", sc.max_message_bytes),
        ("grpc.max_send_message_length", sc.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", connections),
    ])
    add_to_server(servicer, server)  # Step, StepStream, Lookup: parsed in their turn
    if sc.enable_echo:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "blockd.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(  # grpc.reflection.v1 and v1alpha
        server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    return server, health_servicer


async def _watch_handles(metrics: Metrics, health_servicer: Any) -> None:
    """gRPC health NOT_SERVING (and /healthz 503) once the handle server's thread stops."""
    while metrics.handles is None or metrics.handles.alive:
        await asyncio.sleep(0.5)
    if metrics.handles.closing:
        return
    log.error("the handle socket stopped: health is NOT_SERVING")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def _listen(server: grpc.aio.Server, target: str, field: str,
            creds: grpc.ServerCredentials | None = None) -> int:
    """``add_insecure_port`` (``add_secure_port`` with ``creds``), with gRPC's RuntimeError (a
    port taken since the check) as the one-line refusal of the field."""
    try:
        if creds is not None:
            return server.add_secure_port(target, creds)
        return server.add_insecure_port(target)
    except RuntimeError:
        raise FailedPrecondition(f"{field}: cannot listen on {target} (in use, or not an "
                                 "address of this host)", field=field) from None


def _start_runtime(cfg: Config) -> Daemon:
    """``runtime.start``, with a file the configuration names that cannot be used (a missing
    tenants file, a state directory on a full disk) refused on its field."""
    try:
        return runtime.start(cfg)
    except OSError as exc:
        name = str(exc.filename or "")
        field = ("tenants.file" if cfg.tenants.file and name == cfg.tenants.file else
                 "state.dir" if cfg.state.dir and name.startswith(cfg.state.dir) else "pool")
        raise FailedPrecondition(f"{field}: {name + ': ' if name else ''}"
                                 f"{exc.strerror or exc}", field=field) from None


def _warn_open_metrics(cfg: Config) -> None:
    """An unauthenticated metrics listener off loopback is allowed (Prometheus in the cluster
    scrapes the Pod IP) but said at start: anyone who reaches it reads the pool's figures."""
    mc = cfg.metrics
    host, _ = split_address(mc.address)
    if mc.authenticated or is_loopback(host):
        return
    log.warning("metrics listener off loopback without authentication: anyone who reaches it "
                "reads the pool's figures%s; set metrics.bearer_token_file or "
                "metrics.tls_client_ca, or restrict it with a NetworkPolicy",
                " and every tenant's" if mc.tenant_labels else "",
                extra=logs.fields(address=mc.address))


async def serve(cfg: Config, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT; SIGHUP reloads the tenants file and the metrics
    listener's token and TLS files."""
    sc = cfg.server
    sys.setswitchinterval(sc.gil_switch_interval_ms / 1000)  # config.ServerConfig says why
    async with contextlib.AsyncExitStack() as stack:
        for path, field in ((sc.unix_socket, "server.unix_socket"),
                            (sc.handle_socket, "server.handle_socket")):
            if path:
                claim = SocketClaim(path, field)
                claim.acquire()
                stack.callback(claim.release)
        tls = tls_credentials(sc)  # unreadable files: refused before anything is bound
        traced = tracing.start(cfg.tracing)  # None when off; a missing package: refused here
        if traced is not None:
            stack.push_async_callback(traced.close)  # after the server's stop: its last spans
        if sc.tcp_address:
            require_tls_off_loopback(sc.tcp_address, tls is not None)
            check_port(sc.tcp_address, "server.tcp_address")
        if cfg.metrics.address:
            check_port(cfg.metrics.address, "metrics.address")
            scrape_keys = metrics_http.Keyring(cfg.metrics)  # unreadable files: refused here
            _warn_open_metrics(cfg)
        publisher = None
        if cfg.events.zmq_endpoint:
            # Bound before the pool exists, so a taken port fails the start cheaply.
            publisher = KvEventPublisher(cfg.events, block_size=cfg.pool.block_size,
                                         medium=wire.medium_of(cfg.pool.backend))
            publisher.start()
            # On the way out: flushes the last batch; off the event loop.
            stack.push_async_callback(asyncio.to_thread, publisher.stop)
        daemon = _start_runtime(cfg)
        stack.callback(daemon.close)
        metrics = Metrics(cfg.metrics)
        metrics.bind(daemon, events=publisher)
        if traced is not None:
            metrics.registry.register(traced.collector())
        servicer = BlockdServicer(daemon, metrics, gate=traced.gate if traced else None,
                                  holds=RefusalHolds(cfg.tenants.rate_refusal_hold_ms))
        if publisher is not None:
            daemon.events.add_listener(publisher.submit)
            stack.callback(daemon.events.remove_listener, publisher.submit)
        tasks: list[asyncio.Task[None]] = []
        stack.callback(lambda: [t.cancel() for t in tasks])  # after the server's last second
        server, health_servicer = _grpc_server(
            sc, servicer, fds.grpc_connections(cfg, daemon.tenants.tenants), traced)
        stack.push_async_callback(server.stop, 1.0)

        endpoints = {}
        if sc.unix_socket:
            _listen(server, f"unix:{sc.unix_socket}", "server.unix_socket")
            set_socket_mode(sc.unix_socket, sc.socket_mode, "server.unix_socket")
            endpoints["unix"] = sc.unix_socket
        if sc.tcp_address:
            host, port = split_address(sc.tcp_address)
            bound = _listen(server, f"{host}:{port}", "server.tcp_address", tls)
            endpoints["tcp"] = f"{host}:{bound}"
            if tls is not None:
                endpoints["tls"] = "mtls" if sc.tls_client_ca else "tls"
        if sc.handle_socket:
            handles = HandleServer(sc.handle_socket, daemon.handles.lookup,
                                   daemon.handles.secrets,
                                   mode=int(sc.socket_mode, 8),
                                   max_connections=sc.handle_connections,
                                   timeout=sc.handle_timeout_s,
                                   allowed_uids=cfg.handles.uids(),
                                   allowed_gids=cfg.handles.gids())
            metrics.handles = handles  # /healthz: 503 if its thread ever stops
            stack.callback(handles.close)
            handles.start()
            endpoints["handles"] = handles.path
        if publisher is not None:
            endpoints["kv_events"] = publisher.endpoint
            if publisher.replay_endpoint:
                endpoints["kv_replay"] = publisher.replay_endpoint
        await server.start()
        # After gRPC: /healthz answering means gRPC serves (the Kubernetes probes ask it).
        if cfg.metrics.address:
            host, port = split_address(cfg.metrics.address)
            try:
                metrics_server = await metrics_http.serve_http(metrics, host, port, cfg.metrics,
                                                               scrape_keys)
            except OSError as exc:
                raise FailedPrecondition(f"metrics.address: cannot listen on "
                                         f"{cfg.metrics.address}: {exc.strerror}",
                                         field="metrics.address") from None
            stack.callback(metrics_server.close)
            endpoints["metrics"] = f"{host}:{metrics_server.sockets[0].getsockname()[1]}"
            if cfg.metrics.tls_cert:
                endpoints["metrics_tls"] = "mtls" if cfg.metrics.tls_client_ca else "tls"

        # Before anything says "ready": a supervisor that stops us right after it reads
        # BLOCKD_READY (or health SERVING) must find the handlers, not the default action.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)

        def reload() -> None:
            try:
                daemon.reload_tenants()
            except Exception as exc:  # keep serving with the old tenants on a bad file
                log.error("tenants reload failed, keeping the previous tenants",
                          extra=logs.fields(error=str(exc)))
            if cfg.metrics.address:
                try:
                    scrape_keys.reload()
                except Exception as exc:  # a bad rotation keeps the previous credentials
                    log.error("metrics credentials reload failed, keeping the previous ones",
                              extra=logs.fields(error=str(exc)))
                else:
                    log.info("metrics credentials reloaded")

        loop.add_signal_handler(signal.SIGHUP, reload)

        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("configuration", extra=logs.fields(**{
            f"{section}.{name}": value for section, values in cfg.to_dict().items()
            for name, value in values.items()}))
        log.info("serving", extra=logs.fields(**endpoints, epoch=daemon.epoch,
                                              pool_bytes=sum(p.size for p in daemon.pools.values()),
                                              partitions=len(daemon.pools), pid=os.getpid(),
                                              **daemon.fds.fields()))
        # One machine-readable line for tests and supervisors that start us on port 0.
        print("BLOCKD_READY " + json.dumps(endpoints), flush=True)

        tasks += [asyncio.create_task(every(cfg.lease.reap_interval_ms, daemon.reap,
                                            "reaping expired sessions")),
                  asyncio.create_task(poll_fences(cfg.pool.fence_poll_ms,
                                                    cfg.pool.fence_poll_max_ms, daemon))]
        if sc.invariant_check_interval_ms > 0:
            tasks.append(asyncio.create_task(every(sc.invariant_check_interval_ms,
                                                   lambda: check_invariants(daemon, metrics),
                                                   "checking invariants")))
        if sc.handle_socket:
            tasks.append(asyncio.create_task(_watch_handles(metrics, health_servicer)))
        if ready is not None:
            ready.set()
        await stop.wait()

        # Drain: health goes NOT_SERVING and new sessions are refused (UNAVAILABLE), while
        # attached workers keep stepping until they detach or the grace period ends; then
        # calls still in flight get a last second (the stack: server.stop(1.0)), and
        # everything else is released in reverse order.
        log.info("draining", extra=logs.fields(grace_seconds=sc.grace_seconds,
                                               sessions=len(daemon.sessions)))
        daemon.start_draining()
        await health_servicer.enter_graceful_shutdown()
        deadline = loop.time() + sc.grace_seconds
        while daemon.sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)
        streams = servicer.end_streams()  # each answers UNAVAILABLE, before the server stops
        if streams:
            log.warning("the drain's grace ended with streams open: ended them",
                        extra=logs.fields(streams=streams, sessions=len(daemon.sessions)))
            await asyncio.sleep(0.05)
    log.info("stopped")
