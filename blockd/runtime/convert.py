"""The one place protobuf meets the core: requests become core arguments, and core results,
events and errors become protobuf messages.

Request side: the bounds the proto documents (id lengths, namespace fields) and the worker's
declared layout. Result side: every core result type (``blockd.core.results``) has one
function here, and ``operation_status`` is the only code that turns a ``DoesNotFit`` or a
``BlockdError`` into an ``OperationStatus``. Whole-RPC errors become gRPC statuses in
``blockd.server.status`` (the runtime never imports grpc).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from blockd import wire
from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import BlockdError, InvalidArgument, ResourceExhausted, StatusCode
from blockd.core.namespace import PrefixScope
from blockd.core.results import (
    AdmitResult,
    AppendResult,
    BatchAppend,
    BlockInfo,
    CopyOp,
    DoesNotFit,
    PositionInfo,
    SequenceSummary,
    TenantUsage,
)
from blockd.core.spec import PoolSpec
from blockd.core.tenants import TenantPolicy
from blockd.runtime.events import CLEARED, REMOVED, STORED, Event, medium_of

MAX_ID_BYTES = 128


#: Core field names -> their path inside an operation's proto message.
_SCOPE_FIELDS = {
    "model_id": "namespace.model_id",
    "model_revision": "namespace.model_revision",
    "lora_id": "namespace.lora_id",
    "tokenizer_digest": "namespace.tokenizer_digest",
    "salt": "namespace.cache_salt",
    "namespace": "namespace",
}

#: Block state names of ``BlockInfo.state`` -> the proto enum.
_BLOCK_STATES = {name: getattr(pb, f"BLOCK_STATE_{name.upper()}")
                 for name in ("free", "writing", "committed", "pending", "cached")}


# -- requests ----------------------------------------------------------------------------------


def proto_field(field: str) -> str:
    return _SCOPE_FIELDS.get(field, field)


def check_id(value: str, field: str, required: bool = True) -> str:
    if required and not value:
        raise InvalidArgument("must not be empty", field=field)
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise InvalidArgument(f"longer than {MAX_ID_BYTES} bytes", field=field)
    return value


def scope(ns: pb.CacheNamespace, field: str = "namespace") -> PrefixScope:
    """A request's CacheNamespace as a core PrefixScope (presence kept: unset != empty)."""
    check_id(ns.model_id, f"{field}.model_id")
    revision = ns.model_revision if ns.HasField("model_revision") else None
    lora = ns.lora_id if ns.HasField("lora_id") else None
    if revision is not None:
        check_id(revision, f"{field}.model_revision", required=False)
    if lora is not None:
        check_id(lora, f"{field}.lora_id", required=False)
    digest = ns.tokenizer_digest if ns.HasField("tokenizer_digest") else None
    if digest is not None and len(digest) > 64:
        raise InvalidArgument("longer than 64 bytes", field=f"{field}.tokenizer_digest")
    salt = ns.cache_salt if ns.HasField("cache_salt") else None
    if salt is not None and len(salt) > 64:
        raise InvalidArgument("longer than 64 bytes", field=f"{field}.cache_salt")
    return PrefixScope(ns.model_id, revision, lora, digest, salt)


def spec_from_layout(layout: pb.KvLayout, num_blocks: int) -> PoolSpec:
    """The layout a worker declares, as a PoolSpec (errors name the layout field)."""
    try:
        dtype = wire.dtype_from_proto(layout.dtype)
        kv_order = wire.kv_order_from_proto(layout.kv_order)
    except wire.WireError as exc:
        raise InvalidArgument(exc.problem, field=f"layout.{exc.field}") from None
    try:
        return PoolSpec(block_size=layout.block_size, num_blocks=num_blocks,
                        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                        head_dim=layout.head_dim, dtype=dtype, kv_order=kv_order,
                        tp_size=layout.tp_size)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field=f"layout.{exc.field}") from None


# -- the pool and tenants ----------------------------------------------------------------------


def layout_of(spec: PoolSpec) -> pb.KvLayout:
    return pb.KvLayout(block_size=spec.block_size, num_layers=spec.num_layers,
                       num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                       dtype=cast(pb.KvDtype, wire.dtype_to_proto(spec.dtype)),
                       kv_order=cast(pb.KvOrder, wire.kv_order_to_proto(spec.kv_order)),
                       tp_size=spec.tp_size)


def pool_info(spec: PoolSpec, medium: str, handle_socket: str) -> pb.PoolInfo:
    """What Attach tells a worker about the pool; ``medium`` is "GPU" or "CPU"."""
    backend = next(enum for enum, m in wire.BACKENDS.values() if m == medium)
    return pb.PoolInfo(layout=layout_of(spec), num_blocks=spec.num_blocks,
                       block_bytes=spec.block_bytes, backend=cast(pb.PoolBackend, backend),
                       handle_socket_path=handle_socket)


def sharing_kind(policy: TenantPolicy) -> pb.SharingDomainKind:
    kind: pb.SharingDomainKind = getattr(pb, f"SHARING_DOMAIN_KIND_{policy.sharing.name}")
    return kind


def tenant_usage(u: TenantUsage) -> pb.TenantUsage:
    return pb.TenantUsage(tenant_id=u.tenant_id, used_blocks=u.used_blocks,
                          quota_blocks=u.quota_blocks, guaranteed_blocks=u.guaranteed_blocks,
                          cached_blocks=u.cached_blocks)


# -- Step results ------------------------------------------------------------------------------


def operation_status(st: pb.OperationStatus, err: BlockdError | DoesNotFit, field: str) -> None:
    """The status of a failed operation or batch entry: a ``DoesNotFit`` names its reason in
    ``field`` (the proto's rule for RESOURCE_EXHAUSTED); an error names ``field``, the path of
    the request field at fault."""
    if isinstance(err, DoesNotFit):
        st.code = StatusCode.RESOURCE_EXHAUSTED
        st.message = (f"does not fit ({err.reason}): needs {err.needed} {err.unit}, "
                      f"{err.available} available")
        st.field = err.reason
    elif isinstance(err, ResourceExhausted):
        # The proto's rule: a RESOURCE_EXHAUSTED status names the limit, not a field.
        st.code = err.status
        st.message = err.message
        st.field = err.reason
    else:
        st.code = err.status
        st.message = err.message
        st.field = field


def status_name(code: int) -> str:
    """The name of a status code number, e.g. ``"RESOURCE_EXHAUSTED"`` (a metric label)."""
    return StatusCode(code).name


def admit_result(r: pb.AdmitResult, out: AdmitResult, request_id: str) -> None:
    r.sequence_id = out.seq_id
    r.request_id = request_id
    r.num_cached_tokens = out.num_cached_tokens
    r.block_table.extend(out.block_table)
    r.num_tokens = out.num_tokens


def _copy(copies: Any, copy: CopyOp | None) -> None:
    if copy is not None:
        copies.add(src_block=copy.src, dst_block=copy.dst)


def append_result(r: pb.AppendResult, sequence_id: str, out: AppendResult, copies: Any) -> None:
    """``copies``: the StepResponse's ``copies`` field, where a copy-on-write copy goes."""
    r.sequence_id = sequence_id
    r.delta.start_index = out.start_index
    r.delta.block_ids.extend(out.block_ids)
    r.num_tokens = out.num_tokens
    _copy(copies, out.copy)


def append_batch_result(r: pb.AppendBatchResult, out: BatchAppend, field_prefix: str,
                        copies: Any) -> list[int]:
    """Fills ``r``; returns the status code of every failed entry (for the error counters)."""
    r.num_tokens.extend(out.num_tokens)
    for i, res in out.deltas:
        d = r.deltas.add(index=i).delta
        d.start_index = res.start_index
        d.block_ids.extend(res.block_ids)
        _copy(copies, res.copy)
    codes = []
    for i, err in out.errors:
        st = r.errors.add(index=i).status
        operation_status(st, err, f"{field_prefix}sequence_ids[{i}]")
        codes.append(st.code)
    return codes


# -- queries -----------------------------------------------------------------------------------


def inspect_response(resp: pb.InspectResponse, positions: Iterable[PositionInfo],
                     blocks: Iterable[BlockInfo]) -> pb.InspectResponse:
    """``blocks``: the sequence's table in logical order."""
    for p in positions:
        resp.positions.add(position=p.position, logical_block=p.logical_block, offset=p.offset,
                           physical_block=p.physical_block, slot=p.slot)
    for lb, b in enumerate(blocks):
        resp.blocks.add(logical_block=lb, physical_block=b.block,
                        state=_BLOCK_STATES[b.state], ref_count=b.ref_count,
                        shared=b.ref_count > 1)
    return resp


def sequence_summary(s: SequenceSummary, worker_name: str) -> pb.SequenceSummary:
    return pb.SequenceSummary(sequence_id=s.seq_id, session_id=s.session_id,
                              tenant_id=s.tenant_id, worker_name=worker_name,
                              num_tokens=s.num_tokens, num_blocks=s.num_blocks)


def watch_event(ev: Event, *, epoch: int, block_size: int, medium: str
                ) -> pb.WatchEventsResponse:
    """``medium``: the pool's; an event of a lower tier carries that tier's."""
    out = pb.WatchEventsResponse(sequence_number=ev.seq, epoch=epoch)
    medium = medium_of(ev.tier, medium)
    if ev.kind == STORED:
        tokens = memoryview(ev.token_bytes).cast("I").tolist() if ev.token_bytes else []
        out.block_stored.CopyFrom(pb.BlockStored(
            block_hashes=list(ev.block_hashes), parent_block_hash=ev.parent_hash,
            token_ids=tokens, block_size=block_size, lora_id=ev.lora_id, medium=medium,
            namespace=ev.namespace))
    elif ev.kind == REMOVED:
        out.block_removed.CopyFrom(pb.BlockRemoved(block_hashes=list(ev.block_hashes),
                                                   medium=medium))
    elif ev.kind == CLEARED:
        out.all_blocks_cleared.SetInParent()
    return out
