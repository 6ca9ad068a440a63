"""The one call loop of the sync and asyncio clients: deadlines, and retries on UNAVAILABLE.

Every call has an explicit deadline. UNAVAILABLE (the daemon restarting, a connection reset) is
retried with full-jitter exponential backoff, at least ``retries`` times and for as long as the
reconnect window (``reconnect_s`` from the first failure) is open: a daemon killed and restarted
by its supervisor comes back within it. UNAUTHENTICATED is retried once, at once, when the
credential comes from a token file (``Credential``): the file is read again first, so a worker
whose Kubernetes Secret was rotated picks up the new token the first time the daemon refuses the
old one. Nothing else is retried; every other error becomes a ``BlockdError``.

The loop is written once, as ``RetryPolicy.attempts()`` plus the ``Attempt`` context manager,
which decides, sleeps and re-raises; the sync and asyncio callers differ only in ``with`` vs
``async with``::

    for attempt in policy.attempts():
        with attempt:                      # async with attempt:  (in AsyncClient)
            return method(request, metadata=..., timeout=policy.deadline(timeout))
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from blockd_client.errors import BlockdError

__all__ = ["Attempt", "Backoff", "Credential", "MAX_MESSAGE", "MAX_TOKEN_BYTES", "RetryPolicy",
           "TOKEN_FILE_ENV", "auth_metadata", "channel_options", "read_token_file"]

log = logging.getLogger(__name__)

MAX_MESSAGE = 16 * 1024 * 1024
#: The environment variable naming the token file when a client is given no credential.
TOKEN_FILE_ENV = "BLOCKD_TOKEN_FILE"
#: A token file larger than this is refused: it is the wrong file, not a bearer token.
MAX_TOKEN_BYTES = 4096


def channel_options() -> list[tuple[str, Any]]:
    """gRPC channel options of every client channel (the daemon's default message limit)."""
    return [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE)]


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying a worker credential (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The bearer token a file holds: one printable ASCII word, optionally followed by a newline
    (``kubectl create secret --from-file`` keeps the file's newline, ``--from-literal`` adds
    none). Raises ``ValueError`` starting with ``token_file:`` and naming the path otherwise,
    so a wrong mount or a wrong file is reported as such rather than as UNAUTHENTICATED."""
    where = f"token_file: {os.fspath(path)}"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"{where}: larger than {MAX_TOKEN_BYTES} bytes, not a bearer token")
    token = raw.strip(b" \t\r\n")
    if not token:
        raise ValueError(f"{where}: empty, no token in it")
    if any(b < 0x21 or b > 0x7E for b in token):
        raise ValueError(f"{where}: the token must be one word of printable ASCII (no spaces, "
                         f"control characters or non-ASCII bytes inside it)")
    return token.decode("ascii")


class Credential:
    """A connection's bearer token: a fixed string, or the content of a token file.

    Why a file: in Kubernetes the worker's token is a Secret projected into the container as a
    file, which the kubelet replaces in place (an atomic symlink swap) when the Secret changes;
    an environment variable would keep the old token until the container restarts. The file is
    read once here, so a missing or malformed file fails the constructor, and again by
    ``reload`` when the daemon answers UNAUTHENTICATED (the retry loop and the step stream do),
    never per call.

    ``token`` and ``token_file`` exclude each other; with neither, ``$BLOCKD_TOKEN_FILE`` (when
    set and not empty) names the file, else there is no credential (an anonymous caller).
    """

    def __init__(self, token: str = "", token_file: str | os.PathLike[str] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        if token and token_file is not None:
            raise ValueError("token_file: give a token or a token_file, not both")
        if not token and token_file is None:
            token_file = (os.environ if environ is None else environ).get(TOKEN_FILE_ENV) or None
        self.path = Path(token_file) if token_file is not None else None
        self._lock = threading.Lock()
        self._token = read_token_file(self.path) if self.path is not None else token
        self.metadata = auth_metadata(self._token)

    @property
    def from_file(self) -> bool:
        return self.path is not None

    def reload(self) -> bool:
        """Read the token file again; True when it was read (the caller may retry with
        ``metadata`` now). A file that cannot be read keeps the previous token (logged)."""
        if self.path is None:
            return False
        try:
            token = read_token_file(self.path)
        except ValueError as exc:
            log.warning("keeping the previous token: %s", exc)
            return False
        with self._lock:
            if token != self._token:
                self._token = token
                self.metadata = auth_metadata(token)
                log.info("token file re-read: the token changed")
        return True


class Backoff:
    """Retry pacing: full-jitter exponential delays, at least ``retries`` of them and more
    until ``reconnect_s`` seconds have passed since the first failure."""

    def __init__(self, retries: int, base: float, reconnect_s: float, cap: float = 1.0) -> None:
        self.retries = retries
        self.base = base
        self.cap = cap
        self.deadline = time.monotonic() + reconnect_s
        self.attempt = 0

    def next_delay(self) -> float | None:
        """Seconds to sleep before the next try, or None: give up."""
        if self.attempt >= self.retries and time.monotonic() >= self.deadline:
            return None
        delay = random.uniform(0, min(self.cap, self.base * 2 ** min(self.attempt, 16)))
        self.attempt += 1
        return delay


@dataclass(frozen=True)
class RetryPolicy:
    """How long one call may take and how UNAVAILABLE is retried (see the module docstring).

    ``timeout``: the deadline of each call, seconds. ``retries``: retries on UNAVAILABLE at
    least, however short the reconnect window. ``backoff``: the first delay's bound, seconds
    (doubled per retry, capped at 1 s, fully jittered). ``reconnect_s``: seconds from the first
    failure during which UNAVAILABLE is still retried.
    """

    timeout: float = 10.0
    retries: int = 6
    backoff: float = 0.05
    reconnect_s: float = 30.0

    def deadline(self, timeout: float | None = None) -> float:
        """The deadline of one call: ``timeout`` when given, else the policy's."""
        return self.timeout if timeout is None else timeout

    def backoff_clock(self) -> Backoff:
        """A fresh pacing for one call's retries (started at its first failure)."""
        return Backoff(self.retries, self.backoff, self.reconnect_s)

    def attempts(self, credential: Credential | None = None) -> Iterator[Attempt]:
        """Endless attempts of one call; an ``Attempt`` ends the loop by raising (or the body by
        returning). With a ``credential`` from a token file, UNAUTHENTICATED re-reads the file
        and retries once; the body must read ``credential.metadata`` in every attempt."""
        state = _CallState(self, credential)
        while True:
            yield Attempt(state)


class _CallState:
    """One call's retry state, shared by its attempts."""

    __slots__ = ("backoff", "credential", "policy", "reauthenticated")

    def __init__(self, policy: RetryPolicy, credential: Credential | None = None) -> None:
        self.policy = policy
        self.credential = credential
        self.backoff: Backoff | None = None
        self.reauthenticated = False

    def delay_after(self, err: grpc.RpcError) -> float:
        """Seconds to wait before retrying after ``err``; raises its BlockdError when the call
        must not be (or may no longer be) retried."""
        if (err.code() == grpc.StatusCode.UNAUTHENTICATED and self.credential is not None
                and not self.reauthenticated):
            # Once per call: a token that is still refused after re-reading is wrong, not stale.
            self.reauthenticated = True
            if self.credential.reload():
                return 0.0
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            self.backoff = self.backoff or self.policy.backoff_clock()
            delay = self.backoff.next_delay()
            if delay is not None:
                return delay
        raise BlockdError.from_rpc(err) from None


class Attempt:
    """One try of a call: a context manager that swallows a retryable failure after sleeping
    its backoff (sync or asyncio), and turns any other RPC error into a ``BlockdError``."""

    __slots__ = ("_state",)

    def __init__(self, state: _CallState) -> None:
        self._state = state

    def _delay(self, exc: BaseException | None) -> float | None:
        if not isinstance(exc, grpc.RpcError):
            return None  # success, or not an RPC failure: let it through untouched
        return self._state.delay_after(exc)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        delay = self._delay(exc)
        if delay is not None:
            time.sleep(delay)
        return delay is not None

    async def __aenter__(self) -> Attempt:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        delay = self._delay(exc)
        if delay is not None:
            await asyncio.sleep(delay)
        return delay is not None
