#!/usr/bin/env python3
"""Container HEALTHCHECK for blockd: ask the standard gRPC health service (grpc.health.v1) over TCP.

Exit status 0 when the daemon answers SERVING, 1 otherwise (Docker's HEALTHCHECK convention).
A draining daemon (after SIGTERM) answers NOT_SERVING, so it turns unhealthy on purpose.

The target is ``--address HOST:PORT`` or else ``server.tcp_address`` from the daemon's own
configuration, resolved exactly as the daemon resolves it (``--config FILE`` plus the
``BLOCKD_<SECTION>_<FIELD>`` environment, via ``blockd.config.load``). A wildcard host
(``0.0.0.0``, ``::``, empty) is probed on loopback. TCP with TLS (``server.tls_cert``; blockd
refuses plaintext TCP off loopback) is probed on ``server.unix_socket`` instead, the local,
plaintext listener of the same server (the certificate need not name loopback).

Kubernetes ignores Docker HEALTHCHECKs: the manifests in deploy/k8s use the kubelet's native
``grpc:`` probes against the same service instead.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_CONFIG = "/etc/blockd/config/blockd.yaml"
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")


def probe_address(tcp_address: str) -> str:
    """The address to dial for a daemon listening on ``tcp_address`` (wildcards -> loopback)."""
    host, sep, port = tcp_address.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        raise ValueError(f"cannot probe {tcp_address!r}: need HOST:PORT with a fixed port")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"{host}:{port}"


def address_from_config(path: str | None) -> str:
    from blockd import config

    cfg = config.load(argparse.Namespace(config=path))
    if cfg.server.tls_cert and cfg.server.unix_socket:
        return f"unix:{cfg.server.unix_socket}"
    if not cfg.server.tcp_address:
        raise ValueError("server.tcp_address is empty: the daemon serves no TCP to probe")
    return probe_address(cfg.server.tcp_address)


def check(address: str, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    """(healthy, one line for the log)."""
    options = [("grpc.enable_http_proxy", 0)]  # never route a loopback probe through a proxy
    with grpc.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="HOST:PORT to probe (default: from the config)")
    parser.add_argument("--config", default=None,
                        help=f"the daemon's YAML config (default without --address: "
                             f"{DEFAULT_CONFIG})")
    parser.add_argument("--service", default="",
                        help='health service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    args = parser.parse_args(argv)
    try:
        address = (probe_address(args.address) if args.address
                   else address_from_config(args.config or DEFAULT_CONFIG))
    except Exception as exc:  # a bad config is an unhealthy container, with the reason logged
        print(f"blockd healthcheck: {exc}", file=sys.stderr)
        return 1
    healthy, line = check(address, args.service, args.timeout)
    print(f"blockd healthcheck: {line}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
