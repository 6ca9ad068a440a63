"""Hands a session's file descriptors to its worker over a Unix socket (SCM_RIGHTS).

The protocol (request and answer lines, their size limits, the fd order) is
``blockd.wire``'s; the worker's side is ``blockd_client.handles.fetch_handles``. The session id
is the capability: it is unguessable and only the worker that attached knows it.
No file name is ever created that another process could open. The server runs on its own
threads with blocking sockets (asyncio has no portable SCM_RIGHTS), and only reads daemon state
through ``lookup``, which returns immutable values.

One slow or idle client must not delay another tenant's fetch: each connection is served on its
own thread, under one deadline for the whole exchange (``timeout``, not per ``recv``: a byte
every few seconds is cut off too), and at most ``max_connections`` are served at once (more wait
in the kernel's listen backlog, costing no thread and no fd of ours).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from blockd import logs, wire

log = logging.getLogger("blockd.handles")
#: session_id -> (header, [fds]) or None when the session is unknown (``Pool.handle`` makes the
#: pair).
Lookup = Callable[[str], "tuple[wire.HandleHeader, list[int]] | None"]


class HandleServer:
    def __init__(self, path: str, lookup: Lookup, *, mode: int = 0o660,
                 max_connections: int = 16, timeout: float = 2.0) -> None:
        self.path = str(Path(path).resolve())
        self.lookup = lookup
        self.timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, mode)  # explicitly, whatever the umask
        self.sock.listen(64)
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="blockd-handles", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            self._slots.acquire()  # a free slot before the next accept (module docstring)
            try:
                conn, _ = self.sock.accept()
            except OSError:
                self._slots.release()
                return
            threading.Thread(target=self._serve_one, args=(conn,), name="blockd-handle",
                             daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._handle(conn, time.monotonic() + self.timeout)
        except (OSError, ValueError) as exc:  # a timeout is an OSError too
            log.warning("pool handle request failed", extra=logs.fields(error=str(exc)))
        finally:
            self._slots.release()

    def _handle(self, conn: socket.socket, deadline: float) -> None:
        limit = wire.MAX_REQUEST_BYTES
        data = b""
        while not data.endswith(b"\n") and len(data) < limit:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request not complete within {self.timeout} s")
            conn.settimeout(left)
            chunk = conn.recv(limit)
            if not chunk:
                return
            data += chunk
        try:
            session_id = wire.decode_request(data)
        except wire.WireError as exc:
            conn.sendall(wire.encode_refusal("INVALID_ARGUMENT", str(exc)))
            return
        found = self.lookup(session_id)
        if found is None:
            conn.sendall(wire.encode_refusal("NOT_FOUND",
                                             "session_id: unknown or expired session"))
            return
        header, fds = found
        try:
            header.split_fds(fds)  # the documented count and order
        except wire.WireError as exc:  # the daemon's own bug: say so rather than hang up
            log.error("pool handle header refused by the wire contract",
                      extra=logs.fields(error=str(exc)))
            conn.sendall(wire.encode_refusal("INTERNAL", f"bad handle header: {exc}"))
            return
        socket.send_fds(conn, [header.to_json()], fds)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=2)
        Path(self.path).unlink(missing_ok=True)
