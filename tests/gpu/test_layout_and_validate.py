"""The layout contract (KvLayout) and the argument checks: every error names the bad argument."""

from __future__ import annotations

import pytest
import torch
from _kvtest import build_paged, rand

import blockd_gpu as bg
from blockd_gpu.layout import KvLayout
from blockd_gpu.validate import validate_kv_cache, validate_pool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- KvLayout --------------------------------------------------------------------------------

def test_layout_normalises_dtype_and_sizes():
    a = KvLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    b = KvLayout(32, 8, 128, 16, "bf16")
    assert a == b and hash(a) == hash(b) and a.dtype == "bfloat16"
    assert KvLayout(32, 8, 128, 16, "bf16", kv_order="NHD") == a  # FlashInfer's name, an alias
    assert a.torch_dtype is torch.bfloat16 and a.kv_order == "block_token_head_dim"
    assert a.block_numel == 16 * 8 * 128
    assert a.block_bytes == 32 * 2 * 16 * 8 * 128 * 2  # all layers, K and V, bf16
    assert a.cache_shape(100) == (100, 16, 8, 128)
    assert a.pool_shape(100) == (32, 2, 100, 16, 8, 128)
    assert a.pool_bytes(100) == 100 * a.block_bytes
    assert a.as_dict()["dtype"] == "bfloat16"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_layers": 0}, "num_layers"),
    ({"num_kv_heads": -1}, "num_kv_heads"),
    ({"head_dim": 1.5}, "head_dim"),
    ({"block_size": 12}, "block_size"),
    ({"block_size": 512}, "block_size"),
    ({"dtype": "float8_e4m3"}, "dtype"),
    ({"dtype": "int8"}, "dtype"),
    ({"dtype": 3}, "dtype"),
    ({"kv_order": "HND"}, "kv_order"),
])
def test_layout_errors_name_the_field(kwargs, field):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
    with pytest.raises((ValueError, TypeError), match=f"^{field}"):
        KvLayout(**{**base, **kwargs})


def test_mismatch_names_differing_fields():
    a = KvLayout(2, 8, 128, 16, "float16")
    assert a.mismatch(a) == []
    b = KvLayout(2, 4, 128, 32, "float16")
    assert a.mismatch(b) == ["num_kv_heads: 8 != 4", "block_size: 16 != 32"]


def test_pool_views_share_storage_and_from_pool_round_trips():
    layout = KvLayout(3, 2, 64, 8, "float32")
    pool = layout.allocate_pool(5, device=DEVICE)
    caches = layout.kv_caches(pool)
    assert len(caches) == 3
    k1, v1 = caches[1]
    assert k1.shape == layout.cache_shape(5) and k1.is_contiguous()
    k1[2, 3, 1, 4] = 7.0
    v1[0, 0, 0, 0] = 9.0
    assert pool[1, 0, 2, 3, 1, 4] == 7.0 and pool[1, 1, 0, 0, 0, 0] == 9.0
    assert KvLayout.from_pool(pool) == layout
    assert validate_pool(pool, layout=layout) == 5
    assert validate_kv_cache(k1, v1, layout=layout).num_blocks == 5
    with pytest.raises(ValueError, match=r"^kv_pool: does not match layout: num_kv_heads"):
        KvLayout(3, 4, 64, 8, "float32").kv_caches(pool)


def test_validate_pool_against_layout():
    layout = KvLayout(3, 2, 64, 8, "float32")
    other = KvLayout(3, 2, 64, 16, "float32").allocate_pool(2)
    with pytest.raises(ValueError, match=r"^kv_pool: does not match layout: block_size"):
        validate_pool(other, layout=layout)
    with pytest.raises(ValueError, match="^kv_pool: dimension 1 must be 2"):
        validate_pool(torch.zeros(3, 3, 2, 8, 2, 64), layout=layout)
    with pytest.raises(ValueError, match="^kv_pool: each block must be contiguous"):
        bg.copy_blocks(torch.zeros(3, 2, 2, 2, 64, 8).transpose(-1, -2),
                       torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="^k_cache: shape"):
        validate_kv_cache(torch.zeros(2, 8, 2, 32), torch.zeros(2, 8, 2, 32), layout=layout)


# --- argument checks -------------------------------------------------------------------------

@pytest.fixture
def decode_args():
    kv = build_paged([5, 20], 2, 64, 16, torch.float32, device=DEVICE)
    q = rand((2, 4, 64), torch.float32).to(DEVICE)
    return dict(q=q, k_cache=kv.k_cache, v_cache=kv.v_cache, block_tables=kv.block_tables,
                seq_lens=kv.seq_lens)


def call_decode(args, **overrides):
    a = {**args, **overrides}
    return bg.paged_decode_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"],
                                     a["seq_lens"], **{k: v for k, v in overrides.items()
                                                       if k not in args})


@pytest.mark.parametrize(("name", "make", "error", "pattern"), [
    ("q", lambda a: a["q"].double(), TypeError, "^q: expected dtype float32"),
    ("q", lambda a: a["q"][:, :3], ValueError, "^q: num_qo_heads"),
    ("q", lambda a: a["q"][:1], ValueError, "^block_tables: expected 1 rows"),
    ("q", lambda a: a["q"][:, :, :32], ValueError, r"^q: expected shape \[\*, \*, 64\]"),
    ("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2), ValueError,
     "^q: head_dim must be the innermost"),
    ("q", lambda a: a["q"].tolist(), TypeError, "^q: expected a torch.Tensor"),
    ("k_cache", lambda a: a["k_cache"][..., :32], ValueError, r"^v_cache: expected shape"),
    ("v_cache", lambda a: a["v_cache"].half(), TypeError, "^v_cache: expected dtype float32"),
    ("v_cache", lambda a: a["v_cache"].to("meta"), ValueError, "^v_cache: expected device"),
    ("k_cache", lambda a: a["k_cache"].to(torch.int32), TypeError, "^k_cache: expected dtype"),
    ("k_cache", lambda a: a["k_cache"][0], ValueError, "^k_cache: expected 4 dimensions"),
    ("k_cache", lambda a: a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3),
     ValueError, "^k_cache: head_dim must be the innermost"),
    ("block_tables", lambda a: a["block_tables"].long(), TypeError,
     "^block_tables: expected dtype int32"),
    ("block_tables", lambda a: a["block_tables"].t().contiguous().t(), ValueError,
     "^block_tables: rows must be contiguous"),
    ("seq_lens", lambda a: a["seq_lens"].long(), TypeError, "^seq_lens: expected dtype int32"),
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError, r"^seq_lens: expected shape \[2\]"),
    ("seq_lens", lambda a: a["seq_lens"] + 100, ValueError,
     r"^seq_lens: sequence 0 has length 105, outside \[0, 48\]"),
    ("seq_lens", lambda a: a["seq_lens"] - 6, ValueError, "^seq_lens: sequence 0 has length -1"),
])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_errors_name_the_argument(decode_args, backend, name, make, error, pattern):
    with pytest.raises(error, match=pattern):
        call_decode(decode_args, **{name: make(decode_args)}, backend=backend)


@pytest.mark.parametrize(("out", "error", "pattern"), [
    (lambda q: torch.empty(2, 4, 65)[..., :64].transpose(0, 0), None, None),
    (lambda q: torch.empty(2, 4, 32), ValueError, r"^out: expected shape \[2, 4, 64\]"),
    (lambda q: torch.empty(2, 4, 64, dtype=torch.float16), TypeError, "^out: expected dtype"),
    (lambda q: torch.empty(2, 64, 4).transpose(1, 2), ValueError, "^out: the last dimension"),
])
def test_out_buffer_checks(decode_args, out, error, pattern):
    buf = out(decode_args["q"]).to(DEVICE)
    if error is None:
        assert call_decode(decode_args, out=buf) is buf
    else:
        with pytest.raises(error, match=pattern):
            call_decode(decode_args, out=buf)


def test_validate_false_skips_value_checks_only(decode_args):
    # validate=False skips the checks that read tensor data (a device sync on CUDA) ...
    lens = decode_args["seq_lens"].clone()
    lens[0] = 100
    with pytest.raises(ValueError, match="^seq_lens"):
        call_decode(decode_args, seq_lens=lens, backend="torch")
    # ... but never the metadata checks.
    with pytest.raises(TypeError, match="^seq_lens"):
        call_decode(decode_args, seq_lens=lens.long(), validate=False, backend="torch")


def test_prefill_indptr_errors_are_named(decode_args):
    a = decode_args
    q = rand((5, 4, 64), torch.float32).to(DEVICE)
    cases = [
        ([0, 2], ValueError, r"^qo_indptr: expected shape \[3\]"),
        ([0, 2, 4], ValueError, "^qo_indptr: must start at 0, be non-decreasing and end at"),
        ([1, 2, 5], ValueError, "^qo_indptr: must start at 0"),
        ([0, 3, 2], ValueError, "^qo_indptr: must start at 0"),
        ([0, 0, 5], None, None),
        ([0, 5, 5], None, None),  # 5 new tokens for a 5-token sequence: a fresh prefill
    ]
    for ip, error, pattern in cases:
        indptr = torch.tensor(ip, dtype=torch.int32, device=DEVICE)
        args = (q, a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], indptr)
        if error is None:
            bg.paged_prefill_attention(*args)
        else:
            with pytest.raises(error, match=pattern):
                bg.paged_prefill_attention(*args)
    lens = a["seq_lens"].clone()
    lens[0] = 2
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^qo_indptr: sequence 0 has 3 new tokens but seq_lens"):
        bg.paged_prefill_attention(q, a["k_cache"], a["v_cache"], a["block_tables"], lens,
                                   indptr)
    with pytest.raises(TypeError, match="^qo_indptr: expected dtype int32"):
        bg.paged_prefill_attention(q, a["k_cache"], a["v_cache"], a["block_tables"],
                                   a["seq_lens"], indptr.long())


def test_cache_op_errors_are_named():
    k_cache = torch.zeros((4, 8, 2, 16), device=DEVICE)
    key = torch.zeros((3, 2, 16), device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"^key: expected shape \[\*, 2, 16\]"):
        bg.reshape_and_cache(key[:, :1], key, k_cache, k_cache.clone(), slots)
    with pytest.raises(TypeError, match="^value: expected dtype float32"):
        bg.reshape_and_cache(key, key.half(), k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="^value: expected 3 tokens"):
        bg.reshape_and_cache(key, key[:2], k_cache, k_cache.clone(), slots)
    with pytest.raises(TypeError, match="^slot_mapping: expected dtype int64"):
        bg.reshape_and_cache(key, key, k_cache, k_cache.clone(), slots.int())
    with pytest.raises(ValueError, match=r"^slot_mapping: expected shape \[3\]"):
        bg.reshape_and_cache(key, key, k_cache, k_cache.clone(), slots[:2])
    pool = torch.zeros((1, 2, 4, 8, 2, 16), device=DEVICE)
    with pytest.raises(ValueError, match=r"^block_mapping: expected shape \[\*, 2\]"):
        bg.copy_blocks(pool, torch.zeros((2, 3), dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="^block_mapping: expected dtype int64"):
        bg.copy_blocks(pool, torch.zeros((2, 2), dtype=torch.int32, device=DEVICE))


def test_backend_argument_checked(decode_args):
    with pytest.raises(ValueError, match="^backend: expected one of"):
        call_decode(decode_args, backend="cuda")
