"""Hands a session's file descriptors to its worker over a Unix socket (SCM_RIGHTS).

Protocol (one request per connection)::

    worker -> daemon   {"session_id": "..."}\n
    daemon -> worker   {"ok": true, "epoch": N, "pool_bytes": N, "fence_page_bytes": 4096, ...}\n
                       + SCM_RIGHTS [pool fd, fence page fd]
                   or  {"ok": false, "code": "NOT_FOUND", "message": "..."}\n

The worker's side is ``blockd_client.pool.fetch_handles``. The session id is the capability:
it is unguessable and only the worker that attached knows it.
No file name is ever created that another process could open. The server runs on its own thread
with blocking sockets (asyncio has no portable SCM_RIGHTS), and only reads daemon state through
``lookup``, which returns immutable values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("blockd.handles")
MAX_REQUEST = 4096

#: session_id -> (header dict, [fds]) or None when the session is unknown.
Lookup = Callable[[str], "tuple[dict[str, Any], list[int]] | None"]


class HandleServer:
    def __init__(self, path: str, lookup: Lookup) -> None:
        self.path = str(Path(path).resolve())
        self.lookup = lookup
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o660)
        self.sock.listen(64)
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="blockd-handles", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self._handle(conn)
                except (OSError, ValueError) as exc:
                    log.warning("pool handle request failed: %s", exc)

    def _handle(self, conn: socket.socket) -> None:
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
            chunk = conn.recv(MAX_REQUEST)
            if not chunk:
                return
            data += chunk
        try:
            session_id = str(json.loads(data)["session_id"])
        except (ValueError, KeyError, TypeError):
            conn.sendall(b'{"ok": false, "code": "INVALID_ARGUMENT", "message": '
                         b'"session_id: expected {\\"session_id\\": ...}"}\n')
            return
        found = self.lookup(session_id)
        if found is None:
            conn.sendall(b'{"ok": false, "code": "NOT_FOUND", "message": '
                         b'"session_id: unknown or expired session"}\n')
            return
        header, fds = found
        socket.send_fds(conn, [json.dumps({"ok": True, **header}).encode() + b"\n"], fds)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=2)
        Path(self.path).unlink(missing_ok=True)
