"""One contract, checked from every side: the proto enums, ``blockd.wire``, the core's
``PoolSpec``, the daemon's config and the kernels' ``KvLayout`` agree on every dtype, KV order
and block-size rule; the handle header round-trips between the daemon's pools and the client's
parser and is refused, naming the key, when a key is missing or ill-typed; the fence page reads
what the worker writes.

A daemon that accepts what no worker can attach to (block_size=12, float8_e4m3) is the bug
this module exists to prevent.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from blockd import config, handle_wire, wire
from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import InvalidArgument
from blockd.core.spec import PoolSpec
from blockd.pools.base import Planes, Pool
from blockd.pools.cuda import CudaPool
from blockd.pools.fences import FencePage
from blockd.pools.host import HostPool
from blockd_client.handles import parse_answer
from blockd_gpu.layout import SUPPORTED_DTYPES, KvLayout

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}


def enum_values(enum: Any, prefix: str) -> dict[str, int]:
    """Every set value of a proto enum as (wire-rule name, number)."""
    return {name.removeprefix(prefix).lower(): number for name, number in enum.items()
            if not name.endswith("_UNSPECIFIED")}


def accepts(make: Callable[[], object]) -> bool:
    try:
        make()
    except (ValueError, TypeError, InvalidArgument):  # WireError is a ValueError
        return False
    return True


def one_verdict(value: Any, **places: Callable[[Any], object]) -> bool:
    """Whether every place accepts ``value``; fails the test when they disagree."""
    verdicts = {where: accepts(lambda make=make: make(value)) for where, make in places.items()}
    assert len(set(verdicts.values())) == 1, (value, verdicts)
    return verdicts.popitem()[1]


# -- the proto and wire's tables --------------------------------------------------------------


def test_every_proto_dtype_is_in_wire_with_its_number_and_nothing_else_is() -> None:
    proto = enum_values(pb.KvDtype, "KV_DTYPE_")
    supported = {name: d.proto for name, d in wire.DTYPES.items()}
    refused = {name: number for name, (number, _why) in wire.REFUSED_DTYPES.items()}
    assert not supported.keys() & refused.keys()
    assert {**supported, **refused} == proto  # same names (the rule), same numbers
    for name, number in supported.items():
        assert wire.dtype_from_proto(number) == name and wire.dtype_to_proto(name) == number
    for number in (pb.KV_DTYPE_UNSPECIFIED, *refused.values(), 99):
        with pytest.raises(wire.WireError, match="^dtype"):
            wire.dtype_from_proto(number)


def test_bytes_per_element_match_the_kernels_dtypes() -> None:
    assert set(SUPPORTED_DTYPES) == set(wire.DTYPES)
    for name, torch_dtype in SUPPORTED_DTYPES.items():
        assert wire.DTYPE_BYTES[name] == torch_dtype.itemsize == wire.DTYPES[name].itemsize


def test_every_proto_order_and_backend_is_in_wire() -> None:
    assert dict(wire.KV_ORDERS) == enum_values(pb.KvOrder, "KV_ORDER_")
    for name, number in wire.KV_ORDERS.items():
        assert wire.kv_order_from_proto(number) == name == wire.canonical_kv_order(name)
        assert wire.kv_order_to_proto(name) == number
    with pytest.raises(wire.WireError, match="^kv_order"):
        wire.kv_order_from_proto(pb.KV_ORDER_UNSPECIFIED)
    assert {name: number for name, (number, _medium) in wire.BACKENDS.items()} == {
        "host": pb.POOL_BACKEND_HOST_SHM, "cuda": pb.POOL_BACKEND_CUDA_VMM}
    assert {wire.medium_of(b) for b in wire.BACKENDS} == {"CPU", "GPU"}
    assert {HostPool.medium, CudaPool.medium} == {"CPU", "GPU"}
    assert wire.medium_of(HostPool.backend) == HostPool.medium
    assert wire.medium_of(CudaPool.backend) == CudaPool.medium


# -- one rule, four places ----------------------------------------------------------------------


def _spec(**kw: Any) -> PoolSpec:
    return PoolSpec(**{"block_size": 16, "num_blocks": 8, **SHAPE, **kw})


def _layout(**kw: Any) -> KvLayout:
    return KvLayout(**{"block_size": 16, "dtype": "float16", **SHAPE, **kw})


def _config(**kw: Any) -> config.Config:
    env = {f"BLOCKD_POOL_{k.upper()}": str(v) for k, v in kw.items()}
    return config.load(None, environ=env)


def test_block_size_rule_is_the_same_everywhere() -> None:
    accepted = [n for n in range(0, 513) if one_verdict(
        n, wire=wire.check_block_size, spec=lambda n: _spec(block_size=n),
        layout=lambda n: _layout(block_size=n), config=lambda n: _config(block_size=n))]
    assert accepted == [1 << k for k in range(9)]  # powers of two, 1..256


def test_dtype_names_are_accepted_in_the_same_places() -> None:
    names = {*wire.DTYPES, *wire.DTYPE_ALIASES, *wire.REFUSED_DTYPES, *SUPPORTED_DTYPES,
             *enum_values(pb.KvDtype, "KV_DTYPE_"), "BF16", "int8", "float64", "", "e4m3"}
    for name in sorted(names):
        if one_verdict(name, wire=wire.canonical_dtype, spec=lambda d: _spec(dtype=d),
                       layout=lambda d: _layout(dtype=d), config=lambda d: _config(dtype=d)):
            # ... and all of them normalise it to the same canonical name.
            assert (_spec(dtype=name).dtype == _layout(dtype=name).dtype
                    == _config(dtype=name).pool.dtype == wire.canonical_dtype(name))
    assert not accepts(lambda: wire.canonical_dtype("float8_e4m3"))


def test_kv_order_names_are_accepted_in_the_same_places() -> None:
    names = {*wire.KV_ORDERS, *wire.KV_ORDER_ALIASES, "NHD", "HND", "block_head_token_dim", ""}
    for name in sorted(names):
        one_verdict(name, wire=wire.canonical_kv_order, spec=lambda o: _spec(kv_order=o),
                    layout=lambda o: _layout(kv_order=o))
    assert _spec(kv_order="NHD") == _spec() and _layout(kv_order="NHD") == _layout()
    assert _spec().kv_order == _layout().kv_order == wire.KV_ORDER


def test_config_refusals_name_the_pool_field() -> None:
    for kw, field in [({"block_size": 12}, "pool.block_size"),
                      ({"dtype": "float8_e4m3"}, "pool.dtype"),
                      ({"num_blocks": 0}, "pool.num_blocks"),
                      ({"tp_size": 0}, "pool.tp_size"),
                      ({"backend": "tpu"}, "pool.backend")]:
        with pytest.raises(InvalidArgument) as info:
            _config(**kw)
        assert info.value.field == field and info.value.message.startswith(field)
    cfg = _config(block_size=32, dtype="bf16", tp_size=2)
    assert cfg.pool.spec() == PoolSpec(block_size=32, num_blocks=cfg.pool.num_blocks,
                                       num_layers=cfg.pool.num_layers,
                                       num_kv_heads=cfg.pool.num_kv_heads,
                                       head_dim=cfg.pool.head_dim, dtype="bfloat16", tp_size=2)


@pytest.mark.parametrize("dtype", sorted(wire.DTYPES))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_byte_arithmetic_is_the_same_everywhere(dtype: str, block_size: int) -> None:
    spec = _spec(dtype=dtype, block_size=block_size, num_blocks=5)
    layout = _layout(dtype=dtype, block_size=block_size)
    assert spec.block_bytes == layout.block_bytes == wire.block_bytes(spec)
    assert spec.pool_bytes == layout.pool_bytes(5) == 5 * spec.block_bytes
    assert spec.token_bytes * block_size == spec.block_bytes
    assert Planes.of(spec).block_bytes == spec.block_bytes
    assert Planes.of(spec, shards=3).region_bytes == 3 * spec.pool_bytes
    numel = 1
    for d in layout.pool_shape(5):
        numel *= d
    assert numel * layout.itemsize == spec.pool_bytes


# -- the handle header --------------------------------------------------------------------------


def host_header(**over: Any) -> dict[str, Any]:
    spec = _spec()
    h: dict[str, Any] = {"epoch": 4, "backend": "host", "pool_bytes": spec.pool_bytes,
                         "num_blocks": spec.num_blocks, "block_size": spec.block_size,
                         "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
                         "tp_size": 1, "fence_page_bytes": wire.FENCE_PAGE_BYTES}
    return {**h, **over}


def cuda_header(**over: Any) -> dict[str, Any]:
    g = 1 << 16
    return host_header(**{"backend": "cuda", "pool_bytes": g, "tp_size": 2, "devices": [0, 1],
                          "shard_bytes": g, "granularity": g,
                          "device_uuids": ["ab" * 16, "cd" * 16], **over})


@pytest.mark.parametrize("make", [host_header, cuda_header])
def test_header_round_trips_through_json_and_the_clients_parser(make: Callable[..., Any]
                                                                ) -> None:
    header = handle_wire.HandleHeader.from_json(make())
    line = header.to_json()
    assert line.endswith(b"\n") and json.loads(line)["ok"] is True
    assert handle_wire.HandleHeader.from_json(line) == header == handle_wire.decode_answer(line)
    fds = [os.memfd_create("t", os.MFD_CLOEXEC) for _ in range(header.num_fds)]
    try:
        parsed, got = parse_answer(line, fds)
        assert parsed == header and got == fds
        pool_fds, fence_fd = parsed.split_fds(got)
        assert pool_fds == fds[:-1] and fence_fd == fds[-1]
        assert len(pool_fds) == (2 if header.backend == "cuda" else 1)
    finally:
        for fd in fds:
            os.close(fd)
    # A key the reader does not know is ignored (a newer daemon may add one).
    assert handle_wire.HandleHeader.from_json({**make(), "future_key": 1}) == header


def _required(make: Callable[..., Any]) -> list[str]:
    optional = {"device_uuids"}
    return [k for k in make() if k not in optional]


@pytest.mark.parametrize("make", [host_header, cuda_header])
def test_header_missing_key_is_refused_naming_it(make: Callable[..., Any]) -> None:
    for key in _required(make):
        broken = {k: v for k, v in make().items() if k != key}
        with pytest.raises(wire.WireError, match=f"^{key}: missing") as info:
            handle_wire.HandleHeader.from_json(broken)
        assert info.value.field == key


ILL_TYPED = [("epoch", "4"), ("epoch", True), ("backend", 1), ("backend", "tpu"),
             ("pool_bytes", 1.5), ("num_blocks", None), ("block_size", 12),
             ("block_size", "16"), ("num_layers", 0), ("num_kv_heads", [2]), ("head_dim", -8),
             ("dtype", 2), ("dtype", "float8_e4m3"), ("dtype", "bf16"), ("tp_size", False),
             ("fence_page_bytes", 8), ("pool_bytes", 1)]


@pytest.mark.parametrize(("key", "value"), ILL_TYPED)
def test_host_header_ill_typed_key_is_refused_naming_it(key: str, value: Any) -> None:
    with pytest.raises(wire.WireError, match=f"^{key}: ") as info:
        handle_wire.HandleHeader.from_json(host_header(**{key: value}))
    assert info.value.field == key


@pytest.mark.parametrize(("key", "value"), [
    ("devices", "0,1"), ("devices", [0]), ("devices", [0, "1"]), ("shard_bytes", 0),
    ("shard_bytes", 1 << 10), ("granularity", "64k"), ("device_uuids", ["ab" * 16]),
    ("device_uuids", [1, 2])])
def test_cuda_header_ill_typed_key_is_refused_naming_it(key: str, value: Any) -> None:
    with pytest.raises(wire.WireError, match=f"^{key}: "):
        handle_wire.HandleHeader.from_json(cuda_header(**{key: value}))


def test_host_header_with_cuda_keys_and_bad_answers_are_refused() -> None:
    with pytest.raises(wire.WireError, match="^devices: only a cuda header"):
        handle_wire.HandleHeader.from_json(host_header(devices=[0]))
    with pytest.raises(wire.WireError, match="^header: not JSON"):
        handle_wire.decode_answer(b"{nope")
    with pytest.raises(handle_wire.HandleRefused, match="NOT_FOUND: gone") as info:
        handle_wire.decode_answer(handle_wire.encode_refusal("NOT_FOUND", "gone"))
    assert isinstance(info.value, ConnectionError) and info.value.code == "NOT_FOUND"
    assert handle_wire.decode_request(handle_wire.encode_request("s-1", "f")) == "s-1"
    req = handle_wire.decode_handle_request(handle_wire.encode_request("s-1", "f" * 64, "acme"))
    assert req == handle_wire.HandleRequest("s-1", "f" * 64, "acme")
    assert "f" * 64 not in repr(req)  # a logged request never shows the secret
    assert handle_wire.decode_handle_request(b'{"session_id": "s-1"}').fetch_secret == ""
    with pytest.raises(wire.WireError, match="^fetch_secret"):
        handle_wire.decode_handle_request(b'{"session_id": "s-1", "fetch_secret": 7}')
    for bad in (b"", b"{}", b'{"session_id": 3}', b"[1]"):
        with pytest.raises(wire.WireError, match="^session_id"):
            handle_wire.decode_request(bad)


def test_header_split_fds_documents_the_order() -> None:
    host = handle_wire.HandleHeader.from_json(host_header())
    assert host.split_fds([10, 11]) == ([10], 11)
    cuda = handle_wire.HandleHeader.from_json(cuda_header())
    assert cuda.split_fds([10, 11, 12]) == ([10, 11], 12)
    with pytest.raises(wire.WireError, match=r"^fds: expected 3 descriptors \(2 shard fds"):
        cuda.split_fds([10, 11])
    with pytest.raises(wire.WireError, match=r"^fds: expected 2 descriptors \(pool, fence"):
        host.split_fds([10, 11, 12])


# -- the pools' side: the Pool protocol, the header they make, the fence page --------------------


POOL_MEMBERS = ("medium", "size", "zero_blocks", "read_block", "copy_out", "copy_in",
                "register_host", "unregister_host", "handle", "close", "spec")


def test_both_pools_have_every_member_of_the_pool_protocol() -> None:
    declared = {n for n in vars(Pool) if not n.startswith("_")} | set(
        Pool.__annotations__)
    assert declared == set(POOL_MEMBERS)
    for cls in (HostPool, CudaPool):
        for name in ("zero_blocks", "read_block", "copy_out", "copy_in", "register_host",
                     "unregister_host", "handle", "close"):
            assert callable(getattr(cls, name)), (cls, name)
    pool = HostPool(_spec(tp_size=2))
    try:
        assert all(hasattr(pool, name) for name in POOL_MEMBERS)
    finally:
        pool.close()


def test_a_host_pools_handle_is_what_the_client_parses_and_the_fence_page_round_trips() -> None:
    spec = _spec(tp_size=2, dtype="bfloat16")
    pool = HostPool(spec)
    page = FencePage()
    try:
        header, fds = pool.handle(9, page.fd)
        assert fds == [pool.fd, page.fd] and header.medium == "CPU"
        assert header.pool_bytes == pool.size == 2 * spec.pool_bytes
        assert dataclasses.asdict(header)["dtype"] == "bfloat16"
        parsed, dups = parse_answer(header.to_json(), [os.dup(fd) for fd in fds])
        assert parsed == header
        for fd in dups:
            os.close(fd)
        assert page.read() == 0
        wire.write_fence(page.map, 2**64 - 1)
        assert page.read() == wire.read_fence(page.map) == 2**64 - 1
        assert bytes(page.map[:8]) == b"\xff" * 8 and len(page.map) == wire.FENCE_PAGE_BYTES
        wire.write_fence(page.map, 258)
        assert bytes(page.map[:8]) == (258).to_bytes(8, "little")
    finally:
        page.close()
        pool.close()
