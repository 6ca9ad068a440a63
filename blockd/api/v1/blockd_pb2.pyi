from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT8_E4M3: _ClassVar[KvDtype]

class KvOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ORDER_UNSPECIFIED: _ClassVar[KvOrder]
    KV_ORDER_BLOCK_TOKEN_HEAD_DIM: _ClassVar[KvOrder]

class PoolBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_BACKEND_UNSPECIFIED: _ClassVar[PoolBackend]
    POOL_BACKEND_HOST_SHM: _ClassVar[PoolBackend]
    POOL_BACKEND_CUDA_VMM: _ClassVar[PoolBackend]

class SharingDomainKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARING_DOMAIN_KIND_UNSPECIFIED: _ClassVar[SharingDomainKind]
    SHARING_DOMAIN_KIND_PRIVATE: _ClassVar[SharingDomainKind]
    SHARING_DOMAIN_KIND_GROUP: _ClassVar[SharingDomainKind]
    SHARING_DOMAIN_KIND_PUBLIC: _ClassVar[SharingDomainKind]

class BlockState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATE_UNSPECIFIED: _ClassVar[BlockState]
    BLOCK_STATE_FREE: _ClassVar[BlockState]
    BLOCK_STATE_WRITING: _ClassVar[BlockState]
    BLOCK_STATE_COMMITTED: _ClassVar[BlockState]
    BLOCK_STATE_PENDING: _ClassVar[BlockState]
    BLOCK_STATE_CACHED: _ClassVar[BlockState]
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
KV_DTYPE_FLOAT8_E4M3: KvDtype
KV_ORDER_UNSPECIFIED: KvOrder
KV_ORDER_BLOCK_TOKEN_HEAD_DIM: KvOrder
POOL_BACKEND_UNSPECIFIED: PoolBackend
POOL_BACKEND_HOST_SHM: PoolBackend
POOL_BACKEND_CUDA_VMM: PoolBackend
SHARING_DOMAIN_KIND_UNSPECIFIED: SharingDomainKind
SHARING_DOMAIN_KIND_PRIVATE: SharingDomainKind
SHARING_DOMAIN_KIND_GROUP: SharingDomainKind
SHARING_DOMAIN_KIND_PUBLIC: SharingDomainKind
BLOCK_STATE_UNSPECIFIED: BlockState
BLOCK_STATE_FREE: BlockState
BLOCK_STATE_WRITING: BlockState
BLOCK_STATE_COMMITTED: BlockState
BLOCK_STATE_PENDING: BlockState
BLOCK_STATE_CACHED: BlockState

class KvLayout(_message.Message):
    __slots__ = ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "kv_order", "tp_size")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_ORDER_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KvDtype
    kv_order: KvOrder
    tp_size: int
    def __init__(self, block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., kv_order: _Optional[_Union[KvOrder, str]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("layout", "num_blocks", "block_bytes", "backend", "handle_socket_path", "fence_page_offset")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HANDLE_SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    FENCE_PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    num_blocks: int
    block_bytes: int
    backend: PoolBackend
    handle_socket_path: str
    fence_page_offset: int
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., backend: _Optional[_Union[PoolBackend, str]] = ..., handle_socket_path: _Optional[str] = ..., fence_page_offset: _Optional[int] = ...) -> None: ...

class CacheNamespace(_message.Message):
    __slots__ = ("model_id", "model_revision", "lora_id", "tokenizer_digest", "cache_salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    lora_id: str
    tokenizer_digest: bytes
    cache_salt: bytes
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., lora_id: _Optional[str] = ..., tokenizer_digest: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("worker_name", "tenant_id", "layout", "lease_ms", "resume_session_id")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    tenant_id: str
    layout: KvLayout
    lease_ms: int
    resume_session_id: str
    def __init__(self, worker_name: _Optional[str] = ..., tenant_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., lease_ms: _Optional[int] = ..., resume_session_id: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session_id", "epoch", "lease_ms", "pool", "tenant_id", "sharing_domain_kind", "fetch_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SHARING_DOMAIN_KIND_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    lease_ms: int
    pool: PoolInfo
    tenant_id: str
    sharing_domain_kind: SharingDomainKind
    fetch_secret: str
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_ms: _Optional[int] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., tenant_id: _Optional[str] = ..., sharing_domain_kind: _Optional[_Union[SharingDomainKind, str]] = ..., fetch_secret: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("num_sequences_released",)
    NUM_SEQUENCES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_sequences_released: int
    def __init__(self, num_sequences_released: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "completed_fence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    completed_fence: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., completed_fence: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires_unix_ms", "epoch")
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix_ms: int
    epoch: int
    def __init__(self, lease_expires_unix_ms: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "step_id", "fence", "completed_fence", "operations")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FENCE_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    step_id: int
    fence: int
    completed_fence: int
    operations: _containers.RepeatedCompositeFieldContainer[Operation]
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., fence: _Optional[int] = ..., completed_fence: _Optional[int] = ..., operations: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("admit", "append", "fork", "release", "commit", "append_batch")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    APPEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    admit: AdmitOp
    append: AppendOp
    fork: ForkOp
    release: ReleaseOp
    commit: CommitOp
    append_batch: AppendBatchOp
    def __init__(self, admit: _Optional[_Union[AdmitOp, _Mapping]] = ..., append: _Optional[_Union[AppendOp, _Mapping]] = ..., fork: _Optional[_Union[ForkOp, _Mapping]] = ..., release: _Optional[_Union[ReleaseOp, _Mapping]] = ..., commit: _Optional[_Union[CommitOp, _Mapping]] = ..., append_batch: _Optional[_Union[AppendBatchOp, _Mapping]] = ...) -> None: ...

class AdmitOp(_message.Message):
    __slots__ = ("request_id", "namespace", "token_ids", "priority", "disable_prefix_cache", "wait_for_remote")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_REMOTE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: CacheNamespace
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    disable_prefix_cache: bool
    wait_for_remote: bool
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[_Union[CacheNamespace, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., disable_prefix_cache: _Optional[bool] = ..., wait_for_remote: _Optional[bool] = ...) -> None: ...

class AppendOp(_message.Message):
    __slots__ = ("sequence_id", "token_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendBatchOp(_message.Message):
    __slots__ = ("sequence_ids", "num_tokens", "token_ids")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForkOp(_message.Message):
    __slots__ = ("sequence_id", "num_children")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    num_children: int
    def __init__(self, sequence_id: _Optional[str] = ..., num_children: _Optional[int] = ...) -> None: ...

class ReleaseOp(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class CommitOp(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "epoch", "results", "copies", "scrubbed_blocks", "preempted")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SCRUBBED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    epoch: int
    results: _containers.RepeatedCompositeFieldContainer[OperationResult]
    copies: _containers.RepeatedCompositeFieldContainer[CopyOp]
    scrubbed_blocks: _containers.RepeatedScalarFieldContainer[int]
    preempted: _containers.RepeatedCompositeFieldContainer[PreemptedSequence]
    def __init__(self, step_id: _Optional[int] = ..., epoch: _Optional[int] = ..., results: _Optional[_Iterable[_Union[OperationResult, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[CopyOp, _Mapping]]] = ..., scrubbed_blocks: _Optional[_Iterable[int]] = ..., preempted: _Optional[_Iterable[_Union[PreemptedSequence, _Mapping]]] = ...) -> None: ...

class PreemptedSequence(_message.Message):
    __slots__ = ("sequence_id", "reason")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    reason: str
    def __init__(self, sequence_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CopyOp(_message.Message):
    __slots__ = ("src_block", "dst_block")
    SRC_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    src_block: int
    dst_block: int
    def __init__(self, src_block: _Optional[int] = ..., dst_block: _Optional[int] = ...) -> None: ...

class OperationStatus(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("status", "admit", "append", "fork", "release", "commit", "append_batch")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    APPEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    status: OperationStatus
    admit: AdmitResult
    append: AppendResult
    fork: ForkResult
    release: ReleaseResult
    commit: CommitResult
    append_batch: AppendBatchResult
    def __init__(self, status: _Optional[_Union[OperationStatus, _Mapping]] = ..., admit: _Optional[_Union[AdmitResult, _Mapping]] = ..., append: _Optional[_Union[AppendResult, _Mapping]] = ..., fork: _Optional[_Union[ForkResult, _Mapping]] = ..., release: _Optional[_Union[ReleaseResult, _Mapping]] = ..., commit: _Optional[_Union[CommitResult, _Mapping]] = ..., append_batch: _Optional[_Union[AppendBatchResult, _Mapping]] = ...) -> None: ...

class AdmitResult(_message.Message):
    __slots__ = ("sequence_id", "request_id", "num_cached_tokens", "block_table", "num_tokens", "pending_remote_blocks")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    request_id: str
    num_cached_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    pending_remote_blocks: int
    def __init__(self, sequence_id: _Optional[str] = ..., request_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., pending_remote_blocks: _Optional[int] = ...) -> None: ...

class BlockTableDelta(_message.Message):
    __slots__ = ("start_index", "block_ids")
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    start_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendResult(_message.Message):
    __slots__ = ("sequence_id", "delta", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    delta: BlockTableDelta
    num_tokens: int
    def __init__(self, sequence_id: _Optional[str] = ..., delta: _Optional[_Union[BlockTableDelta, _Mapping]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AppendBatchResult(_message.Message):
    __slots__ = ("num_tokens", "deltas", "errors")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    deltas: _containers.RepeatedCompositeFieldContainer[IndexedDelta]
    errors: _containers.RepeatedCompositeFieldContainer[IndexedStatus]
    def __init__(self, num_tokens: _Optional[_Iterable[int]] = ..., deltas: _Optional[_Iterable[_Union[IndexedDelta, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[IndexedStatus, _Mapping]]] = ...) -> None: ...

class IndexedDelta(_message.Message):
    __slots__ = ("index", "delta")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    index: int
    delta: BlockTableDelta
    def __init__(self, index: _Optional[int] = ..., delta: _Optional[_Union[BlockTableDelta, _Mapping]] = ...) -> None: ...

class IndexedStatus(_message.Message):
    __slots__ = ("index", "status")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: OperationStatus
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[OperationStatus, _Mapping]] = ...) -> None: ...

class ForkResult(_message.Message):
    __slots__ = ("child_sequence_ids",)
    CHILD_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    child_sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, child_sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResult(_message.Message):
    __slots__ = ("num_blocks_released",)
    NUM_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_released: int
    def __init__(self, num_blocks_released: _Optional[int] = ...) -> None: ...

class CommitResult(_message.Message):
    __slots__ = ("num_blocks_committed",)
    NUM_BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_committed: int
    def __init__(self, num_blocks_committed: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "namespace", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    namespace: CacheNamespace
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., namespace: _Optional[_Union[CacheNamespace, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "num_cached_blocks")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    num_cached_blocks: int
    def __init__(self, num_cached_tokens: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("session_id", "sequence_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence_id: str
    def __init__(self, session_id: _Optional[str] = ..., sequence_id: _Optional[str] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("sequence_id", "epoch", "block_ids", "num_tokens", "block_size")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    epoch: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_size: int
    def __init__(self, sequence_id: _Optional[str] = ..., epoch: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("session_id", "sequence_id", "start_position", "max_positions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequence_id: str
    start_position: int
    max_positions: int
    def __init__(self, session_id: _Optional[str] = ..., sequence_id: _Optional[str] = ..., start_position: _Optional[int] = ..., max_positions: _Optional[int] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("sequence_id", "epoch", "block_size", "num_tokens", "positions", "blocks")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    epoch: int
    block_size: int
    num_tokens: int
    positions: _containers.RepeatedCompositeFieldContainer[PositionInfo]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    def __init__(self, sequence_id: _Optional[str] = ..., epoch: _Optional[int] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[PositionInfo, _Mapping]]] = ..., blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ...) -> None: ...

class PositionInfo(_message.Message):
    __slots__ = ("position", "logical_block", "offset", "physical_block", "slot")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    position: int
    logical_block: int
    offset: int
    physical_block: int
    slot: int
    def __init__(self, position: _Optional[int] = ..., logical_block: _Optional[int] = ..., offset: _Optional[int] = ..., physical_block: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("logical_block", "physical_block", "state", "ref_count", "shared")
    LOGICAL_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    logical_block: int
    physical_block: int
    state: BlockState
    ref_count: int
    shared: bool
    def __init__(self, logical_block: _Optional[int] = ..., physical_block: _Optional[int] = ..., state: _Optional[_Union[BlockState, str]] = ..., ref_count: _Optional[int] = ..., shared: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("epoch", "num_blocks", "block_size", "blocks_free", "blocks_writing", "blocks_committed", "blocks_pending", "blocks_cached", "prefix_queried_tokens_total", "prefix_hit_tokens_total", "evictions_total", "cow_copies_total", "num_sessions", "num_sequences", "tenants", "tiers")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PENDING_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COW_COPIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_blocks: int
    block_size: int
    blocks_free: int
    blocks_writing: int
    blocks_committed: int
    blocks_pending: int
    blocks_cached: int
    prefix_queried_tokens_total: int
    prefix_hit_tokens_total: int
    evictions_total: int
    cow_copies_total: int
    num_sessions: int
    num_sequences: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., blocks_free: _Optional[int] = ..., blocks_writing: _Optional[int] = ..., blocks_committed: _Optional[int] = ..., blocks_pending: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., prefix_queried_tokens_total: _Optional[int] = ..., prefix_hit_tokens_total: _Optional[int] = ..., evictions_total: _Optional[int] = ..., cow_copies_total: _Optional[int] = ..., num_sessions: _Optional[int] = ..., num_sequences: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "num_slots", "used_slots", "slot_bytes", "hit_tokens_total", "stored_blocks_total", "loaded_blocks_total", "load_failures_total")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    tier: str
    num_slots: int
    used_slots: int
    slot_bytes: int
    hit_tokens_total: int
    stored_blocks_total: int
    loaded_blocks_total: int
    load_failures_total: int
    def __init__(self, tier: _Optional[str] = ..., num_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., hit_tokens_total: _Optional[int] = ..., stored_blocks_total: _Optional[int] = ..., loaded_blocks_total: _Optional[int] = ..., load_failures_total: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant_id", "used_blocks", "quota_blocks", "guaranteed_blocks", "cached_blocks")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    used_blocks: int
    quota_blocks: int
    guaranteed_blocks: int
    cached_blocks: int
    def __init__(self, tenant_id: _Optional[str] = ..., used_blocks: _Optional[int] = ..., quota_blocks: _Optional[int] = ..., guaranteed_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_sequence",)
    SINCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    since_sequence: int
    def __init__(self, since_sequence: _Optional[int] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("sequence_number", "epoch", "block_stored", "block_removed", "all_blocks_cleared")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    epoch: int
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, sequence_number: _Optional[int] = ..., epoch: _Optional[int] = ..., block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "namespace")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_id: str
    medium: str
    namespace: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[str] = ..., medium: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushNamespaceRequest(_message.Message):
    __slots__ = ("model_id", "model_revision", "lora_id", "tenant_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    lora_id: str
    tenant_id: str
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., lora_id: _Optional[str] = ..., tenant_id: _Optional[str] = ...) -> None: ...

class FlushNamespaceResponse(_message.Message):
    __slots__ = ("num_blocks_flushed",)
    NUM_BLOCKS_FLUSHED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_flushed: int
    def __init__(self, num_blocks_flushed: _Optional[int] = ...) -> None: ...

class ListSequencesRequest(_message.Message):
    __slots__ = ("tenant_id", "page_size", "page_token")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    page_size: int
    page_token: str
    def __init__(self, tenant_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSequencesResponse(_message.Message):
    __slots__ = ("epoch", "block_size", "sequences", "next_page_token", "tenant_ids", "admin")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENANT_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    block_size: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceSummary]
    next_page_token: str
    tenant_ids: _containers.RepeatedScalarFieldContainer[str]
    admin: bool
    def __init__(self, epoch: _Optional[int] = ..., block_size: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., tenant_ids: _Optional[_Iterable[str]] = ..., admin: _Optional[bool] = ...) -> None: ...

class SequenceSummary(_message.Message):
    __slots__ = ("sequence_id", "session_id", "tenant_id", "worker_name", "num_tokens", "num_blocks")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    session_id: str
    tenant_id: str
    worker_name: str
    num_tokens: int
    num_blocks: int
    def __init__(self, sequence_id: _Optional[str] = ..., session_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., worker_name: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...
