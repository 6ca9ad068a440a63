"""Shared test helpers: build a paged cache from contiguous ground truth, and SDPA references.

Direction matters: each test starts from per-sequence contiguous K/V (the truth SDPA sees),
scatters it into shuffled, non-adjacent blocks of a pool full of random garbage, and points the
block tables at those blocks. Unused table entries hold out-of-pool ids, so a kernel that reads
past a sequence's last block, or mixes up blocks, reads garbage and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Per-dtype tolerances for outputs compared with SDPA computed in fp32 on the same (rounded)
# inputs. fp32: accumulation-order noise only. fp16: one fp16 ulp near 1 is ~1e-3, and the
# Triton path rounds probabilities to fp16 for p @ v, like FlashAttention. bf16: one bf16 ulp
# near 1 is 7.8e-3 (torch's own default bf16 rtol is 1.6e-2).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype])


@dataclass
class PagedKv:
    k_seqs: list[torch.Tensor]  # per sequence [L, Hkv, D], the ground truth
    v_seqs: list[torch.Tensor]
    k_cache: torch.Tensor  # [N, B, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, M]
    seq_lens: torch.Tensor  # int32 [S]


def build_paged(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    spare_blocks: int = 3,
    table_pad: int = 1,
    device: str = "cpu",
) -> PagedKv:
    """Random K/V for each sequence scattered into a shuffled pool (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)  # garbage everywhere not written below
    v_cache = torch.randn(shape, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g)  # shuffled, so a sequence's blocks are scattered
    max_blocks = max(needed, default=0) + table_pad
    # Entries past a sequence's last block are out of the pool: they must never be read.
    tables = torch.full((len(seq_lens), max_blocks), num_blocks + 7, dtype=torch.int32)
    k_seqs, v_seqs = [], []
    next_id = 0
    for s, n in enumerate(seq_lens):
        k = torch.randn((n, num_kv_heads, head_dim), generator=g).to(dtype)
        v = torch.randn((n, num_kv_heads, head_dim), generator=g).to(dtype)
        blocks = ids[next_id: next_id + needed[s]]
        next_id += needed[s]
        tables[s, : needed[s]] = blocks.to(torch.int32)
        for j, b in enumerate(blocks.tolist()):
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            k_cache[b, : rows.stop - rows.start] = k[rows]
            v_cache[b, : rows.stop - rows.start] = v[rows]
        k_seqs.append(k)
        v_seqs.append(v)
    return PagedKv(
        k_seqs, v_seqs, k_cache.to(device), v_cache.to(device), tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def sdpa_decode(q: torch.Tensor, kv: PagedKv, scale: float | None = None) -> torch.Tensor:
    """SDPA (fp32) over each sequence's contiguous K/V; q: [S, Hq, D] -> [S, Hq, D] in q.dtype.
    A zero-length sequence's row is zeros (SDPA would give NaN)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, (k, v) in enumerate(zip(kv.k_seqs, kv.v_seqs, strict=True)):
        if k.shape[0] == 0:
            continue
        o = F.scaled_dot_product_attention(
            q[s].float()[:, None, :],                 # [Hq, 1, D]
            k.float().transpose(0, 1).to(q.device),   # [Hkv, L, D]
            v.float().transpose(0, 1).to(q.device),
            scale=scale, enable_gqa=True)
        out[s] = o[:, 0]
    return out.to(q.dtype)


def sdpa_prefill(
    q: torch.Tensor, qo_indptr: torch.Tensor, kv: PagedKv, scale: float | None = None
) -> torch.Tensor:
    """SDPA (fp32) for packed new tokens q: [T, Hq, D]; row i of sequence s is at position
    L - q_len + i and sees keys 0..that position (bottom-right aligned causal mask)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    ip = qo_indptr.tolist()
    for s, (k, v) in enumerate(zip(kv.k_seqs, kv.v_seqs, strict=True)):
        q_len, n = ip[s + 1] - ip[s], k.shape[0]
        if q_len == 0:
            continue
        pos = torch.arange(n - q_len, n)[:, None]
        mask = (torch.arange(n)[None, :] <= pos).to(q.device)  # [q_len, L]
        o = F.scaled_dot_product_attention(
            q[ip[s]: ip[s + 1]].float().transpose(0, 1),  # [Hq, q_len, D]
            k.float().transpose(0, 1).to(q.device),
            v.float().transpose(0, 1).to(q.device),
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[ip[s]: ip[s + 1]] = o.transpose(0, 1)
    return out.to(q.dtype)


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)
