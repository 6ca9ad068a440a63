"""The contract outside the proto: layout names and rules, the handle header, the fence page.

Everything a daemon and its workers must agree on that ``proto/blockd/v1/blockd.proto`` does not
carry is written here once; ``blockd.core.spec``, ``blockd.config``, ``blockd.pools``,
``blockd_gpu.layout`` and ``blockd_client`` all read it from here, and
``tests/test_wire_conformance.py`` checks that the proto, this module, ``PoolSpec``, the config
and ``KvLayout`` agree.

Pure Python on purpose (no grpc, protobuf, torch or cuda): the core and the kernels package
import it. Enum numbers of the proto are written as ints for that reason; the conformance test
compares them with the generated module.

The decisions, recorded here once:

- Block sizes are powers of two from 1 to ``MAX_BLOCK_SIZE`` (256). The Triton kernels take
  the block size as a ``tl.constexpr`` and compute ``t // BLOCK_SIZE`` and ``t % BLOCK_SIZE``
  per token (a shift and a mask for powers of two), and they are tested on powers of two only
  (8..256, docs/kernels.md); vLLM's block sizes (1, 8, 16, 32, 64, 128) are all powers of two;
  256 was already the daemon's bound.
- ``float8_e4m3`` is in the proto but refused everywhere (``REFUSED_DTYPES``): the kernels have
  no FP8 path (no scales), so a daemon must not start a pool no worker can attach to.
- Every name is its proto enum value's name without the prefix, lower-cased
  (``KV_DTYPE_BFLOAT16`` -> ``"bfloat16"``, ``KV_ORDER_BLOCK_TOKEN_HEAD_DIM`` ->
  ``"block_token_head_dim"``): one rule, which extends to any value the proto adds. Kernel
  vocabulary is accepted as aliases (``"bf16"``; ``"NHD"``, FlashInfer's and vLLM's name for
  the same per-layer order) and normalised to the canonical name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

__all__ = [
    "BACKENDS", "DTYPES", "DTYPE_ALIASES", "DTYPE_BYTES", "FENCE_PAGE_BYTES", "HandleHeader",
    "HandleRefused", "KV_ORDER", "KV_ORDERS", "KV_ORDER_ALIASES", "MAX_ANSWER_BYTES",
    "MAX_BLOCK_SIZE", "MAX_FDS", "MAX_NUM_BLOCKS", "MAX_REQUEST_BYTES", "REFUSED_DTYPES",
    "Shape", "WireError", "block_bytes", "canonical_dtype", "canonical_kv_order",
    "MAX_REQUEST_DEPTH", "check_block_size", "check_count", "decode_answer",
    "decode_handle_request", "decode_request", "dtype_from_proto",
    "dtype_to_proto", "encode_refusal", "encode_request", "kv_order_from_proto",
    "kv_order_to_proto", "medium_of", "pool_bytes", "read_fence", "run_bytes", "token_bytes",
    "write_fence",
]


class WireError(ValueError):
    """A value outside the contract. ``field`` names it; the message starts with that name.

    A ValueError so that kernel code (which knows no blockd error classes) raises the familiar
    type; the core and the config turn it into ``InvalidArgument`` with their own field path.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


# -- dtypes -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Dtype:
    """One KV element type: its canonical name, its ``KvDtype`` enum number, its size."""

    name: str
    proto: int
    itemsize: int


#: The KV dtypes a pool may hold, by canonical name (torch's names without ``torch.``).
DTYPES: dict[str, Dtype] = {d.name: d for d in (
    Dtype("float32", 1, 4),
    Dtype("float16", 2, 2),
    Dtype("bfloat16", 3, 2),
)}
#: Other spellings accepted for a canonical name (lower-cased before lookup).
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "fp16": "float16",
                                 "half": "float16", "bf16": "bfloat16"}
#: Proto dtypes that are refused everywhere, with the ``KvDtype`` number and the reason.
REFUSED_DTYPES: dict[str, tuple[int, str]] = {
    "float8_e4m3": (4, "the kernels have no FP8 path (no per-block scales); use bfloat16"),
}
#: Bytes per element, by canonical name.
DTYPE_BYTES: dict[str, int] = {d.name: d.itemsize for d in DTYPES.values()}
_DTYPE_BY_PROTO = {d.proto: d.name for d in DTYPES.values()}


def canonical_dtype(name: object, *, field: str = "dtype") -> str:
    """The canonical name of a supported KV dtype (``"bf16"`` -> ``"bfloat16"``)."""
    if not isinstance(name, str):
        raise WireError(field, f"expected a dtype name, got {type(name).__name__}")
    low = name.lower()
    low = DTYPE_ALIASES.get(low, low)
    if low in DTYPES:
        return low
    if low in REFUSED_DTYPES:
        raise WireError(field, f"{name!r} is not supported: {REFUSED_DTYPES[low][1]}")
    raise WireError(field, f"unsupported KV dtype {name!r}; supported: {', '.join(DTYPES)}")


def dtype_from_proto(number: int, *, field: str = "dtype") -> str:
    """The canonical name of a ``KvDtype`` enum number (UNSPECIFIED and FP8 are refused)."""
    if number in _DTYPE_BY_PROTO:
        return _DTYPE_BY_PROTO[number]
    for name, (proto, why) in REFUSED_DTYPES.items():
        if proto == number:
            raise WireError(field, f"{name!r} is not supported: {why}")
    raise WireError(field, f"KvDtype {number} is not set or unknown")


def dtype_to_proto(name: str) -> int:
    """The ``KvDtype`` enum number of a dtype name (any accepted spelling)."""
    return DTYPES[canonical_dtype(name)].proto


# -- KV order ---------------------------------------------------------------------------------

#: The one per-layer order: ``[num_blocks, block_size, num_kv_heads, head_dim]`` row-major.
KV_ORDER = "block_token_head_dim"
#: KV order name -> ``KvOrder`` enum number.
KV_ORDERS: dict[str, int] = {KV_ORDER: 1}
#: Other spellings accepted for an order, lower-cased ("NHD": token N, head H, head dim D).
KV_ORDER_ALIASES: dict[str, str] = {"nhd": KV_ORDER}
_KV_ORDER_BY_PROTO = {v: k for k, v in KV_ORDERS.items()}


def canonical_kv_order(name: object, *, field: str = "kv_order") -> str:
    """The canonical name of a supported KV order (``"NHD"`` -> ``"block_token_head_dim"``)."""
    if isinstance(name, str):
        low = name.lower()
        low = KV_ORDER_ALIASES.get(low, low)
        if low in KV_ORDERS:
            return low
    raise WireError(field, f"unsupported KV order {name!r}; supported: {', '.join(KV_ORDERS)}")


def kv_order_from_proto(number: int, *, field: str = "kv_order") -> str:
    if number not in _KV_ORDER_BY_PROTO:
        raise WireError(field, f"KvOrder {number} is not set or unknown")
    return _KV_ORDER_BY_PROTO[number]


def kv_order_to_proto(name: str) -> int:
    return KV_ORDERS[canonical_kv_order(name)]


# -- sizes ------------------------------------------------------------------------------------

MAX_BLOCK_SIZE = 256
#: Block ids travel as uint32 and are stored in int32 arrays (workers' block tables too).
MAX_NUM_BLOCKS = 2**31 - 1


def check_count(value: object, field: str) -> int:
    """A positive int (bools are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WireError(field, f"expected a positive int, got {value!r}")
    return value


def check_block_size(value: object, *, field: str = "block_size") -> int:
    """The block-size rule, the same for the daemon, the config and the kernels: a power of two
    in ``1..MAX_BLOCK_SIZE``."""
    n = check_count(value, field)
    if n > MAX_BLOCK_SIZE or n & (n - 1):
        raise WireError(field, f"must be a power of two in 1..{MAX_BLOCK_SIZE}, got {n}")
    return n


class Shape(Protocol):
    """What the byte arithmetic needs: ``PoolSpec`` and ``KvLayout`` both have it."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...


def run_bytes(shape: Shape) -> int:
    """Bytes of one block in one layer's K (or V) cache: one contiguous run of the pool."""
    return shape.block_size * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[shape.dtype]


def token_bytes(shape: Shape) -> int:
    """Bytes of K plus V of one token, all layers, one tensor-parallel shard."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[shape.dtype]


def block_bytes(shape: Shape) -> int:
    """Bytes one block id occupies in one shard: K and V of ``block_size`` tokens, all layers."""
    return 2 * shape.num_layers * run_bytes(shape)


def pool_bytes(shape: Shape, num_blocks: int) -> int:
    """Bytes of one shard's stacked pool ``[num_layers, 2, num_blocks, B, H, D]``."""
    return num_blocks * block_bytes(shape)


# -- pool backends ----------------------------------------------------------------------------

#: Backend name -> (``PoolBackend`` enum number, vLLM's medium name).
BACKENDS: dict[str, tuple[int, str]] = {"host": (1, "CPU"), "cuda": (2, "GPU")}


def medium_of(backend: str) -> str:
    """vLLM's medium name (``"CPU"``/``"GPU"``) of a backend name."""
    if backend not in BACKENDS:
        raise WireError("backend", f"unknown pool backend {backend!r}; use one of "
                        f"{', '.join(BACKENDS)}")
    return BACKENDS[backend][1]


# -- the fence page ---------------------------------------------------------------------------

#: Size of a session's fence page. Only its first 8 bytes are used.
FENCE_PAGE_BYTES = 4096
_U64 = struct.Struct("<Q")


def read_fence(page: Any) -> int:
    """The fence a worker last published: a little-endian uint64 at offset 0 (0 before any)."""
    return int(_U64.unpack_from(page, 0)[0])


def write_fence(page: Any, fence: int) -> None:
    """The worker's side: an aligned 8-byte store, which x86-64 and arm64 make atomic."""
    _U64.pack_into(page, 0, fence)


# -- the handle socket ------------------------------------------------------------------------
#
# One request per connection over a Unix socket:
#
#     worker -> daemon   {"session_id": "..."}\n                      (at most MAX_REQUEST_BYTES)
#     daemon -> worker   HandleHeader.to_json()  + SCM_RIGHTS fds     (at most MAX_ANSWER_BYTES)
#                    or  {"ok": false, "code": "NOT_FOUND", "message": "..."}\n
#
# fd order, host: [pool fd, fence page fd]; cuda: [shard 0 fd, ..., shard tp_size-1 fd (device
# order), fence page fd]. ``HandleHeader.split_fds`` is that order as code.
#
# The request may name the session's tenant ({"session_id": ..., "tenant_id": ...}); the daemon
# then refuses (PERMISSION_DENIED) a session of another tenant. It answers only a peer whose
# SO_PEERCRED uid or gid the configuration allows (``handles.allowed_uids``/``allowed_gids``,
# default the daemon's own uid), and refuses unparsed a request over MAX_REQUEST_BYTES or
# nested deeper than MAX_REQUEST_DEPTH.
#
# Block ids (the rule every answer follows). The pool fds a session receives are those of the
# partition its tenant's blocks live in (the shared region, or the tenant's or its group's
# dedicated partition; ``blockd.runtime.partitions``), and ``num_blocks`` in the header and in
# AttachResponse.pool is that partition's. Every block id the session receives (Step results,
# copy ops, scrubbed blocks, block tables, Inspect) is partition-local: it indexes the one pool
# tensor ``[num_layers, 2, num_blocks, ...]`` of that mapping. A worker never holds a mapping,
# or an id, of another partition.

MAX_REQUEST_BYTES = 4096
#: Most nesting of brackets in a request (the request is one flat object): a deeper one is
#: refused before it is parsed, so no input can make the parser recurse.
MAX_REQUEST_DEPTH = 4
MAX_ANSWER_BYTES = 65536
#: At most 64 tensor-parallel shards plus the fence page.
MAX_FDS = 65


class HandleRefused(ConnectionError):
    """The daemon's handle socket answered ``ok: false`` (e.g. an unknown session)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def encode_request(session_id: str, tenant_id: str = "") -> bytes:
    """The request line; ``tenant_id`` (optional) must then be the session's tenant."""
    obj = {"session_id": session_id, **({"tenant_id": tenant_id} if tenant_id else {})}
    return json.dumps(obj).encode() + b"\n"


def decode_handle_request(data: bytes) -> tuple[str, str]:
    """(session id, tenant id or "") of a request line; WireError naming the key otherwise.
    The server refuses a line over ``MAX_REQUEST_BYTES`` or nested deeper than
    ``MAX_REQUEST_DEPTH`` before it gets here (``blockd.pools.handles``)."""
    session_id = decode_request(data)
    tenant_id = json.loads(data).get("tenant_id", "")
    if not isinstance(tenant_id, str):
        raise WireError("tenant_id", f"expected a string, got {type(tenant_id).__name__}")
    return session_id, tenant_id


def decode_request(data: bytes) -> str:
    """The session id of a request line; WireError naming ``session_id`` otherwise."""
    try:
        obj = json.loads(data)
        session_id = obj["session_id"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise WireError("session_id", 'expected {"session_id": ...}') from None
    if not isinstance(session_id, str):
        raise WireError("session_id", f"expected a string, got {type(session_id).__name__}")
    return session_id


def encode_refusal(code: str, message: str) -> bytes:
    return json.dumps({"ok": False, "code": code, "message": message}).encode() + b"\n"


def decode_answer(data: bytes | str) -> HandleHeader:
    """A handle-socket answer: its header, or ``HandleRefused`` for an ``ok: false`` answer."""
    obj = _json_object(data)
    if obj.get("ok") is False:
        raise HandleRefused(str(obj.get("code", "UNKNOWN")), str(obj.get("message", "")))
    return HandleHeader.from_json(obj)


def _json_object(data: bytes | str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(data, Mapping):
        return data
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise WireError("header", f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("header", f"expected a JSON object, got {type(obj).__name__}")
    return obj


#: Header fields only the cuda backend has, and that it must have.
_CUDA_FIELDS = ("devices", "shard_bytes", "granularity")


@dataclass(frozen=True)
class HandleHeader:
    """What a session's worker receives with the pool's descriptors (one JSON line).

    Checked when made (``__post_init__``), so neither side can build a header the other refuses;
    every error names its key. Keys a reader does not know are ignored, so a daemon may add one
    without breaking older workers.
    """

    #: The pool's incarnation; block ids of another epoch mean nothing.
    epoch: int
    #: ``"host"`` (memfd) or ``"cuda"`` (CUDA VMM), see ``BACKENDS``.
    backend: str
    #: Bytes of the mapping a worker makes: the whole memfd (host, all shards), or each shard's
    #: allocation (cuda, same as ``shard_bytes``).
    pool_bytes: int
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int
    fence_page_bytes: int = FENCE_PAGE_BYTES
    #: cuda: the daemon's device ordinal of each shard (``tp_size`` of them).
    devices: tuple[int, ...] = ()
    #: cuda: bytes of each shard's allocation (the layout rounded up to ``granularity``).
    shard_bytes: int = 0
    #: cuda: the allocation granularity (what ``cuMemAddressReserve`` aligns to).
    granularity: int = 0
    #: cuda, optional: each shard's GPU UUID (hex), to find the same GPUs in a worker that
    #: numbers its devices differently (another container's CUDA_VISIBLE_DEVICES).
    device_uuids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise WireError(f.name, f"expected an int, got {value!r}")
            elif f.type == "str":
                if not isinstance(value, str):
                    raise WireError(f.name, f"expected a string, got {value!r}")
            else:  # tuples: lists are accepted (JSON has no tuples) and frozen here
                if not isinstance(value, list | tuple):
                    raise WireError(f.name, f"expected a list, got {value!r}")
                item = str if f.name == "device_uuids" else int
                if not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                    raise WireError(f.name, f"expected a list of {item.__name__}, got {value!r}")
                object.__setattr__(self, f.name, tuple(value))
        if self.epoch < 0:
            raise WireError("epoch", f"must not be negative, got {self.epoch}")
        if self.backend not in BACKENDS:
            raise WireError("backend", f"unknown pool backend {self.backend!r}")
        for name in ("pool_bytes", "num_blocks", "num_layers", "num_kv_heads", "head_dim",
                     "tp_size"):
            check_count(getattr(self, name), name)
        check_block_size(self.block_size)
        if canonical_dtype(self.dtype) != self.dtype:
            raise WireError("dtype", f"expected the canonical name "
                            f"{canonical_dtype(self.dtype)!r}, got {self.dtype!r}")
        if self.fence_page_bytes != FENCE_PAGE_BYTES:
            raise WireError("fence_page_bytes",
                            f"expected {FENCE_PAGE_BYTES}, got {self.fence_page_bytes}")
        if self.tp_size + 1 > MAX_FDS:
            raise WireError("tp_size", f"at most {MAX_FDS - 1} shards, got {self.tp_size}")
        if self.backend == "cuda":
            self._check_cuda()
            return
        for name in (*_CUDA_FIELDS, "device_uuids"):
            if getattr(self, name):
                raise WireError(name, "only a cuda header has it")
        need = self.tp_size * pool_bytes(self, self.num_blocks)
        if self.pool_bytes < need:
            raise WireError("pool_bytes", f"{self.pool_bytes} is smaller than the layout's "
                            f"{need} bytes ({self.tp_size} shards)")

    def _check_cuda(self) -> None:
        if len(self.devices) != self.tp_size:
            raise WireError("devices", f"expected {self.tp_size} (tp_size) ordinals, "
                            f"got {list(self.devices)}")
        check_count(self.shard_bytes, "shard_bytes")
        check_count(self.granularity, "granularity")
        if self.shard_bytes < pool_bytes(self, self.num_blocks):
            raise WireError("shard_bytes", f"{self.shard_bytes} is smaller than the layout's "
                            f"{pool_bytes(self, self.num_blocks)} bytes")
        if self.shard_bytes % self.granularity:
            raise WireError("shard_bytes", f"{self.shard_bytes} is not a multiple of the "
                            f"granularity {self.granularity}")
        if self.device_uuids and len(self.device_uuids) != self.tp_size:
            raise WireError("device_uuids", f"expected {self.tp_size} entries, "
                            f"got {len(self.device_uuids)}")

    @property
    def medium(self) -> str:
        """``"CPU"`` or ``"GPU"`` (vLLM's names)."""
        return BACKENDS[self.backend][1]

    @property
    def num_fds(self) -> int:
        """Descriptors that come with this header: one per pool mapping, then the fence page."""
        return (self.tp_size if self.backend == "cuda" else 1) + 1

    def split_fds(self, fds: Sequence[int]) -> tuple[list[int], int]:
        """``(pool fds, fence page fd)`` in the documented order (see the module comment)."""
        if len(fds) != self.num_fds:
            what = (f"{self.tp_size} shard fds then the fence page fd" if self.backend == "cuda"
                    else "pool, fence page")
            raise WireError("fds", f"expected {self.num_fds} descriptors ({what}), "
                            f"got {len(fds)}")
        return list(fds[:-1]), fds[-1]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able fields; the cuda-only ones only for the cuda backend."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in (*_CUDA_FIELDS, "device_uuids") and self.backend != "cuda":
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self) -> bytes:
        """The answer line the handle socket sends: ``{"ok": true, ...}\\n``."""
        return json.dumps({"ok": True, **self.to_dict()}).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes | str | Mapping[str, Any]) -> HandleHeader:
        """Parse (and check) a header: an answer line, its text or its decoded object.

        Raises WireError naming the first missing or bad key.
        """
        obj = _json_object(data)
        optional = {"device_uuids", *(() if obj.get("backend") == "cuda" else _CUDA_FIELDS)}
        for f in fields(cls):
            if f.name not in obj and f.name not in optional:
                raise WireError(f.name, "missing from the handle header")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})
