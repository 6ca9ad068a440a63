"""Hands a session's file descriptors to its worker over a Unix socket (SCM_RIGHTS).

The protocol (request and answer lines, their size limits, the fd order) is
``blockd.wire``'s; the worker's side is ``blockd_client.handles.fetch_handles``. The
capability is the session id together with its fetch secret (``blockd.pools.fetch_secrets``),
which only the AttachResponse carries: a request with the id alone is answered as an unknown
session would be.
No file name is ever created that another process could open. The server runs on its own
threads with blocking sockets (asyncio has no portable SCM_RIGHTS), and only reads daemon state
through ``lookup``, which returns immutable values.

One slow or idle client must not delay another tenant's fetch: each connection is served on its
own thread, under one deadline for the whole exchange (``timeout``, not per ``recv``: a byte
every few seconds is cut off too), and at most ``max_connections`` are served at once (more wait
in the kernel's listen backlog, costing no thread and no fd of ours).

Who asks (docs/security.md, the trust model), in order: the kernel's SO_PEERCRED for the
connection must name an allowed uid or gid (``allowed_uids`` / ``allowed_gids``; by default
only the daemon's own uid), checked before a byte is read; the fetch secret must be the
session's (NOT_FOUND otherwise, the unknown session's very answer, checked before the session
is looked up); a request naming a tenant must name the session's; the pool goes to one uid only
(``_pin``, a second check); and what is sent is only the pool of the session's partition
(``lookup``). Any input, however malformed (oversized, nested, binary,
slow), ends its own connection with a refusal or a hang-up, never the server: every error of
one connection is caught on its thread. ``alive`` is what health reports (NOT_SERVING when the
accept thread has stopped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from blockd import handle_wire, logs, wire
from blockd.pools.fetch_secrets import FetchSecrets

log = logging.getLogger("blockd.handles")
#: session_id -> (header, [fds], the session's tenant id) or None when the session is unknown
#: (``Pool.handle`` of the session's partition makes the pair).
Lookup = Callable[[str], "tuple[handle_wire.HandleHeader, list[int], str] | None"]
#: Pinned sessions kept before the ended ones are pruned.
MAX_PINNED = 8192
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded at connect."""
    return _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def json_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON text (brackets inside strings ignored),
    found without parsing it."""
    depth = deepest = 0
    in_str = escaped = False
    for c in data:
        if in_str:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D):
            depth -= 1
    return deepest


class HandleServer:
    def __init__(self, path: str, lookup: Lookup, secrets: FetchSecrets, *, mode: int = 0o660,
                 max_connections: int = 16, timeout: float = 2.0,
                 allowed_uids: frozenset[int] | None = None,
                 allowed_gids: frozenset[int] = frozenset()) -> None:
        self.path = str(Path(path).resolve())
        self.lookup = lookup
        self.secrets = secrets
        self.timeout = timeout
        self.allowed_uids = frozenset({os.geteuid()}) if allowed_uids is None else allowed_uids
        self.allowed_gids = allowed_gids
        #: Requests refused, by code (a diagnostic; the log has each one).
        self.refused: dict[str, int] = {}
        #: session id -> the uid its pool was first sent to: a session id that leaked to
        #: another allowed uid does not give that uid the mapping (``_pin``).
        self._pinned: dict[str, int] = {}
        self._pin_lock = threading.Lock()
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

    @property
    def alive(self) -> bool:
        """Whether the server still accepts connections (health goes NOT_SERVING if not)."""
        return self.thread.is_alive() and not self._stop

    @property
    def closing(self) -> bool:
        """``close`` was called (a stop on purpose, not a failure)."""
        return self._stop

    def _serve(self) -> None:
        while not self._stop:
            self._slots.acquire()  # a free slot before the next accept (module docstring)
            try:
                conn, _ = self.sock.accept()
            except OSError as exc:
                self._slots.release()
                if not self._stop:
                    log.error("the handle socket stopped accepting",
                              extra=logs.fields(error=str(exc)))
                return
            try:
                threading.Thread(target=self._serve_one, args=(conn,), name="blockd-handle",
                                 daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: refuse this one, keep serving
                log.warning("pool handle request dropped", extra=logs.fields(error=str(exc)))
                conn.close()
                self._slots.release()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._handle(conn, time.monotonic() + self.timeout)
        except Exception as exc:  # one connection's failure ends it, never the server
            log.warning("pool handle request failed", extra=logs.fields(error=str(exc)))
        finally:
            self._slots.release()

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        log.warning("pool handle request refused", extra=logs.fields(code=code, error=message))
        conn.sendall(handle_wire.encode_refusal(code, message))

    def _handle(self, conn: socket.socket, deadline: float) -> None:
        _pid, uid, gid = peer_credentials(conn)
        if uid not in self.allowed_uids and gid not in self.allowed_gids:
            self._refuse(conn, "PERMISSION_DENIED",
                         f"peer uid {uid} gid {gid}: not allowed by handles.allowed_uids or "
                         "handles.allowed_gids")
            return
        limit = handle_wire.MAX_REQUEST_BYTES
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
        if not data.endswith(b"\n"):
            self._refuse(conn, "INVALID_ARGUMENT",
                         f"request: longer than {limit} bytes or not one line")
            return
        if json_depth(data) > handle_wire.MAX_REQUEST_DEPTH:
            self._refuse(conn, "INVALID_ARGUMENT",
                         f"request: nested deeper than {handle_wire.MAX_REQUEST_DEPTH}")
            return
        try:
            req = handle_wire.decode_handle_request(data)
        except wire.WireError as exc:
            self._refuse(conn, "INVALID_ARGUMENT", str(exc))
            return
        session_id = req.session_id
        # A missing or wrong secret and an unknown session: one answer (nothing tells a guesser
        # which part was wrong), and the session is not even looked up without the secret.
        found = (self.lookup(session_id) if self.secrets.matches(session_id, req.fetch_secret)
                 else None)
        if found is None:
            self._refuse(conn, "NOT_FOUND", "session_id: unknown or expired session")
            return
        header, fds, owner = found
        if req.tenant_id and req.tenant_id != owner:
            # Same answer text whatever the session's real tenant: it is not revealed.
            self._refuse(conn, "PERMISSION_DENIED", "tenant_id: not the session's tenant")
            return
        if not self._pin(session_id, uid):
            self._refuse(conn, "PERMISSION_DENIED",
                         "session_id: the session's pool was sent to another uid")
            return
        try:
            header.split_fds(fds)  # the documented count and order
        except wire.WireError as exc:  # the daemon's own bug: say so rather than hang up
            log.error("pool handle header refused by the wire contract",
                      extra=logs.fields(error=str(exc)))
            self._refuse(conn, "INTERNAL", f"bad handle header: {exc}")
            return
        socket.send_fds(conn, [header.to_json()], fds)

    def _pin(self, session_id: str, uid: int) -> bool:
        """The first uid a session's pool goes to is the only one it goes to: a second check
        behind the fetch secret (a secret that leaked with the id still does not move the pool
        to another uid after its owner's fetch). Pins of sessions that ended are dropped once
        the table grows."""
        with self._pin_lock:
            if len(self._pinned) >= MAX_PINNED:
                self._pinned = {s: u for s, u in self._pinned.items()
                                if self.lookup(s) is not None}
            return self._pinned.setdefault(session_id, uid) == uid

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=2)
        Path(self.path).unlink(missing_ok=True)
