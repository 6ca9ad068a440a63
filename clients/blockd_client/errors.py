"""The client's one error type."""

from __future__ import annotations

import grpc

#: Statuses after which a call's fate is unknown: the daemon may have applied it and its answer
#: was lost (a deadline passed, a connection dropped, the call was cancelled), or never got it.
UNANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})


class BlockdError(Exception):
    """A call to blockd failed. ``status`` is the gRPC status; ``field`` the request field at
    fault when the daemon named one (its status message starts with ``field: ``)."""

    def __init__(self, status: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.field = field

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> BlockdError:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = (err.details() if hasattr(err, "details") else str(err)) or ""
        field, sep, rest = details.partition(": ")
        if sep and field and " " not in field:
            return cls(code, rest, field)
        return cls(code, details)


class EpochChanged(BlockdError):
    """The daemon's pool epoch changed (it restarted or re-created the pool).

    The client has already re-attached and re-mapped the pool; every sequence and block id of
    the old epoch is gone, so the engine must re-admit its requests.
    """

    def __init__(self, old: int, new: int) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         f"pool epoch changed from {old} to {new}: re-admit sequences", "epoch")
        self.old = old
        self.new = new
