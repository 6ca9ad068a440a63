"""The contract outside the proto: layout names and rules, the fence page.

Everything a daemon and its workers must agree on that ``proto/blockd/v1/blockd.proto`` does not
carry is written here once; ``blockd.core.spec``, ``blockd.config``, ``blockd.pools``,
``blockd_gpu.layout`` and ``blockd_client`` all read it from here, and
``tests/test_wire_conformance.py`` checks that the proto, this module, ``PoolSpec``, the config
and ``KvLayout`` agree. The handle socket's messages (the header a worker maps a pool from)
are ``blockd.handle_wire``, built on these names.

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

import struct
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "BACKENDS", "DTYPES", "DTYPE_ALIASES", "DTYPE_BYTES", "FENCE_PAGE_BYTES", "KV_ORDER",
    "KV_ORDERS", "KV_ORDER_ALIASES", "MAX_BLOCK_SIZE", "MAX_FENCE_SLOTS", "MAX_NUM_BLOCKS",
    "REFUSED_DTYPES",
    "Shape", "WireError", "block_bytes", "canonical_dtype", "canonical_kv_order",
    "check_block_size", "check_count", "dtype_from_proto", "dtype_to_proto",
    "kv_order_from_proto", "kv_order_to_proto", "medium_of", "pool_bytes", "read_fence",
    "read_fences", "run_bytes", "token_bytes", "write_fence",
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

#: Size of a session's fence page: one 8-byte slot per tensor-parallel shard of the pool
#: (``MAX_FENCE_SLOTS`` at most), slot ``r`` at offset ``8 * r``.
FENCE_PAGE_BYTES = 4096
MAX_FENCE_SLOTS = FENCE_PAGE_BYTES // 8
_U64 = struct.Struct("<Q")


def read_fence(page: Any, slot: int = 0) -> int:
    """The fence a worker last published into ``slot``: a little-endian uint64 at offset
    ``8 * slot`` (0 before any)."""
    return int(_U64.unpack_from(page, 8 * slot)[0])


def read_fences(page: Any, slots: int) -> int:
    """The fence every one of the first ``slots`` slots has reached: their minimum. A pool of
    ``tp_size`` shards has that many slots, one per rank's worker, so a step's blocks are done
    once every rank published its fence (a worker owning all shards writes every slot)."""
    return min(int(_U64.unpack_from(page, 8 * slot)[0]) for slot in range(slots))


def write_fence(page: Any, fence: int, slot: int = 0) -> None:
    """The worker's side: an aligned 8-byte store, which x86-64 and arm64 make atomic."""
    _U64.pack_into(page, 8 * slot, fence)
