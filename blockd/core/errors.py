"""The one error hierarchy of blockd.

Every error carries the gRPC status it maps to (as a :class:`StatusCode` mirroring gRPC's
numbering, so the core stays free of grpc imports) and, where a request field is at fault, the
field's name. The server has a single table from ``StatusCode`` to ``grpc.StatusCode``; nothing
else decides status codes.

NOTE: "does not fit" is *not* an exception inside the allocator (see ``DoesNotFit`` in
``blockd.core.manager``); the manager turns it into :class:`ResourceExhausted` only at the API
boundary, so the hot path never pays for raising.
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """gRPC status code numbers (https://grpc.github.io/grpc/core/md_doc_statuscodes.html)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class BlockdError(Exception):
    """Base of every error blockd reports to a caller.

    ``field`` names the request field at fault (``""`` when none is).
    """

    status: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status.name}, {self.message!r}, field={self.field!r})"


class InvalidArgument(BlockdError):
    """Malformed input: a value out of range, a wrong type, a duplicate."""

    status = StatusCode.INVALID_ARGUMENT


class NotFound(BlockdError):
    """An id (sequence, session) that this caller may know about does not exist."""

    status = StatusCode.NOT_FOUND


class PermissionDenied(BlockdError):
    """The object belongs to another tenant or session."""

    status = StatusCode.PERMISSION_DENIED


class Unauthenticated(BlockdError):
    """A missing or unknown credential."""

    status = StatusCode.UNAUTHENTICATED


class ResourceExhausted(BlockdError):
    """The pool or a tenant's quota cannot hold the request. ``reason`` is a bounded label."""

    status = StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, reason: str, field: str = "") -> None:
        super().__init__(message, field=field)
        self.reason = reason


class FailedPrecondition(BlockdError):
    """A stale epoch, a layout mismatch, an operation not valid in the object's current state."""

    status = StatusCode.FAILED_PRECONDITION


class Aborted(BlockdError):
    """The operation names a sequence the daemon preempted for a higher-priority request: it
    no longer exists, and the worker must re-admit it (its prompt plus what it generated)."""

    status = StatusCode.ABORTED


class Unavailable(BlockdError):
    """The daemon is draining or not ready."""

    status = StatusCode.UNAVAILABLE


class Internal(BlockdError):
    """A broken invariant: a bug in blockd, never the caller's fault."""

    status = StatusCode.INTERNAL
