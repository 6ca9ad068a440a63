"""The block-manager core: pure Python (+ numpy at most), no grpc, torch or cuda.

All policy lives here and is tested on the CPU. ``BlockManager`` (manager.py) is the facade
over rooms of one concept each (blocks, caching, admission, fences, preemption, invariants...);
the runtime above it calls the facade and reads its result records, never the rooms.
"""

from blockd.core.blocks import STATE_NAMES, BlockArrays
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
from blockd.core.events import AllBlocksCleared, BlockRemoved, BlockStored, CoreEvent, EventSink
from blockd.core.ids import SequenceIds
from blockd.core.manager import BlockManager
from blockd.core.namespace import NamespaceFields, PrefixScope
from blockd.core.results import (
    AdmitResult,
    AppendResult,
    BatchAppend,
    BlockInfo,
    CopyOp,
    DoesNotFit,
    PositionInfo,
    SessionView,
    TenantUsage,
)
from blockd.core.spec import PoolSpec
from blockd.core.tenants import Sharing, TenantPolicy

__all__ = [
    "STATE_NAMES",
    "Aborted",
    "AdmitResult",
    "AllBlocksCleared",
    "AppendResult",
    "BatchAppend",
    "BlockArrays",
    "BlockInfo",
    "BlockManager",
    "BlockRemoved",
    "BlockStored",
    "CoreEvent",
    "EventSink",
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
    "SequenceIds",
    "SessionView",
    "Sharing",
    "StatusCode",
    "TenantPolicy",
    "TenantUsage",
    "Unauthenticated",
    "Unavailable",
]
