"""The one call loop of the sync and asyncio clients: deadlines, and retries on UNAVAILABLE.

Every call has an explicit deadline. UNAVAILABLE (the daemon restarting, a connection reset) is
retried with full-jitter exponential backoff, at least ``retries`` times and for as long as the
reconnect window (``reconnect_s`` from the first failure) is open: a daemon killed and restarted
by its supervisor comes back within it. Nothing else is retried; every other error becomes a
``BlockdError``.

The loop is written once, as ``RetryPolicy.attempts()`` plus the ``Attempt`` context manager,
which decides, sleeps and re-raises; the sync and asyncio callers differ only in ``with`` vs
``async with``::

    for attempt in policy.attempts():
        with attempt:                      # async with attempt:  (in AsyncClient)
            return method(request, metadata=..., timeout=policy.deadline(timeout))
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from blockd_client.errors import BlockdError

__all__ = ["Attempt", "Backoff", "MAX_MESSAGE", "RetryPolicy", "auth_metadata",
           "channel_options"]

MAX_MESSAGE = 16 * 1024 * 1024


def channel_options() -> list[tuple[str, Any]]:
    """gRPC channel options of every client channel (the daemon's default message limit)."""
    return [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE)]


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying a worker credential (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


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

    def attempts(self) -> Iterator[Attempt]:
        """Endless attempts of one call; an ``Attempt`` ends the loop by raising (or the body by
        returning)."""
        state = _CallState(self)
        while True:
            yield Attempt(state)


class _CallState:
    """One call's retry state, shared by its attempts."""

    __slots__ = ("backoff", "policy")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.backoff: Backoff | None = None

    def delay_after(self, err: grpc.RpcError) -> float:
        """Seconds to wait before retrying after ``err``; raises its BlockdError when the call
        must not be (or may no longer be) retried."""
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
