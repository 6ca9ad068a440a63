"""The block-manager core: pure Python (+ numpy at most), no grpc, torch or cuda.

All policy lives here and is tested on the CPU; the server only converts protobuf to these calls.
"""

from blockd.core.allocator import STATE_NAMES, BlockAllocator
from blockd.core.errors import (
    Aborted,
    BlockdError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StatusCode,
    Unauthenticated,
    Unavailable,
)
from blockd.core.manager import (
    AdmitResult,
    AppendResult,
    BlockManager,
    CopyOp,
    DoesNotFit,
    PositionInfo,
)
from blockd.core.namespace import NamespaceFields, PrefixScope
from blockd.core.spec import PoolSpec
from blockd.core.tenants import Sharing, TenantPolicy

__all__ = [
    "STATE_NAMES",
    "Aborted",
    "AdmitResult",
    "AppendResult",
    "BlockAllocator",
    "BlockManager",
    "BlockdError",
    "CopyOp",
    "DoesNotFit",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NamespaceFields",
    "NotFound",
    "PermissionDenied",
    "PoolSpec",
    "PositionInfo",
    "PrefixScope",
    "ResourceExhausted",
    "Sharing",
    "StatusCode",
    "TenantPolicy",
    "Unauthenticated",
    "Unavailable",
]
