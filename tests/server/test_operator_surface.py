"""What an operator's tools find on a real daemon (#28, the operator path): reflection under
grpc.reflection.v1 (grpcurl asks it first; only v1alpha was served, so ``grpcurl describe
blockd.v1.BlockdService.Stats`` failed), every ``blockd_operation_errors_total`` series from the
first scrape (zeros: no empty panel until the first error), and a status page at ``GET /`` of
the metrics listener instead of a 404."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import grpc
from daemon_proc import Daemon, Worker, admit, md
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as alpha

from blockd.api.v1 import blockd_pb2 as pb

V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


def reflect(channel: grpc.Channel, method: str, *requests: alpha.ServerReflectionRequest
            ) -> list[alpha.ServerReflectionResponse]:
    """A raw reflection stream on ``method`` (v1 and v1alpha share their messages' bytes)."""
    call = channel.stream_stream(method, request_serializer=alpha.ServerReflectionRequest
                                 .SerializeToString,
                                 response_deserializer=alpha.ServerReflectionResponse.FromString)
    return list(call(iter(requests), timeout=10))


def test_reflection_v1_describes_the_service_as_grpcurl_asks(daemon: Daemon) -> None:
    channel = daemon.channel("tcp")
    for method in (V1, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        listed, found = reflect(channel, method,
                                alpha.ServerReflectionRequest(list_services=""),
                                alpha.ServerReflectionRequest(
                                    file_containing_symbol="blockd.v1.BlockdService.Stats"))
        names = {s.name for s in listed.list_services_response.service}
        assert {"blockd.v1.BlockdService", "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names, method
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in found.file_descriptor_response.file_descriptor_proto]
        service = next(s for f in files if f.package == "blockd.v1" for s in f.service
                       if s.name == "BlockdService")
        stats = next(m for m in service.method if m.name == "Stats")
        assert stats.input_type == ".blockd.v1.StatsRequest", method
    # The v1 service describes itself too (grpcurl describe grpc.reflection.v1.ServerReflection).
    (own,) = reflect(channel, V1, alpha.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    (proto,) = own.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(proto).package == "grpc.reflection.v1"
    grpcurl = shutil.which("grpcurl")
    if grpcurl:  # the real tool, where it is installed
        out = subprocess.run([grpcurl, "-plaintext", daemon.endpoints["tcp"], "describe",
                              "blockd.v1.BlockdService.Stats"], capture_output=True, text=True,
                             timeout=30, check=False)
        assert out.returncode == 0 and "rpc Stats" in out.stdout, out.stderr


def scrape(daemon: Daemon, path: str = "/metrics") -> tuple[int, str, str]:
    url = daemon.metrics_url.removesuffix("/metrics") + path
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


def error_series(body: str) -> dict[str, float]:
    return {line.split('"')[1]: float(line.split()[-1]) for line in body.splitlines()
            if line.startswith("blockd_operation_errors_total{")}


def test_operation_errors_have_every_series_from_the_first_scrape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from daemon_proc import start

    with start(tmp_path / "d") as d:
        first = error_series(scrape(d)[2])
        assert first and set(first.values()) == {0.0}
        assert {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND",
                "FAILED_PRECONDITION", "INTERNAL"} <= set(first)
        assert "OK" not in first
        w = Worker(d.stub(), "alice", "acme")
        out = w.step(admit([1] * 400))  # over acme's 40-block quota: the operation fails
        assert out.results[0].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        after = error_series(scrape(d)[2])
        assert set(after) == set(first)
        assert after["RESOURCE_EXHAUSTED"] == 1.0
        assert w.stub.Stats(pb.StatsRequest(), metadata=md("alice"))


def test_the_metrics_listener_root_is_a_status_page(daemon: Daemon) -> None:
    status, ctype, body = scrape(daemon, "/")
    assert status == 200 and ctype.startswith("text/plain")
    assert body.startswith("blockd ") and "/metrics" in body and "/healthz" in body
    assert "health: 200 OK" in body
    assert "acme" not in body  # unauthenticated: no tenant is named
    try:
        scrape(daemon, "/nothing-here")
        raise AssertionError("an unknown path answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
