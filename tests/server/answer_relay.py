"""A Unix-socket relay in front of a daemon that can hold its answers back.

``AnswerRelay(daemon_socket, path)`` listens on ``path`` and relays each connection, byte for
byte, to the daemon's socket. ``hold()`` stops passing what the daemon sends (what clients send
still reaches it); ``let_go()`` passes everything held, in order. A call made while the relay
holds is received and applied by the daemon, and its answer waits here until the client's
deadline passes: the answer lost on the way that a congested node or a dropped connection
produces, on demand and without touching the daemon.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path


class AnswerRelay:
    def __init__(self, daemon_socket: str | Path, path: str | Path) -> None:
        self.daemon_socket = str(daemon_socket)
        self.path = str(path)
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    @property
    def target(self) -> str:
        return f"unix:{self.path}"

    def hold(self) -> None:
        """From now on, keep what the daemon sends."""
        self._open.clear()

    def let_go(self) -> None:
        """Pass what was held, and everything after it."""
        self._open.set()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.daemon_socket)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answers:
                    self._open.wait()  # held: this chunk (and what follows) waits here
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()
        Path(self.path).unlink(missing_ok=True)

    def __enter__(self) -> AnswerRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
