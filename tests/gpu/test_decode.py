"""paged_decode_attention vs SDPA on the same K/V laid out contiguously.

The torch twin runs a broad grid (it is fast); the Triton kernel runs under TRITON_INTERPRET on
the CPU (or natively on a GPU) over a narrower grid of small shapes, since the interpreter
executes every program instance in Python. Tolerances: ``_kvtest.TOLERANCES``.
"""

from __future__ import annotations

import pytest
import torch
from _kvtest import DTYPE_IDS, assert_close, build_paged, rand, sdpa_decode

import blockd_gpu as bg

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_qo_heads, num_kv_heads): MHA, GQA (group 4), MQA.
HEADS = [(4, 4), (8, 2), (4, 1)]
HEAD_IDS = ["mha", "gqa4", "mqa"]


def lens_for(block_size: int) -> list[int]:
    # Length 1, exactly a block, a block plus one, and a ragged longer one.
    return [1, block_size, block_size + 1, 3 * block_size - 5]


def run_case(block_size, heads, head_dim, dtype, backend, *, lens=None, plan=None, seed=0):
    hq, hkv = heads
    lens = lens if lens is not None else lens_for(block_size)
    kv = build_paged(lens, hkv, head_dim, block_size, dtype, seed=seed, device=DEVICE)
    q = rand((len(lens), hq, head_dim), dtype, seed=seed + 1).to(DEVICE)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    backend=backend, plan=plan)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, sdpa_decode(q, kv))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 256])
def test_torch_twin_matches_sdpa(block_size, heads, head_dim, dtype):
    run_case(block_size, heads, head_dim, dtype, "torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_triton_matches_sdpa(block_size, heads, head_dim, dtype):
    run_case(block_size, heads, head_dim, dtype, "triton")


@pytest.mark.parametrize(("block_size", "head_dim"), [(64, 80), (128, 96), (256, 256), (16, 256)])
def test_triton_other_block_sizes_and_head_dims(block_size, head_dim):
    run_case(block_size, (8, 2), head_dim, torch.bfloat16, "triton", lens=[1, 3, block_size + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_triton_split_k_matches_sdpa(num_splits, dtype):
    # 16-token tiles so a few hundred tokens make several partitions per split; 5 splits leave
    # some splits past the end of the shorter sequences (lse = -inf, weight 0 in the reduction).
    lens = [1, 16, 17, 150, 0, 97]
    plan = bg.plan_decode(len(lens), 160, 8, 2, 64, dtype=dtype, num_splits=num_splits, tile=16)
    assert plan.num_splits == num_splits
    run_case(16, (8, 2), 64, dtype, "triton", lens=lens, plan=plan)


def test_triton_split_k_plan_shorter_than_sequences():
    # A plan made for 64 tokens used on 150: the last split runs to the end, so still correct.
    plan = bg.plan_decode(3, 64, 4, 1, 64, dtype=torch.float32, num_splits=2, tile=16)
    assert plan.num_splits * plan.partition_size < 150
    run_case(16, (4, 1), 64, torch.float32, "triton", lens=[150, 5, 64], plan=plan)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_length_sequences_give_zero_rows(backend):
    lens = [0, 5, 0, 33]
    kv = build_paged(lens, 2, 64, 16, torch.float32, device=DEVICE)
    q = rand((4, 8, 64), torch.float32).to(DEVICE)
    for plan in (None, bg.plan_decode(4, 48, 8, 2, 64, dtype=torch.float32, num_splits=3,
                                      tile=16)):
        out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                        backend=backend, plan=plan)
        assert torch.isfinite(out).all()
        assert (out[[0, 2]] == 0).all()
        assert_close(out, sdpa_decode(q, kv))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_sequences_empty_and_empty_batch(backend):
    kv = build_paged([0, 0], 1, 64, 16, torch.float16, device=DEVICE)
    q = rand((2, 4, 64), torch.float16).to(DEVICE)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    backend=backend)
    assert (out == 0).all()
    empty = bg.paged_decode_attention(q[:0], kv.k_cache, kv.v_cache, kv.block_tables[:0],
                                      kv.seq_lens[:0], backend=backend)
    assert empty.shape == (0, 4, 64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_non_contiguous_inputs_and_out_buffer(backend, dtype):
    """q is a slice of a fused QKV tensor, the caches have padded head and token strides, the
    block table is a column slice of a wider table, seq_lens is strided, and ``out`` is a
    transposed view: every stride is passed through, nothing is silently copied."""
    hq, hkv, d, bsz = 8, 2, 64, 16
    lens = [1, 16, 17, 40]
    kv = build_paged(lens, hkv, d, bsz, dtype, device=DEVICE)
    qkv = rand((4, hq + 2 * hkv, d), dtype).to(DEVICE)
    q = qkv[:, :hq]
    assert not q.is_contiguous()

    def padded(cache):  # [N, B, Hkv, D] inside [N, B, Hkv + 1, D + 16]
        big = torch.full((cache.shape[0], bsz, hkv + 1, d + 16), float("nan"), dtype=dtype,
                         device=DEVICE)
        big[:, :, :hkv, :d] = cache
        return big[:, :, :hkv, :d]

    k_cache, v_cache = padded(kv.k_cache), padded(kv.v_cache)
    assert not k_cache.is_contiguous()
    wide = torch.zeros((4, kv.block_tables.shape[1] + 5), dtype=torch.int32, device=DEVICE)
    wide[:, : kv.block_tables.shape[1]] = kv.block_tables
    tables = wide[:, : kv.block_tables.shape[1]]
    lens_strided = torch.stack([kv.seq_lens, kv.seq_lens], 1).reshape(-1)[::2]
    out = torch.full((hq, 4, d), float("nan"), dtype=dtype, device=DEVICE).transpose(0, 1)
    ret = bg.paged_decode_attention(q, k_cache, v_cache, tables, lens_strided, out=out,
                                    backend=backend)
    assert ret is out
    assert_close(out, sdpa_decode(q.contiguous(), kv))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_views_of_a_stacked_pool_and_plan_reuse(backend):
    """Per-layer caches are views of one pool; one plan and one workspace serve every layer."""
    layout = bg.KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                         dtype="float16")
    lens = [5, 40, 17]
    per_layer = [build_paged(lens, 2, 64, 16, torch.float16, seed=s, spare_blocks=0)
                 for s in (0, 0)]
    pool = layout.allocate_pool(per_layer[0].k_cache.shape[0], device=DEVICE)
    for layer, kv in enumerate(per_layer):
        # Same seed -> same tables; give layer 1 different contents.
        pool[layer, 0] = kv.k_cache * (layer + 1)
        pool[layer, 1] = kv.v_cache
        kv.k_seqs = [k * (layer + 1) for k in kv.k_seqs]
    plan = bg.plan_decode(3, 48, 8, 2, 64, dtype=torch.float16, num_splits=2, tile=16)
    workspace = plan.workspace(DEVICE)
    q = rand((3, 8, 64), torch.float16).to(DEVICE)
    tables, seq_lens = per_layer[0].block_tables.to(DEVICE), per_layer[0].seq_lens.to(DEVICE)
    for layer, (k_cache, v_cache) in enumerate(layout.kv_caches(pool)):
        out = bg.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, plan=plan,
                                        workspace=workspace, backend=backend)
        assert_close(out, sdpa_decode(q, per_layer[layer]))


def test_custom_scale():
    kv = build_paged([7, 20], 1, 64, 8, torch.float32, device=DEVICE)
    q = rand((2, 2, 64), torch.float32).to(DEVICE)
    for backend in ("torch", "triton"):
        out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                        scale=0.3, backend=backend)
        assert_close(out, sdpa_decode(q, kv, scale=0.3))


def test_plan_heuristic():
    # Few (sequence, KV head) programs and a long context -> split; many programs -> no split.
    small = bg.plan_decode(1, 32768, 32, 8, 128, num_sms=132)
    assert small.num_splits > 1
    assert small.num_splits * small.partition_size >= 32768
    assert small.partition_size % small.tile == 0
    big = bg.plan_decode(128, 32768, 32, 8, 128, num_sms=132)
    assert big.num_splits == 1
    short = bg.plan_decode(1, 100, 32, 8, 128, num_sms=132)
    assert short.num_splits == 1
    assert bg.plan_decode(1, 4096, 32, 8, 128, dtype=torch.float32).tile == 32
    with pytest.raises(ValueError, match="tile"):
        bg.plan_decode(1, 64, 4, 1, 64, tile=8)
    with pytest.raises(ValueError, match="num_splits"):
        bg.plan_decode(1, 64, 4, 1, 64, num_splits=0)


def test_plan_and_workspace_mismatch_named():
    kv = build_paged([5, 6], 1, 64, 16, torch.float32, device=DEVICE)
    q = rand((2, 2, 64), torch.float32).to(DEVICE)
    wrong_plan = bg.plan_decode(3, 32, 2, 1, 64, num_splits=2, tile=16)
    with pytest.raises(ValueError, match="^plan:"):
        bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                  plan=wrong_plan, backend="triton")
    plan = bg.plan_decode(2, 32, 2, 1, 64, num_splits=2, tile=16)
    ws = bg.plan_decode(2, 32, 2, 1, 64, num_splits=3, tile=16).workspace(DEVICE)
    with pytest.raises(ValueError, match="workspace.part_out"):
        bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                  plan=plan, workspace=ws, backend="triton")


def test_triton_and_twin_agree_on_a_random_ragged_batch():
    # A denser cross-check than SDPA alone: both paths, one batch of 9 ragged sequences.
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 70, (9,), generator=g).tolist()
    kv = build_paged(lens, 2, 64, 8, torch.float16, seed=3, device=DEVICE)
    q = rand((9, 6, 64), torch.float16, seed=4).to(DEVICE)
    outs = [bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                      backend=b) for b in ("torch", "triton")]
    assert_close(outs[1], outs[0])
    assert_close(outs[0], sdpa_decode(q, kv))

