"""Start a real blockd daemon in a subprocess and talk to it over its real sockets.

``start`` goes through the application's launcher (``blockd_apps.launch``), the one place tests
start daemons from. A ``Daemon`` is a context manager: leaving the block stops it (the suite
fails if a daemon outlives the session, see tests/conftest.py).
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime.tenants_file import token_hash
from blockd_apps.launch import spawn, terminate

TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "carol": "tok-carol", "dave": "tok-dave",
          "admin": "tok-admin", "multi": "tok-multi"}

TENANTS = {
    "tenants": [
        {"id": "acme", "quota_blocks": 40, "sharing": "private"},
        {"id": "globex", "quota_blocks": 40, "sharing": "private"},
        {"id": "initech", "quota_blocks": 40, "sharing": "group", "group": "labs"},
        {"id": "umbrella", "quota_blocks": 40, "sharing": "group", "group": "labs"},
    ],
    "workers": [
        {"name": "alice", "token_sha256": token_hash(TOKENS["alice"]), "tenants": ["acme"]},
        {"name": "bob", "token_sha256": token_hash(TOKENS["bob"]), "tenants": ["globex"]},
        {"name": "carol", "token_sha256": token_hash(TOKENS["carol"]), "tenants": ["initech"]},
        {"name": "dave", "token_sha256": token_hash(TOKENS["dave"]), "tenants": ["umbrella"]},
        {"name": "multi", "token_sha256": token_hash(TOKENS["multi"]),
         "tenants": ["acme", "globex"]},
        {"name": "admin", "token_sha256": token_hash(TOKENS["admin"]), "tenants": [],
         "admin": True},
    ],
}

LAYOUT = pb.KvLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype=pb.KV_DTYPE_FLOAT16, kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                     tp_size=1)
NS = pb.CacheNamespace(model_id="tiny", model_revision="r1")


def md(who: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),) if who else ()


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    endpoints: dict[str, str]
    workdir: Path
    tenants_path: Path
    lines: list[str] = field(default_factory=list)
    channels: list[grpc.Channel] = field(default_factory=list)

    def stub(self, transport: str = "unix") -> pb_grpc.BlockdServiceStub:
        target = (f"unix:{self.endpoints['unix']}" if transport == "unix"
                  else self.endpoints["tcp"])
        ch = grpc.insecure_channel(target)
        self.channels.append(ch)
        return pb_grpc.BlockdServiceStub(ch)

    def channel(self, transport: str = "unix") -> grpc.Channel:
        self.stub(transport)
        return self.channels[-1]

    @property
    def metrics_url(self) -> str:
        return f"http://{self.endpoints['metrics']}/metrics"

    def metric(self, name: str) -> float:
        """One series of the daemon's metrics, e.g. ``blockd_evictions_total`` or
        ``blockd_preemptions_total{tenant="acme"}``, scraped over HTTP."""
        body = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{name} not exported")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        for ch in self.channels:
            ch.close()
        return terminate(self.proc)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        return "".join(self.lines)


def start(workdir: Path, *, num_blocks: int = 64, lease_ms: int = 10_000,
          extra: dict[str, Any] | None = None, tenants: dict[str, Any] | None = None,
          preexec_fn: Callable[[], object] | None = None) -> Daemon:
    workdir.mkdir(parents=True, exist_ok=True)
    tenants_path = workdir / "tenants.yaml"
    tenants_path.write_text(yaml.safe_dump(tenants or TENANTS))
    cfg: dict[str, Any] = {
        # A short drain: a test that stops its daemon with sessions still attached would wait
        # out the whole grace; the tests of the drain set their own grace_seconds.
        "server": {"unix_socket": str(workdir / "blockd.sock"), "tcp_address": "127.0.0.1:0",
                   "handle_socket": str(workdir / "pool.sock"), "grace_seconds": 0.2,
                   "check_invariants": True},
        # Live renderings: tests read a counter right after the call that moved it (the
        # default metrics.cache_ms reuses one rendering for a second; tests of it set it).
        "metrics": {"address": "127.0.0.1:0", "cache_ms": 0},
        "pool": {"block_size": 4, "num_blocks": num_blocks, "num_layers": 2, "num_kv_heads": 2,
                 "head_dim": 8, "dtype": "float16"},
        "lease": {"default_ms": lease_ms, "min_ms": 100, "reap_interval_ms": 50},
        "tenants": {"file": str(tenants_path), "allow_anonymous": False},
    }
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    cfg_path = workdir / "blockd.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    # 60 s: a daemon starts in about a second, but on a 2-core machine running the whole suite
    # (load average ~10) it was seen not to print its endpoints within the default 30 s.
    launched = spawn(cfg_path, workdir, preexec_fn=preexec_fn, ready_timeout=60.0)
    return Daemon(launched.proc, launched.endpoints, workdir, tenants_path, launched.lines)


def attach(stub: pb_grpc.BlockdServiceStub, who: str, tenant: str,
           layout: pb.KvLayout = LAYOUT, lease_ms: int = 0) -> pb.AttachResponse:
    return stub.Attach(pb.AttachRequest(worker_name=who, tenant_id=tenant, layout=layout,
                                        lease_ms=lease_ms), metadata=md(who))


class Worker:
    """A thin test driver of one session: numbered steps, explicit fences."""

    def __init__(self, stub: pb_grpc.BlockdServiceStub, who: str, tenant: str,
                 lease_ms: int = 0) -> None:
        self.stub = stub
        self.who = who
        self.att = attach(stub, who, tenant, lease_ms=lease_ms)
        self.sid = self.att.session_id
        self.epoch = self.att.epoch
        self.step_id = 0
        self.fence = 0

    def step(self, *ops: pb.Operation, fence: int | None = None, completed: int = 0
             ) -> pb.StepResponse:
        self.step_id += 1
        if fence is None:
            self.fence += 1
            fence = self.fence
        return self.stub.Step(pb.StepRequest(session_id=self.sid, epoch=self.epoch,
                                             step_id=self.step_id, fence=fence,
                                             completed_fence=completed, operations=list(ops)),
                              metadata=md(self.who))

    def admit(self, tokens: list[int], ns: pb.CacheNamespace = NS) -> pb.AdmitResult:
        r = self.step(admit(tokens, ns), fence=0).results[0]
        assert r.status.code == 0, r.status
        return r.admit

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), metadata=md(self.who))

    def cache(self, tokens: list[int]) -> str:
        """Admit ``tokens``, commit them and complete the fence: their full blocks are hits."""
        seq = self.admit(tokens).sequence_id
        self.step(commit(seq), completed=0)
        self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.sid, epoch=self.epoch,
                                                completed_fence=self.fence),
                            metadata=md(self.who))
        return seq


def wait_metric(d: Daemon, name: str, at_least: float, timeout: float = 30) -> float:
    """Poll one series until it reaches ``at_least`` (a wait with a deadline, not a timing)."""
    deadline = time.monotonic() + timeout
    while True:
        value = d.metric(name)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (for tests that write request bytes by hand)."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def admit(tokens: list[int], ns: pb.CacheNamespace = NS, **kw: Any) -> pb.Operation:
    return pb.Operation(admit=pb.AdmitOp(namespace=ns, token_ids=tokens, **kw))


def append(seq: str, tokens: list[int]) -> pb.Operation:
    return pb.Operation(append=pb.AppendOp(sequence_id=seq, token_ids=tokens))


def commit(seq: str) -> pb.Operation:
    return pb.Operation(commit=pb.CommitOp(sequence_id=seq))


def release(seq: str) -> pb.Operation:
    return pb.Operation(release=pb.ReleaseOp(sequence_id=seq))


def fork(seq: str, n: int = 1) -> pb.Operation:
    return pb.Operation(fork=pb.ForkOp(sequence_id=seq, num_children=n))


def restart(d: Daemon) -> Daemon:
    """Start the daemon again on ``d``'s configuration (and state directory)."""
    launched = spawn(d.workdir / "blockd.yaml", d.workdir)
    return Daemon(launched.proc, launched.endpoints, d.workdir, d.tenants_path, launched.lines)


def kill9(d: Daemon) -> None:
    """``kill -9`` the daemon (no shutdown path runs) and close the test's channels to it."""
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    for ch in d.channels:
        ch.close()
