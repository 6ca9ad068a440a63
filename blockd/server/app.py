"""Serve the daemon: gRPC on a Unix socket and TCP, health, reflection, metrics, signals.

The daemon's state is ``blockd.runtime``'s; this module wires it to the transports (gRPC, the
handle socket, the metrics HTTP endpoint, the ZMQ KV-event publisher) and runs the periodic
tasks (lease reaping, fence-page polling, the invariant checker) and the drain on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from blockd import wire
from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.config import Config
from blockd.core.errors import Internal
from blockd.pools.handles import HandleServer
from blockd.runtime import daemon as runtime
from blockd.runtime.kv_events import KvEventPublisher
from blockd.server.metrics import Metrics, serve_http
from blockd.server.servicer import BlockdServicer

log = logging.getLogger("blockd.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockdService"].full_name


async def _echo(request: bytes, context: object) -> bytes:
    return request


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def every(interval_ms: float, fn: Callable[[], object], what: str) -> None:
    """Call ``fn`` every ``interval_ms`` until cancelled; a failure is logged, never fatal."""
    while True:
        await asyncio.sleep(interval_ms / 1000)
        try:
            fn()
        except Exception:
            log.exception("%s failed", what)


def check_invariants(daemon: runtime.Daemon, metrics: Metrics) -> None:
    """One periodic invariant check: a violation (the core's ``Internal``, raised under
    ``python -O`` too) is counted and logged, and the daemon keeps serving."""
    metrics.invariant_checks += 1
    try:
        daemon.check_invariants()
    except Internal as exc:
        metrics.invariant_violations += 1
        log.error("invariant violated: %s", exc)


async def serve(cfg: Config, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT; SIGHUP reloads the tenants file."""
    publisher = None
    if cfg.events.zmq_endpoint:
        # Bound first, so a taken port fails the start before the pool exists.
        publisher = KvEventPublisher(cfg.events, block_size=cfg.pool.block_size,
                                     medium=wire.medium_of(cfg.pool.backend))
        publisher.start()
    try:
        daemon = runtime.start(cfg)
    except BaseException:
        if publisher is not None:
            publisher.stop()
        raise
    metrics = Metrics()
    metrics.bind(daemon)
    servicer = BlockdServicer(daemon, metrics)
    if publisher is not None:
        daemon.events.add_listener(publisher.submit)
    sc = cfg.server
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", sc.max_message_bytes),
        ("grpc.max_send_message_length", sc.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ])
    pb_grpc.add_BlockdServiceServicer_to_server(servicer, server)
    if sc.enable_echo:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "blockd.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)

    endpoints = {}
    if sc.unix_socket:
        path = Path(sc.unix_socket).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()  # a stale socket from an earlier run
        server.add_insecure_port(f"unix:{path}")
        endpoints["unix"] = str(path)
    if sc.tcp_address:
        host, port = _split(sc.tcp_address)
        bound = server.add_insecure_port(f"{host}:{port}")
        endpoints["tcp"] = f"{host}:{bound}"
    handles = None
    if sc.handle_socket:
        handles = HandleServer(sc.handle_socket, daemon.handle_for)
        handles.start()
        endpoints["handles"] = handles.path
    if publisher is not None:
        endpoints["kv_events"] = publisher.endpoint
        if publisher.replay_endpoint:
            endpoints["kv_replay"] = publisher.replay_endpoint
    metrics_server = None
    if cfg.metrics.address:
        host, port = _split(cfg.metrics.address)
        metrics_server = await serve_http(metrics, host, port)
        endpoints["metrics"] = f"{host}:{metrics_server.sockets[0].getsockname()[1]}"

    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("config %s", json.dumps(cfg.to_dict(), sort_keys=True))
    log.info("serving %s epoch=%d pool_bytes=%d pid=%d",
             " ".join(f"{k}={v}" for k, v in endpoints.items()), daemon.epoch,
             daemon.pool.size, os.getpid())
    # One machine-readable line for tests and supervisors that start us on port 0.
    print("BLOCKD_READY " + json.dumps(endpoints), flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    def reload() -> None:
        try:
            daemon.reload_tenants()
        except Exception as exc:  # keep serving with the old tenants on a bad file
            log.error("tenants reload failed, keeping the previous tenants: %s", exc)

    loop.add_signal_handler(signal.SIGHUP, reload)

    tasks = [asyncio.create_task(every(cfg.lease.reap_interval_ms, daemon.reap,
                                       "reaping expired sessions")),
             asyncio.create_task(every(cfg.pool.fence_poll_ms, daemon.poll_fences,
                                       "polling fence pages"))]
    if sc.invariant_check_interval_ms > 0:
        tasks.append(asyncio.create_task(every(sc.invariant_check_interval_ms,
                                               lambda: check_invariants(daemon, metrics),
                                               "checking invariants")))
    if ready is not None:
        ready.set()
    await stop.wait()

    # Drain: health goes NOT_SERVING and new sessions are refused (UNAVAILABLE), while attached
    # workers keep stepping until they detach or the grace period ends; then calls still in
    # flight get a last second and the server stops.
    log.info("draining grace_seconds=%.1f sessions=%d", sc.grace_seconds, len(daemon.sessions))
    daemon.draining = True
    await health_servicer.enter_graceful_shutdown()
    deadline = loop.time() + sc.grace_seconds
    while daemon.sessions and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(1.0)
    for task in tasks:
        task.cancel()
    if publisher is not None:
        daemon.events.remove_listener(publisher.submit)
        await asyncio.to_thread(publisher.stop)  # flushes the last batch; off the event loop
    if handles is not None:
        handles.close()
    if metrics_server is not None:
        metrics_server.close()
    daemon.close()
    if sc.unix_socket:
        Path(endpoints["unix"]).unlink(missing_ok=True)
    log.info("stopped")
