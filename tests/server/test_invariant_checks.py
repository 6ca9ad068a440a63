"""The daemon's invariant checks report the core's ``Internal`` error, also under ``python -O``.

Both checks run in one optimised process (asserts stripped) against a real gRPC server: the
check after every call (``server.check_invariants``) answers INTERNAL with the violation, and
the periodic checker (``server.invariant_check_interval_ms``) counts it and keeps serving. The
corruption is a test's own write into the manager's block arrays: nothing a client can cause.
"""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import asyncio
import tempfile

import grpc

from blockd import config
from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime import startup as runtime
from blockd.server import app
from blockd.server.metrics import Metrics
from blockd.server.servicer import BlockdServicer

assert False, "asserts are on"  # stripped by -O: proves the run is optimised


async def main() -> None:
    cfg = config.load(None, environ={
        "BLOCKD_SERVER_CHECK_INVARIANTS": "true", "BLOCKD_POOL_NUM_BLOCKS": "16",
        "BLOCKD_POOL_NUM_LAYERS": "1", "BLOCKD_POOL_HEAD_DIM": "8"})
    d = runtime.start(cfg)
    metrics = Metrics()
    metrics.bind(d)
    server = grpc.aio.server()
    pb_grpc.add_BlockdServiceServicer_to_server(BlockdServicer(d, metrics), server)
    target = "unix:" + tempfile.mkdtemp() + "/blockd.sock"
    server.add_insecure_port(target)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.BlockdServiceStub(ch)
            await stub.Stats(pb.StatsRequest())  # a sound state answers
            app.check_invariants(d, metrics)
            d.partitions.managers["shared"].blocks.usage[0] += 1
            try:
                await stub.Stats(pb.StatsRequest())
                print("rpc: OK")
            except grpc.aio.AioRpcError as err:
                print("rpc:", err.code().name, err.details())
            app.check_invariants(d, metrics)
            print("periodic:", metrics.invariant_checks, metrics.invariant_violations)
    finally:
        await server.stop(0)
        d.close()


asyncio.run(main())
"""


def test_invariant_violations_are_reported_under_python_dash_O() -> None:
    out = subprocess.run([sys.executable, "-O", "-c", PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rpc, periodic = out.stdout.splitlines()
    assert rpc.startswith("rpc: INTERNAL invariant violated"), out.stdout
    assert periodic == "periodic: 2 1", out.stdout
    assert "invariant violated" in out.stderr  # the periodic checker logged it
