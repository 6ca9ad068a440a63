"""OpenTelemetry spans for each RPC (#28 finding 10), against real daemons and a real OTLP
receiver: opentelemetry-proto's own generated TraceService on a gRPC port of this process (and
a plain HTTP server for http/protobuf), fed by the daemon's OTLP exporter over loopback.

What is checked is what an operator's collector gets: one span per BlockdService call named as
its method, its gRPC status code, the caller's trace as its parent, and nothing secret (no
token, session id, fetch secret, token id, sequence id, header value or tenant unless asked
for). A receiver that is down or never answers costs no call anything (every call succeeds;
the spans are counted as failed or dropped, and each one is accounted for). With tracing off
the daemon loads nothing of tracing, even with OTEL_* variables set, and starts without
OpenTelemetry installed.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from cli_support import Served, clean_env, run_refused, write_config
from daemon_proc import TOKENS, Daemon, Worker, admit, append, md, start, varint
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

SERVICE = "/blockd.v1.BlockdService/"
#: Every attribute a span may carry out (blockd.server.span_export.ATTRIBUTES + the tenant).
ALLOWED = {"rpc.system", "rpc.service", "rpc.method", "rpc.grpc.status_code", "net.peer.ip",
           "net.peer.port", "net.peer.name", "blockd.tenant"}
#: Distinctive token ids: neither their varints nor their digits may appear in an export.
TOKEN_IDS = [987_654_321 + i for i in range(8)]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on a kernel-chosen loopback port. ``hold``: every Export
    waits for ``release`` (a receiver that takes the connection and never answers)."""

    def __init__(self, hold: bool = False) -> None:
        self.requests: list[bytes] = []
        self.metadata: list[dict[str, str]] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.server = grpc.server(ThreadPoolExecutor(4))
        otlp_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request: otlp.ExportTraceServiceRequest, context: Any
               ) -> otlp.ExportTraceServiceResponse:
        self.release.wait(30)
        self.metadata.append(dict(context.invocation_metadata()))
        self.requests.append(request.SerializeToString())
        return otlp.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[trace_pb2.ResourceSpans, trace_pb2.Span]]:
        return spans_of(self.requests)

    def stop(self) -> None:
        self.release.set()
        self.server.stop(0)


def spans_of(requests: list[bytes]) -> list[tuple[trace_pb2.ResourceSpans, trace_pb2.Span]]:
    out = []
    for raw in list(requests):
        for rs in otlp.ExportTraceServiceRequest.FromString(raw).resource_spans:
            for ss in rs.scope_spans:
                out.extend((rs, s) for s in ss.spans)
    return out


def attrs(span: trace_pb2.Span) -> dict[str, Any]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def wait_for(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def traced(tmp_path: Path, endpoint: str, **tracing: Any) -> Daemon:
    return start(tmp_path, extra={"tracing": {"otlp_endpoint": endpoint, "insecure": True,
                                              "schedule_delay_ms": 50, **tracing}})


def by_method(spans: list[tuple[Any, trace_pb2.Span]]) -> dict[str, list[trace_pb2.Span]]:
    out: dict[str, list[trace_pb2.Span]] = {}
    for _, s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def calls(d: Daemon) -> dict[str, Any]:
    """Attach, an admitting Step (with a caller's traceparent), a StepStream of 3 appends, a
    Step of an unknown session (NOT_FOUND), a Heartbeat, a Detach, and a health check; what a
    span must not carry."""
    w = Worker(d.stub(), "alice", "acme")
    parent = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
    r = w.stub.Step(pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1,
                                   operations=[admit(TOKEN_IDS)]), metadata=md("alice") + parent)
    seq = r.results[0].admit.sequence_id
    assert seq
    stream = [pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=10 + i, fence=10 + i,
                             operations=[append(seq, [TOKEN_IDS[i]])]) for i in range(3)]
    out = list(w.stub.StepStream(iter(stream), metadata=md("alice")))
    assert [o.results[0].append.num_tokens for o in out] == [9, 10, 11]
    bogus = "s-" + "ab" * 16
    with pytest.raises(grpc.RpcError) as err:
        w.stub.Step(pb.StepRequest(session_id=bogus, epoch=w.epoch, step_id=2),
                    metadata=md("alice"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch), metadata=md("alice"))
    w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md("alice"))
    health = health_pb2_grpc.HealthStub(d.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == 1
    return {"secrets": [TOKENS["alice"], w.sid, w.att.fetch_secret, seq, bogus,
                        *map(str, TOKEN_IDS)],
            "token_varints": [varint(t) for t in TOKEN_IDS]}


def check_no_secrets(raw: bytes, made: dict[str, Any], also: tuple[str, ...] = ()) -> None:
    for secret in [*made["secrets"], *also]:
        assert secret.encode() not in raw, secret
    for v in made["token_varints"]:
        assert v not in raw


def test_spans_of_each_rpc_arrive_named_with_status_and_parent_and_nothing_secret(
        tmp_path: Path, receiver: Receiver) -> None:
    headers = tmp_path / "otlp-headers"
    headers.write_text("# the backend's key\nX-Backend-Key: hdr-s3cret\n")
    with traced(tmp_path / "d", receiver.endpoint, headers_file=str(headers),
                service_name="blockd-test") as d:
        made = calls(d)
        # 6 calls of BlockdService: Attach, two Steps, a StepStream, Heartbeat, Detach (the
        # health check makes none); all exported, and counted so.
        wait_for(lambda: len(receiver.spans()) == 6
                 and d.metric("blockd_trace_spans_exported_total") == 6)
    want = {"Attach", "Step", "StepStream", "Heartbeat", "Detach"}
    spans = receiver.spans()
    methods = by_method(spans)
    assert set(methods) == {SERVICE + m for m in want}  # nothing of Health or reflection
    assert [attrs(s)["rpc.grpc.status_code"] for s in methods[SERVICE + "Attach"]] == [0]
    steps = methods[SERVICE + "Step"]
    assert sorted(attrs(s)["rpc.grpc.status_code"] for s in steps) == [0, 5]  # OK, NOT_FOUND
    assert [attrs(s)["rpc.grpc.status_code"] for s in methods[SERVICE + "StepStream"]] == [0]
    for _, s in spans:
        a = attrs(s)
        assert set(a) <= ALLOWED - {"blockd.tenant"}, a  # no tenant unless asked for
        assert a["rpc.service"] == "blockd.v1.BlockdService"
        assert a["rpc.method"] == s.name.removeprefix(SERVICE)
        assert s.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert not s.events and not s.links and not s.status.message
    # The Step that carried a traceparent is a child of the caller's span, in its trace.
    child = [s for s in steps if s.trace_id.hex() == TRACE_ID]
    assert len(child) == 1 and child[0].parent_span_id.hex() == PARENT_ID
    assert attrs(child[0])["rpc.grpc.status_code"] == 0
    resource = {a.key: a.value.string_value for a in spans[0][0].resource.attributes}
    assert resource["service.name"] == "blockd-test"
    # The headers file's header reached the receiver, and went nowhere else.
    assert all(m.get("x-backend-key") == "hdr-s3cret" for m in receiver.metadata)
    for raw in receiver.requests:
        check_no_secrets(raw, made, also=("hdr-s3cret", "acme"))


def test_the_tenant_is_on_a_span_only_with_tenant_attribute(tmp_path: Path,
                                                            receiver: Receiver) -> None:
    with traced(tmp_path, receiver.endpoint, tenant_attribute=True) as d:
        made = calls(d)
        wait_for(lambda: SERVICE + "Detach" in by_method(receiver.spans()))
    methods = by_method(receiver.spans())
    tenant = {m.removeprefix(SERVICE): {attrs(s).get("blockd.tenant") for s in spans}
              for m, spans in methods.items()}
    # Attach and Step take a turn in the tenant's queue (the unknown session's Step queues
    # under its caller's own key, no tenant); Heartbeat and Detach take none.
    assert tenant == {"Attach": {"acme"}, "Step": {"acme", None}, "StepStream": {"acme"},
                      "Heartbeat": {None}, "Detach": {None}}
    for raw in receiver.requests:
        check_no_secrets(raw, made)


def test_http_protobuf_exporter(tmp_path: Path) -> None:
    got: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces" and self.headers["Content-Type"] == \
                    "application/x-protobuf":
                got.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(otlp.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces"
        with start(tmp_path, extra={"tracing": {"otlp_endpoint": url, "protocol": "http/protobuf",
                                                "schedule_delay_ms": 50}}) as d:
            made = calls(d)
            wait_for(lambda: SERVICE + "Detach" in by_method(spans_of(got)))
    finally:
        httpd.shutdown()
    assert {s.name for _, s in spans_of(got)} >= {SERVICE + "Attach", SERVICE + "Step"}
    for raw in got:
        check_no_secrets(raw, made, also=("acme",))


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()  # nothing listens there
    return port


@pytest.mark.parametrize("receiver_state", ["down", "never_answers"])
def test_a_receiver_down_or_stuck_costs_no_call_and_every_span_is_accounted_for(
        tmp_path: Path, receiver_state: str) -> None:
    stuck = Receiver(hold=True) if receiver_state == "never_answers" else None
    endpoint = stuck.endpoint if stuck else f"127.0.0.1:{_dead_port()}"
    try:
        with traced(tmp_path, endpoint, max_queue_spans=8, max_batch_spans=4,
                    export_timeout_s=1.0) as d:
            w = Worker(d.stub(), "alice", "acme")
            n = 300
            for _ in range(n):  # every call answered, each within an ordinary deadline
                w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch),
                                 metadata=md("alice"), timeout=10)
            r = w.step(admit(TOKEN_IDS), fence=0)
            assert r.results[0].status.code == 0
            calls_made = n + 2  # the Attach, the Heartbeats, the Step

            def settled() -> dict[str, float] | None:
                m = {k: d.metric(f"blockd_trace_spans_{k}_total")
                     for k in ("exported", "dropped", "failed")}
                m["queued"] = d.metric("blockd_trace_spans_queued")
                total = m["exported"] + m["dropped"] + m["failed"] + m["queued"]
                return m if total == calls_made else None

            m = wait_for(settled)
            assert m["exported"] == 0 and m["dropped"] > 0 and m["failed"] > 0, m
            assert d.metric("blockd_trace_export_failures_total") > 0
            assert "span export failed" in d.log_text()
            # The daemon still answers, and stops cleanly (its last export bounded).
            assert w.stats().num_sessions == 1
            assert d.stop() == 0
    finally:
        if stuck:
            stuck.stop()


#: What tracing itself would load: none of it with tracing off.
TRACING_MODULES = ("opentelemetry.instrumentation", "opentelemetry.exporter",
                   "opentelemetry.sdk.trace", "opentelemetry.propagate",
                   "blockd.server.span_export")


def _imports(stderr: str) -> list[tuple[int, str]]:
    """(depth, module) of every ``python -X importtime`` (``PYTHONPROFILEIMPORTTIME``) line,
    in its order: a module's lines come after those of the modules it imported."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and "imported package" not in line:
            name = line.rsplit("|", 1)[-1]
            out.append((len(name) - len(name.lstrip()), name.strip()))
    return out


def test_tracing_off_imports_nothing_of_tracing_and_sends_nothing(
        tmp_path: Path, receiver: Receiver) -> None:
    # OpenTelemetry's own variables do not turn it on: only tracing.otlp_endpoint does.
    env = clean_env(PYTHONPROFILEIMPORTTIME="1", OTEL_EXPORTER_OTLP_ENDPOINT=
                    f"http://{receiver.endpoint}", OTEL_TRACES_EXPORTER="otlp")
    off = write_config(tmp_path / "off")
    with Served("--config", str(off), cwd=tmp_path, env=env) as s:
        ch = grpc.insecure_channel(f"unix:{s.endpoints['unix']}")
        pb_grpc.BlockdServiceStub(ch).Stats(pb.StatsRequest())
        ch.close()
        assert s.stop() == 0
        entries = _imports(s.stderr())
    names = [m for _, m in entries]
    assert "blockd.server.app" in names  # the method sees the daemon's own imports
    assert not [m for m in names if m.startswith(TRACING_MODULES)]
    # Nothing of OpenTelemetry at all, nor redis-py (which loads OpenTelemetry's API and
    # metrics SDK at import): a daemon without a remote tier does not import it
    # (blockd.tiers.remote_jobs).
    assert not [m for m in names if m.startswith(("opentelemetry", "redis"))]
    # The same daemon with tracing on imports it (so the check above can fail).
    on = write_config(tmp_path / "on", tracing={"otlp_endpoint": receiver.endpoint,
                                                "insecure": True})
    with Served("--config", str(on), cwd=tmp_path, env=env) as s:
        assert s.stop() == 0
        names = [m for _, m in _imports(s.stderr())]
    assert {"opentelemetry.instrumentation.grpc", "blockd.server.span_export"} <= set(names)
    time.sleep(0.5)
    assert receiver.requests == []  # nothing was sent with tracing off, nor traced with it on


BLOCKER = '''
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
'''


def test_tracing_on_without_the_packages_is_refused_naming_the_key_and_package(
        tmp_path: Path) -> None:
    """The daemon-only install (``make serve``): no OpenTelemetry at all, as if never
    installed (a meta-path finder in sitecustomize refuses every opentelemetry module)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    probe = subprocess.run([sys.executable, "-c", "import opentelemetry"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'opentelemetry'" in probe.stderr
    cfg = write_config(tmp_path / "d", tracing={"otlp_endpoint": "127.0.0.1:4317"})
    out = run_refused("--config", str(cfg), cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in ("cannot start", "tracing.otlp_endpoint", "opentelemetry-api",
                   "blockd[tracing]"):
        assert needle in lines[0], (needle, lines[0])
    assert not list((tmp_path / "d").glob("*.sock"))  # refused before anything was bound
    # Tracing off, the same environment starts and serves.
    with Served("--config", str(write_config(tmp_path / "off")), cwd=tmp_path, env=env) as s:
        assert s.stop() == 0


@pytest.mark.parametrize("key, value, says", [
    ("protocol", "thrift", "must be one of grpc, http/protobuf"),
    ("sampling_ratio", "1.5", "must be in 0..1"),
    ("otlp_endpoint", "collector", "expected HOST:PORT"),
    ("otlp_endpoint", "ftp://collector:21", "expected http://HOST:PORT"),
    ("max_queue_spans", "0", "must be positive"),
    ("client_key", "/k.pem", "needed with tracing.client_key"),
])
def test_a_bad_tracing_value_is_refused_naming_its_key(tmp_path: Path, key: str, value: str,
                                                       says: str) -> None:
    cfg = write_config(tmp_path, tracing={"otlp_endpoint": "127.0.0.1:4317"})
    out = run_refused("--config", str(cfg), f"--tracing-{key.replace('_', '-')}", value,
                      cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and "tracing." in line and says in line, line


def test_an_unreadable_or_malformed_headers_file_is_refused_without_its_content(
        tmp_path: Path) -> None:
    bad = tmp_path / "headers"
    bad.write_text("x-key: fine\nno colon hdr-s3cret\n")
    for path, says in ((tmp_path / "missing", "No such file"), (bad, "line 2")):
        cfg = write_config(tmp_path / "d", tracing={"otlp_endpoint": "127.0.0.1:4317",
                                                    "insecure": True,
                                                    "headers_file": str(path)})
        out = run_refused("--config", str(cfg), cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        assert "tracing.headers_file" in out.stderr and says in out.stderr, out.stderr
        assert "hdr-s3cret" not in out.stderr


def test_metrics_listener_shows_no_trace_series_with_tracing_off(tmp_path: Path) -> None:
    with start(tmp_path) as d:
        body = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
    assert "blockd_trace_" not in body
