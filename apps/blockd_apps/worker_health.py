"""``python -m blockd_apps.worker_health ready|live``: the worker container's probes.

A worker (an engine built on ``blockd_client``) in the inference Pod depends on blockd through
the Unix socket on the Pod's shared emptyDir and on its token file; and blockd knows whether the
worker is alive: a worker that stops calling (wedged, deadlocked) stops renewing its lease and
loses its session. With one blockd per Pod (the sidecar), blockd's sessions are this worker's.

- ``ready`` (readinessProbe and startupProbe): exit 0 when the token file holds a token, blockd
  answers SERVING for ``blockd.v1.BlockdService`` on the worker's own target (so it is not
  draining), accepts the token and has at least one attached session. Not ready while blockd
  restarts or drains, when the credential is missing or refused, before the engine attached.
- ``live`` (livenessProbe): exit 1 only when blockd answers and holds no session: the worker
  is not renewing its lease. Everything on blockd's side (unreachable, restarting, the token
  refused) passes: restarting the worker would not fix it, would lose its in-flight requests,
  and the readiness probe already reports it.

Why exec, not the kubelet's ``grpc:`` probe: on the worker container that would dial the Pod
IP's TCP port, blockd's own listener, repeating blockd's probe and saying nothing about the
worker or its path to blockd. One line of output says why (the kubelet keeps it in the Pod's
events); no torch, no engine import: ~0.2 s of CPU per probe.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blockd import options
from blockd_client import BlockdError, Client
from blockd_client.retry import TOKEN_FILE_ENV

#: blockd's health entry that goes NOT_SERVING when it drains (blockd.server.app.SERVICE_NAME;
#: spelled out here because applications do not import the server).
SERVICE = "blockd.v1.BlockdService"
TARGET_ENV = "BLOCKD_TARGET"


def probe(kind: str, target: str, token_file: str | None, timeout: float) -> tuple[bool, str]:
    """(healthy, one line). ``kind`` is ``ready`` or ``live`` (see the module docstring)."""
    live = kind == "live"
    try:
        client = Client(target, token_file=token_file, timeout=timeout, retries=0,
                        reconnect_s=0.0)
    except ValueError as exc:  # the token file: missing, empty, malformed
        return live, f"{exc}" + ("; not blockd's or the worker's loop: passing" if live else "")
    with client:
        if not live:
            try:
                reply = health_pb2_grpc.HealthStub(client.channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
            except grpc.RpcError as exc:
                return False, f"{target}: health {exc.code().name}: {exc.details()}"
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                return False, f"{target}: {SERVICE} is {name} (draining or starting)"
        try:
            stats = client.stats()
        except BlockdError as exc:
            if live:
                return True, f"{target}: {exc} (blockd's side, not the worker's: passing)"
            return False, f"{target}: {exc}"
    if stats.num_sessions == 0:
        return False, (f"{target}: blockd holds no session: the worker has not attached or "
                       f"stopped renewing its lease")
    return True, f"{target}: {stats.num_sessions} session(s) attached (epoch {stats.epoch})"


def parser() -> argparse.ArgumentParser:
    """The command line (tests parse the manifests' probe commands with it)."""
    p = options.Parser(prog="python -m blockd_apps.worker_health",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("kind", choices=("ready", "live"),
                   help="ready: the worker can serve; live: the worker is renewing its lease")
    p.add_argument("--target", default=os.environ.get(TARGET_ENV, ""),
                   help=f"blockd as the worker reaches it, unix:PATH (default: ${TARGET_ENV})")
    p.add_argument("--token-file", default=None,
                   help=f"the worker's token file (default: ${TOKEN_FILE_ENV}; none: anonymous)")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="seconds per call (default 3; keep below the probe's timeoutSeconds)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.target:
        p.error(f"--target or ${TARGET_ENV} is required")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    healthy, line = probe(args.kind, args.target, args.token_file, args.timeout)
    print(f"worker {args.kind}: {line}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
