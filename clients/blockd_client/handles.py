"""The worker's side of the daemon's handle socket: one session's header and descriptors.

The protocol, the header's keys and the fd order are ``blockd.wire``'s (the daemon's side is
``blockd.pools.handles``): the request is ``handle_wire.encode_request``, the answer one JSON line
parsed as a ``handle_wire.HandleHeader`` plus the descriptors over SCM_RIGHTS. Whatever goes wrong
after the descriptors arrived, they are closed before the error propagates: a refused or
malformed answer never leaks an fd (a GPU allocation stays alive as long as one is open).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence

from blockd import handle_wire

__all__ = ["fetch_handles", "parse_answer"]


def fetch_handles(path: str, session_id: str, fetch_secret: str, timeout: float = 10.0,
                  tenant_id: str = "") -> tuple[handle_wire.HandleHeader, list[int]]:
    """Ask the handle socket at ``path`` for a session's header and descriptors (those of the
    pool partition the session's tenant lives in; with ``tenant_id``, the daemon also checks
    that the session is that tenant's). ``fetch_secret`` is the session's
    ``AttachResponse.fetch_secret``: without it the daemon answers NOT_FOUND, as it does for a
    session it does not know.

    The descriptors are in ``header.split_fds`` order and owned by the caller. Raises
    ``handle_wire.HandleRefused`` (a ConnectionError) when the daemon refuses, ``wire.WireError``
    (a ValueError naming the key) for an answer outside the contract.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        # Refused before the request was read (the peer check): the answer says why.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(handle_wire.encode_request(session_id, fetch_secret, tenant_id))
        buf, fds, _flags, _addr = socket.recv_fds(s, handle_wire.MAX_ANSWER_BYTES,
                                                  handle_wire.MAX_FDS)
        try:
            while not buf.endswith(b"\n") and len(buf) < handle_wire.MAX_ANSWER_BYTES:
                more = s.recv(handle_wire.MAX_ANSWER_BYTES)
                if not more:
                    break
                buf += more
        except BaseException:
            _close(fds)
            raise
    return parse_answer(buf, fds)


def parse_answer(answer: bytes, fds: Sequence[int]) -> tuple[handle_wire.HandleHeader, list[int]]:
    """The header of an answer line and its descriptors, checked against each other (count and
    order); on any error every descriptor is closed."""
    try:
        if not answer.strip():
            raise ConnectionError("the daemon closed the handle socket without an answer")
        header = handle_wire.decode_answer(answer)
        header.split_fds(fds)
    except BaseException:
        _close(fds)
        raise
    return header, list(fds)


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
