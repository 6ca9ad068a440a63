"""Protobuf <-> core conversions and the request bounds the proto documents."""

from __future__ import annotations

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import InvalidArgument
from blockd.core.namespace import PrefixScope
from blockd.core.spec import PoolSpec

MAX_ID_BYTES = 128

DTYPES = {
    pb.KV_DTYPE_FLOAT32: "float32",
    pb.KV_DTYPE_FLOAT16: "float16",
    pb.KV_DTYPE_BFLOAT16: "bfloat16",
    pb.KV_DTYPE_FLOAT8_E4M3: "float8_e4m3",
}
DTYPE_ENUM = {v: k for k, v in DTYPES.items()}
KV_ORDERS = {pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM: "block_token_head_dim"}
KV_ORDER_ENUM = {v: k for k, v in KV_ORDERS.items()}

#: Core field names -> their path inside an operation's proto message.
_SCOPE_FIELDS = {
    "model_id": "namespace.model_id",
    "model_revision": "namespace.model_revision",
    "lora_id": "namespace.lora_id",
    "tokenizer_digest": "namespace.tokenizer_digest",
    "salt": "namespace.cache_salt",
    "namespace": "namespace",
}


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
    if layout.dtype not in DTYPES:
        raise InvalidArgument("dtype must be set", field="layout.dtype")
    if layout.kv_order not in KV_ORDERS:
        raise InvalidArgument("kv_order must be set", field="layout.kv_order")
    try:
        return PoolSpec(block_size=layout.block_size, num_blocks=num_blocks,
                        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                        head_dim=layout.head_dim, dtype=DTYPES[layout.dtype],
                        kv_order=KV_ORDERS[layout.kv_order], tp_size=layout.tp_size)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, field=f"layout.{exc.field}") from None


def layout_of(spec: PoolSpec) -> pb.KvLayout:
    return pb.KvLayout(block_size=spec.block_size, num_layers=spec.num_layers,
                       num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                       dtype=DTYPE_ENUM[spec.dtype], kv_order=KV_ORDER_ENUM[spec.kv_order],
                       tp_size=spec.tp_size)
