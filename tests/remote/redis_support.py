"""A real Redis Cluster on loopback for the remote tier's tests: Debian's ``redis-server``, three
masters made one cluster by ``redis-cli --cluster create`` (nothing mocked).

``RedisCluster.start`` picks free ports, starts one ``redis-server`` per master (no persistence,
``cluster-require-full-coverage no`` so that a killed master leaves the others serving, an
optional ``requirepass`` and ``maxmemory``), creates the cluster and waits for ``cluster_state:ok``
on every node. ``kill``/``revive`` take one master away and bring it back on the same port (its
node file keeps its slots); ``cli`` runs ``redis-cli`` against a node.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")

needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server/redis-cli not installed (.ci/run installs Debian's redis-server)")


#: Ports handed out in this test run, claimed by a file each so that tests running in parallel
#: (xdist workers share ``PYTEST_XDIST_TESTRUNUID``) never get the same one between the
#: ``bind`` that found it free and the server that takes it (a node would join another test's
#: cluster: "Node ... is not empty").
_CLAIMS = Path(tempfile.gettempdir()) / (
    f"blockd-redis-ports-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}")


def _claim(port: int) -> bool:
    _CLAIMS.mkdir(exist_ok=True)
    try:
        os.close(os.open(_CLAIMS / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out for ``bind(0)`` (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for a Redis Cluster node, which also listens on port + 10000 (the bus): both
    free, both below the kernel's ephemeral range. A port ``bind(0)`` found free there could be
    taken by any process's own ``bind(0)`` (a daemon's TCP or metrics listener) before a
    cluster started late comes up on it (test_remote_faults' degraded start did: "bind:
    Address already in use" on the bus port)."""
    top = min(_ephemeral_floor(), 65536) - 10000
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(10000, top)
        if _free(port) and _free(port + 10000) and _claim(port) and _claim(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


@dataclass
class RedisCluster:
    workdir: Path
    ports: list[int]
    password: str | None = None
    maxmemory: str | None = None
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @classmethod
    def start(cls, workdir: Path, *, masters: int = 3, password: str | None = None,
              maxmemory: str | None = None) -> RedisCluster:
        c = cls(workdir, [free_port() for _ in range(masters)], password, maxmemory)
        c.create()
        return c

    def create(self) -> None:
        """Start a master on each of ``ports`` and make them one cluster."""
        try:
            for p in self.ports:
                self._spawn(p)
            for p in self.ports:
                self._wait_ping(p)
            args = [f"127.0.0.1:{p}" for p in self.ports]
            out = subprocess.run([REDIS_CLI or "redis-cli", *self._auth(), "--cluster",
                                  "create", *args, "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=60)
            if out.returncode:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}"
                                   f"{out.stderr}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def nodes(self) -> str:
        """The ``tiers.redis_nodes`` value for this cluster."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _auth(self) -> list[str]:
        return ["-a", self.password, "--no-auth-warning"] if self.password else []

    def _spawn(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no", "--dir", str(d), "--daemonize", "no",
                "--logfile", str(d / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def cli(self, port: int, *cmd: str) -> str:
        out = subprocess.run([REDIS_CLI or "redis-cli", "-p", str(port), *self._auth(), *cmd],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()

    def _wait_ping(self, port: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.cli(port, "ping") == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not answer")

    def wait_ok(self, ports: list[int] | None = None) -> None:
        deadline = time.monotonic() + 60
        for p in ports or self.ports:
            while "cluster_state:ok" not in self.cli(p, "cluster", "info"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok on {p}")
                time.sleep(0.1)

    def stored_keys(self, pattern: str = "blockd:*") -> list[tuple[int, str]]:
        """Every (node port, key) matching ``pattern`` on the live masters."""
        out = []
        for p in self.ports:
            if p in self.procs and self.procs[p].poll() is None:
                out += [(p, k) for k in self.cli(p, "--scan", "--pattern", pattern).split()]
        return out

    def freeze(self, on: bool) -> None:
        """SIGSTOP (or SIGCONT) every master: connections still open, nothing answers (a
        cluster slower than any deadline), until thawed."""
        for proc in self.procs.values():
            proc.send_signal(signal.SIGSTOP if on else signal.SIGCONT)

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def revive(self, *ports: int) -> None:
        """Start killed masters again on their ports (their node files keep their slots)."""
        for p in ports:
            self._spawn(p)
        for p in ports:
            self._wait_ping(p)
        self.wait_ok()

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()
        self.procs = {}

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
