"""Start ``blockd serve`` as a subprocess and wait until it serves.

Used by the demo, the benchmarks and the tests (the one place they start daemons from): the
daemon prints one machine-readable line, ``BLOCKD_READY {"unix": ..., "tcp": ..., "metrics":
...}``, once every endpoint is bound (ports chosen by the kernel included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field
from pathlib import Path

#: The argv prefix of a daemon this module starts: this interpreter, the ``blockd`` command.
DAEMON_COMMAND = (sys.executable, "-m", "blockd_apps", "serve")


@dataclass
class Launched:
    """A running daemon subprocess, its endpoints and its output so far (kept up to date)."""

    proc: subprocess.Popen[str]
    endpoints: dict[str, str]
    lines: MutableSequence[str] = field(default_factory=list)

    def stop(self, timeout: float = 20.0) -> int:
        return terminate(self.proc, timeout)


def terminate(proc: subprocess.Popen[str], timeout: float = 20.0) -> int:
    """SIGTERM (a daemon drains), then SIGKILL after ``timeout``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def spawn(config: Path, cwd: Path, *, ready_timeout: float = 30.0,
          lines: MutableSequence[str] | None = None,
          preexec_fn: Callable[[], object] | None = None) -> Launched:
    """``python -m blockd_apps serve --config CONFIG``; returns once it printed BLOCKD_READY.

    ``BLOCKD_*`` variables of this process are not passed on: they would override the file.
    ``preexec_fn`` runs in the child before the daemon (e.g. a lower RLIMIT_NOFILE).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
    proc = subprocess.Popen([*DAEMON_COMMAND, "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=cwd, env=env, preexec_fn=preexec_fn)
    out: MutableSequence[str] = [] if lines is None else lines
    assert proc.stdout is not None
    endpoints = None
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if line.startswith("BLOCKD_READY "):
            endpoints = json.loads(line.split(" ", 1)[1])
            break
    if endpoints is None:
        proc.kill()
        proc.wait()
        raise RuntimeError("the daemon did not start:\n" + "".join(out))

    def pump() -> None:  # keep reading: a full pipe would block the daemon's logging
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)

    threading.Thread(target=pump, daemon=True).start()
    return Launched(proc, endpoints, out)
