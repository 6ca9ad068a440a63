"""File descriptors as a budget (blockd.runtime.fds), against real daemons started with a low
RLIMIT_NOFILE (set in the daemon's subprocess before it runs, as a container runtime would).

The audit's attack: two tenants, each within its own ``max_sessions``, exhausted the daemon's
descriptors, and every later Attach, any tenant's, failed with INTERNAL (EMFILE).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from daemon_proc import TOKENS, Daemon, attach, md, start
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd.config import Config, ServerConfig
from blockd.core.tenants import TenantPolicy
from blockd.runtime import fds
from blockd.runtime.tenants_file import token_hash
from blockd_apps.launch import DAEMON_COMMAND

#: Two tenants with the default per-tenant max_sessions (256 each: 512 together).
TWO = {
    "tenants": [{"id": "acme", "quota_blocks": 32}, {"id": "globex", "quota_blocks": 32}],
    "workers": [
        {"name": "alice", "token_sha256": token_hash(TOKENS["alice"]), "tenants": ["acme"]},
        {"name": "bob", "token_sha256": token_hash(TOKENS["bob"]), "tenants": ["globex"]},
    ],
}
POLICIES = [TenantPolicy(tenant_id="acme", quota_blocks=32),
            TenantPolicy(tenant_id="globex", quota_blocks=32)]
#: The daemon's own session limit in these tests: what the descriptors below allow.
MAX_SESSIONS = 20


def nofile_for(sessions: int) -> int:
    """The RLIMIT_NOFILE whose budget is exactly ``sessions`` sessions, for the test config."""
    cfg = Config(server=ServerConfig(max_sessions=MAX_SESSIONS))
    return fds.reserve(cfg, POLICIES, partitions=1) + fds.FDS_PER_SESSION * sessions


def nofile(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def limits_of(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files limit")


@contextlib.contextmanager
def low_fd_daemon(tmp_path: Path, soft: int, hard: int) -> Iterator[Daemon]:
    with start(tmp_path / "d", tenants=TWO, extra={"server": {"max_sessions": MAX_SESSIONS}},
               preexec_fn=nofile(soft, hard)) as d:
        yield d


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


def test_a_tenant_at_its_descriptor_share_is_refused_and_another_still_attaches(
        tmp_path: Path) -> None:
    """Soft limit raised to the hard one at start; the 20 sessions the descriptors allow split
    10/10 between two tenants whose max_sessions (256 each) sum past them: the 11th of acme is
    RESOURCE_EXHAUSTED naming fds (never INTERNAL), and globex still attaches all of its 10."""
    hard = nofile_for(MAX_SESSIONS)
    with low_fd_daemon(tmp_path, soft=64, hard=hard) as d:
        assert limits_of(d.proc.pid) == (hard, hard)
        stub = d.stub()
        for _ in range(MAX_SESSIONS // 2):
            attach(stub, "alice", "acme")
        err = refused(lambda: attach(stub, "alice", "acme"))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "fds" in err.details() and "acme" in err.details()
        # The refusal changed nothing: acme's sessions are still its 10.
        assert stub.Stats(pb.StatsRequest(), metadata=md("alice")).num_sessions == 10
        other = d.stub()
        for _ in range(MAX_SESSIONS // 2):
            assert attach(other, "bob", "globex").session_id


def test_a_connection_flood_cannot_take_the_descriptors_attach_needs(tmp_path: Path) -> None:
    """Hundreds of idle connections (no handshake, no credential) against a daemon with a few
    hundred descriptors: gRPC closes those beyond its connection budget at accept, so a
    tenant's Attach over its open channel still succeeds, and health still answers."""
    hard = nofile_for(MAX_SESSIONS)
    with low_fd_daemon(tmp_path, soft=hard, hard=hard) as d:
        stub = d.stub()
        health = health_pb2_grpc.HealthStub(d.channels[-1])
        assert health.Check(health_pb2.HealthCheckRequest()).status == 1
        flood = []
        try:
            for _ in range(hard + 50):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                flood.append(s)
                s.connect(d.endpoints["unix"])
            for _ in range(3):
                try:
                    assert attach(stub, "bob", "globex").session_id
                except grpc.RpcError as exc:  # never INTERNAL: at most a budget refusal
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                    raise
            assert health.Check(health_pb2.HealthCheckRequest()).status == 1
        finally:
            for s in flood:
                s.close()
        assert "internal error" not in d.log_text()


def test_session_limits_the_descriptors_cannot_meet_are_refused_at_start(
        tmp_path: Path) -> None:
    """server.max_sessions 1024 and two tenants of 256: 512 sessions need more descriptors
    than a hard limit of a few hundred. The daemon does not start: exit 2, one line that names
    the keys."""
    hard = nofile_for(MAX_SESSIONS)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump(TWO))
    config = tmp_path / "blockd.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"unix_socket": str(tmp_path / "b.sock"), "tcp_address": "",
                   "handle_socket": str(tmp_path / "p.sock")},
        "metrics": {"address": ""},
        "pool": {"block_size": 4, "num_blocks": 64, "num_layers": 2, "num_kv_heads": 2,
                 "head_dim": 8},
        "tenants": {"file": str(tenants), "allow_anonymous": False},
    }))
    out = subprocess.run([*DAEMON_COMMAND, "--config", str(config)], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, preexec_fn=nofile(hard, hard),
                         check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if "cannot start" in line]
    assert len(errors) == 1, out.stderr
    assert "server.max_sessions" in errors[0] and "max_sessions" in errors[0]
    assert "RLIMIT_NOFILE" in errors[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "b.sock").exists()


def test_the_laptop_default_fits_a_common_container_limit() -> None:
    """The embedded default (one tenant, max_sessions 256) fits RLIMIT_NOFILE 1024, the soft
    and hard limit many container runtimes give."""
    cfg = Config()
    policy = [TenantPolicy(tenant_id="default", quota_blocks=1024)]
    budget = fds.FdBudget(1024, fds.reserve(cfg, policy, partitions=1))
    budget.check(cfg, policy)
    assert budget.shares == {"default": 256}

