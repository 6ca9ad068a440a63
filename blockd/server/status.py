"""The one table from core errors to gRPC status codes."""

from __future__ import annotations

import grpc

from blockd.core.errors import BlockdError, StatusCode

#: core StatusCode -> grpc.StatusCode (same numbering; the table keeps grpc out of the core).
GRPC_STATUS: dict[StatusCode, grpc.StatusCode] = {
    StatusCode(code.value[0]): code for code in grpc.StatusCode
}


def grpc_status(err: BlockdError) -> grpc.StatusCode:
    return GRPC_STATUS[err.status]


def details(err: BlockdError) -> str:
    """The status message: names the field at fault first, so clients can match on it."""
    return f"{err.field}: {err.message}" if err.field else err.message
