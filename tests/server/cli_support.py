"""Run the daemon's own entry point, ``python -m blockd.server``, as a real process, with its
stdout (the ``BLOCKD_READY`` line) and its stderr (the log, or the one line of a refused start)
kept apart, so tests can check exactly what an operator's terminal or log collector gets.

``Served`` is a context manager: leaving the block stops the daemon (SIGTERM, then SIGKILL), so
none outlives its test (tests/conftest.py fails the run otherwise).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

SERVE = (sys.executable, "-m", "blockd.server")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``BLOCKD_*`` (they would configure the daemon),
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
    env.update(extra)
    return env


def write_config(workdir: Path, **sections: dict[str, Any]) -> Path:
    """A small daemon's YAML in ``workdir``: sockets there, kernel-chosen ports, a 16-block
    pool, the anonymous laptop tenant; ``sections`` override it."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "server": {"unix_socket": str(workdir / "blockd.sock"), "tcp_address": "127.0.0.1:0",
                   "handle_socket": str(workdir / "pool.sock"), "grace_seconds": 0.5},
        "metrics": {"address": "127.0.0.1:0"},
        "pool": {"block_size": 4, "num_blocks": 16, "num_layers": 1, "num_kv_heads": 1,
                 "head_dim": 8},
        "lease": {"reap_interval_ms": 50},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = workdir / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_refused(*args: str, cwd: Path, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """``python -m blockd.server ARGS`` expected to refuse to start: it must exit by itself."""
    return subprocess.run([*SERVE, *args], cwd=cwd, env=env or clean_env(),
                          capture_output=True, text=True, timeout=60)


def listening_port() -> socket.socket:
    """A TCP socket listening on a kernel-chosen loopback port (another program's port)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


class Served:
    """A running ``python -m blockd.server``; its stderr goes to ``<workdir>/stderr.log``."""

    def __init__(self, *args: str, cwd: Path, env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        self.stderr_path = cwd / f"stderr-{time.monotonic_ns()}.log"
        self._err = self.stderr_path.open("w")
        self.proc = subprocess.Popen([*SERVE, *args], cwd=cwd, env=env or clean_env(),
                                     stdout=subprocess.PIPE, stderr=self._err, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        self.stdout: list[str] = []
        self.endpoints: dict[str, str] = {}
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.stdout.append(line)
            if line.startswith("BLOCKD_READY "):
                self.endpoints = json.loads(line.split(" ", 1)[1])
                break
        if not self.endpoints:
            self.kill()
            raise AssertionError("the daemon did not start:\n" + self.stderr())

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (the daemon drains), SIGKILL after ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdout is not None
        if not self.proc.stdout.closed:
            self.stdout.extend(self.proc.stdout.readlines())
            self.proc.stdout.close()
        self._err.close()
        return self.proc.returncode

    def kill(self) -> None:
        """``kill -9``: nothing is cleaned up by the daemon."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
