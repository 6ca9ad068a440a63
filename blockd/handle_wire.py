"""The handle socket's wire format: how a worker asks for a session's pool, and the header
(layout, sizes, fd order) it maps the pool from.

Part of the contract outside the proto (``blockd.wire`` holds the layout names and rules this
builds on); ``blockd.pools.handles`` serves it, ``blockd_client.handles`` asks it, and
``tests/test_wire_conformance.py`` checks both sides against it. Pure Python, as ``blockd.wire``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from dataclasses import field as _field
from typing import Any

from blockd.wire import (
    BACKENDS,
    FENCE_PAGE_BYTES,
    WireError,
    canonical_dtype,
    check_block_size,
    check_count,
    pool_bytes,
)

__all__ = [
    "HandleHeader", "HandleRefused", "HandleRequest", "MAX_ANSWER_BYTES", "MAX_FDS",
    "MAX_REQUEST_BYTES", "MAX_REQUEST_DEPTH", "decode_answer", "decode_handle_request",
    "decode_request", "encode_refusal", "encode_request",
]


# -- the handle socket ------------------------------------------------------------------------
#
# One request per connection over a Unix socket:
#
#     worker -> daemon   {"session_id": "...", "fetch_secret": "..."}\n  (<= MAX_REQUEST_BYTES)
#     daemon -> worker   HandleHeader.to_json()  + SCM_RIGHTS fds          (<= MAX_ANSWER_BYTES)
#                    or  {"ok": false, "code": "NOT_FOUND", "message": "..."}\n
#
# fd order, host: [pool fd, fence page fd]; cuda: [shard 0 fd, ..., shard tp_size-1 fd (device
# order), fence page fd]. ``HandleHeader.split_fds`` is that order as code.
#
# ``fetch_secret`` is the session's ``AttachResponse.fetch_secret``: a request without it, or
# with another, gets the very answer an unknown session gets (NOT_FOUND), so a guesser cannot
# tell a live session id from a dead one (``blockd.pools.fetch_secrets``).
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


@dataclass(frozen=True, slots=True)
class HandleRequest:
    """A request line, decoded. The secret is "" when the line had none, and no ``repr`` of
    the request shows it."""

    session_id: str
    fetch_secret: str = _field(repr=False)
    #: The tenant the request names ("" for none).
    tenant_id: str = ""


def encode_request(session_id: str, fetch_secret: str, tenant_id: str = "") -> bytes:
    """The request line; ``tenant_id`` (optional) must then be the session's tenant."""
    obj = {"session_id": session_id, "fetch_secret": fetch_secret,
           **({"tenant_id": tenant_id} if tenant_id else {})}
    return json.dumps(obj).encode() + b"\n"


def decode_handle_request(data: bytes) -> HandleRequest:
    """A request line; WireError naming the key otherwise. The server refuses a line over
    ``MAX_REQUEST_BYTES`` or nested deeper than ``MAX_REQUEST_DEPTH`` before it gets here
    (``blockd.pools.handles``)."""
    session_id = decode_request(data)
    obj = json.loads(data)
    for key in ("tenant_id", "fetch_secret"):
        if not isinstance(obj.get(key, ""), str):
            raise WireError(key, f"expected a string, got {type(obj[key]).__name__}")
    return HandleRequest(session_id, obj.get("fetch_secret", ""), obj.get("tenant_id", ""))


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
