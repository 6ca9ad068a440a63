"""Claiming the daemon's addresses before anything is created, and giving them back.

A daemon never takes over or deletes another live daemon's Unix socket. Each socket path is
claimed with a lock file next to it, ``<path>.lock``, ``flock``-ed (exclusive, non-blocking)
for the daemon's whole life:

* The lock decides. Two daemons starting at the same moment cannot both get it, and the kernel
  drops it when its holder dies, even by ``kill -9``: a socket file left by a dead daemon is
  then recognised as stale and replaced, with no timeout and no guess from a pid.
* A connect check backs it up: a socket file that still accepts connections although nobody
  holds its lock (a daemon of an older version, another program) is refused too, and a path
  that is not a socket at all is never deleted.
* The holder writes its pid into the lock file, for the error message only.
* On a clean stop the holder removes the socket, then the lock file, while still holding the
  lock. A starter that opened the old lock file just before can only lock a file that is no
  longer at that path; it checks that the file it locked is still the one at the path
  (same inode) and otherwise starts over, so two daemons never both believe they hold a path.

TCP ports are checked the same way before anything is created (``check_port``): a test bind,
so a port in use fails the start with one line before the pool exists, rather than with
gRPC's C-core error output. The real bind follows (a port taken in between still fails).

The default sockets live in ``blockd.config.runtime_dir()``, which is created 0700 and refused
when another user owns it or it is open to others (it is in ``/tmp`` without
``XDG_RUNTIME_DIR``).

Plaintext TCP is for loopback only (``require_tls_off_loopback``): the bearer token travels in
every call, so any other address needs ``server.tls_cert`` and ``server.tls_key``
(``tls_credentials``; with ``server.tls_client_ca`` clients need a certificate too). Unix sockets
get ``server.socket_mode`` explicitly (``set_socket_mode``), whatever the umask.

Every refusal is a ``FailedPrecondition`` naming the config field, so the daemon's entry point
reports it in one line and exits with status 2.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import socket
import stat
from pathlib import Path

import grpc

from blockd import config, logs, paths, tls_files
from blockd.core.errors import FailedPrecondition

log = logging.getLogger("blockd.server")


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; an empty host is loopback) as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def check_port(address: str, field: str) -> None:
    """Refuse (``FailedPrecondition`` on ``field``) a TCP address something already listens
    on, or one this host cannot listen on. Port 0 (the kernel picks) is always free."""
    host, port = split_address(address)
    if port == 0:
        return
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FailedPrecondition(f"{field}: cannot resolve {host!r} in {address!r}: "
                                 f"{exc.strerror}", field=field) from None
    for family, _, _, _, sockaddr in found:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise FailedPrecondition(
                        f"{field}: {address} is already in use (another blockd, or another "
                        f"program, listens on port {port}); stop it or set {field}",
                        field=field) from None
                raise FailedPrecondition(f"{field}: cannot listen on {address}: "
                                         f"{exc.strerror}", field=field) from None


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one ("localhost" included)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(found) and all(ipaddress.ip_address(str(a[4][0]).split("%")[0]).is_loopback
                               for a in found)


def require_tls_off_loopback(address: str, tls: bool) -> None:
    """Refuse a non-loopback ``server.tcp_address`` without TLS (tokens would be sniffable)."""
    host, _ = split_address(address)
    if not tls and not is_loopback(host):
        raise FailedPrecondition(
            f"server.tcp_address: {address} is not a loopback address and TCP is plaintext; "
            "set server.tls_cert and server.tls_key (or bind 127.0.0.1)",
            field="server.tcp_address")


def tls_credentials(sc: config.ServerConfig) -> grpc.ServerCredentials | None:
    """The TCP listener's TLS credentials (``None``: plaintext), from the PEM files named;
    also refuses a ``server.socket_mode`` other than 0660/0600 (checked before any bind)."""
    if sc.socket_mode not in ("0660", "0600"):
        raise FailedPrecondition(f"server.socket_mode: must be '0660' or '0600', got "
                                 f"{sc.socket_mode!r}", field="server.socket_mode")
    pair = tls_files.missing(sc)
    if pair:
        name, needs = pair
        raise FailedPrecondition(f"server.{needs}: needed with server.{name}",
                                 field=f"server.{needs}")
    if not sc.tls_cert:
        return None
    pem = tls_files.read_pems(sc, "server")
    ca = pem.get("tls_client_ca")
    return grpc.ssl_server_credentials([(pem["tls_key"], pem["tls_cert"])],
                                       root_certificates=ca, require_client_auth=ca is not None)


def set_socket_mode(path: str, mode: str, field: str) -> None:
    """``chmod`` a Unix socket to ``mode`` ("0660"/"0600"): the umask does not decide."""
    try:
        os.chmod(path, int(mode, 8))
    except OSError as exc:
        raise FailedPrecondition(f"{field}: cannot chmod {path}: {exc.strerror}",
                                 field=field) from None


def prepare_dir(path: str, field: str) -> None:
    """The directory of a socket path: created if missing; the per-user runtime directory of
    the defaults is created 0700 and must be this user's and closed to others."""
    parent = Path(path).parent
    private = parent == paths.runtime_dir()
    try:
        if private:
            with contextlib.suppress(FileExistsError):
                os.mkdir(parent, 0o700)
        else:
            parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailedPrecondition(f"{field}: cannot create {parent}: {exc.strerror}",
                                 field=field) from None
    if not private:
        return
    st = os.lstat(parent)
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{field}: {parent} is not a directory", field=field)
    if st.st_uid != os.getuid():
        raise FailedPrecondition(f"{field}: {parent} belongs to uid {st.st_uid}, not to this "
                                 f"user (uid {os.getuid()}): refusing to serve from it",
                                 field=field)
    if st.st_mode & 0o077:
        raise FailedPrecondition(f"{field}: {parent} is open to other users (mode "
                                 f"{stat.S_IMODE(st.st_mode):o}); chmod 700 it", field=field)


def _answers(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # EACCES, a timeout: something is there; do not touch it
            return True
        return True


class SocketClaim:
    """The right to serve on one Unix socket path: ``<path>.lock``, held until ``release``."""

    def __init__(self, path: str, field: str) -> None:
        self.path = path
        self.field = field
        self.lock_path = f"{path}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and clear a stale socket file; ``FailedPrecondition`` when a live
        daemon (or anything else) holds the path."""
        prepare_dir(self.path, self.field)
        for _ in range(20):  # a lock file replaced under us: start over (module docstring)
            fd = self._open_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise FailedPrecondition(
                    f"{self.field}: {self.path} is in use by a running blockd ({holder} holds "
                    f"{self.lock_path}); stop it or set {self.field}", field=self.field) from None
            if self._same_file(fd):
                break
            os.close(fd)
        else:  # pragma: no cover - twenty replacements in a row
            raise FailedPrecondition(f"{self.field}: {self.lock_path} keeps being replaced",
                                     field=self.field)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            self._clear_stale()
        except BaseException:
            self.release(remove_socket=False)
            raise

    def _open_lock(self) -> int:
        try:
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                           0o644)
        except OSError as exc:
            raise FailedPrecondition(f"{self.field}: cannot open {self.lock_path}: "
                                     f"{exc.strerror}", field=self.field) from None

    @staticmethod
    def _holder(fd: int) -> str:
        with contextlib.suppress(OSError, ValueError):
            text = os.pread(fd, 32, 0).decode().strip()
            if text.isdigit():
                return f"pid {int(text)}"
        return "another process"

    def _same_file(self, fd: int) -> bool:
        try:
            now = os.stat(self.lock_path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FailedPrecondition(f"{self.field}: {self.path} exists and is not a socket; "
                                     "refusing to replace it", field=self.field)
        if _answers(self.path):
            raise FailedPrecondition(
                f"{self.field}: {self.path} is in use by a process that does not hold "
                f"{self.lock_path} (an older blockd?); stop it or set {self.field}",
                field=self.field)
        os.unlink(self.path)
        log.info("reclaimed a stale socket", extra=logs.fields(path=self.path))

    def release(self, *, remove_socket: bool = True) -> None:
        """Remove the socket (``remove_socket``) and the lock file, then drop the lock."""
        if self._fd is None:
            return
        if remove_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._same_file(self._fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)
        os.close(self._fd)
        self._fd = None
