"""Pure-torch twins of the Triton kernels: the CPU execution path and the tests' second opinion.

Vectorised: K/V are gathered through the block table with one advanced-indexing copy per tile,
never a Python loop over tokens or blocks. Decode walks tiles of (sequences x context) with an
online softmax; prefill works per chunk of sequences and query rows. Temporaries stay bounded
(``DECODE_TILE_BYTES``, ``CHUNK_BYTES``) however long the context. Scores and softmax are
computed in fp32 whatever the cache dtype.

Callers are the public functions in ``decode``, ``prefill`` and ``cache_ops``, which validate
arguments first; the twins assume valid arguments (layouts: ``blockd_gpu.layout``).
"""

from __future__ import annotations

import torch

__all__ = [
    "decode_reference",
    "prefill_reference",
    "reshape_and_cache_reference",
    "copy_blocks_reference",
]

CHUNK_BYTES = 256 << 20  # prefill: gathered K/V and scores per pass
DECODE_TILE_BYTES = 2 << 20  # decode: fp32 K+V gathered per tile; stays in L2/L3 (measured)


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks_used: int
) -> torch.Tensor:
    """Contiguous copy of the first ``num_blocks_used`` blocks of each row, head-major.

    cache: [N, B, Hkv, D]; block_tables: [c, M]; seq_lens: [c]  ->  [Hkv, c, num_blocks_used*B, D]
    """
    block_size = cache.shape[1]
    table = block_tables[:, :num_blocks_used].to(torch.int64)
    # Entries past a sequence's last block may hold anything (stale ids, -1): read block 0 there
    # instead; those positions are masked out of the softmax anyway.
    used = torch.arange(num_blocks_used, device=cache.device)[None, :] < (
        (seq_lens.to(torch.int64) + block_size - 1) // block_size)[:, None]
    table = torch.where(used, table, 0)
    # Indexing a head-major view puts Hkv first in the (freshly allocated, contiguous) result, so
    # the batched matmuls below see a flat batch of (head, sequence) with no further copy.
    gathered = cache.permute(2, 0, 1, 3)[:, table]  # [Hkv, c, nb, B, D]
    hkv, c = gathered.shape[:2]
    return gathered.reshape(hkv, c, num_blocks_used * block_size, cache.shape[3])


def _chunks(total: int, per_item_bytes: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(1, per_item_bytes))
    return [(i, min(total, i + step)) for i in range(0, total, step)]


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of ``paged_decode_attention`` (same arguments; see its docstring).

    Flash-decoding on the CPU: the context is walked in tiles of about ``DECODE_TILE_BYTES`` of
    gathered K/V with an online softmax, so each gathered tile is consumed while it is still in
    cache instead of being written out to memory and read back (which made the first, gather-all
    version of this twin 7-16x slower than contiguous SDPA).
    """
    # q: [S, Hq, D]  k_cache/v_cache: [N, B, Hkv, D]  block_tables: [S, M]  seq_lens: [S]
    num_seqs, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_qo_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lens64 = seq_lens.to(torch.int64)
    max_len = int(lens64.max()) if num_seqs else 0
    if max_len == 0:
        return out.zero_()
    num_blocks_used = -(-max_len // block_size)
    token_bytes = 2 * num_kv_heads * head_dim * 4
    tile_tokens = max(block_size, DECODE_TILE_BYTES // token_bytes)
    if tile_tokens >= num_blocks_used * block_size:
        blocks_per_tile = num_blocks_used  # whole contexts; several sequences per tile
        seqs_per_tile = max(1, tile_tokens // (num_blocks_used * block_size))
    else:
        blocks_per_tile = tile_tokens // block_size
        seqs_per_tile = 1
    # Entries past a sequence's last block may hold anything: read block 0 there (masked).
    used = torch.arange(num_blocks_used, device=q.device)[None, :] < (
        (lens64 + block_size - 1) // block_size)[:, None]
    table = torch.where(used, block_tables[:, :num_blocks_used].to(torch.int64), 0)
    for s0 in range(0, num_seqs, seqs_per_tile):
        s1 = min(num_seqs, s0 + seqs_per_tile)
        c, lens = s1 - s0, lens64[s0:s1]
        shortest, longest = int(lens.min()), int(lens.max())
        if longest == 0:
            out[s0:s1] = 0
            continue
        # head h reads KV head h // G; the scale is folded into q once.
        qg = (q[s0:s1].float() * scale).view(c, num_kv_heads, group, head_dim)
        m = l_sum = acc = None
        for j0 in range(0, -(-longest // block_size), blocks_per_tile):
            j1 = min(-(-longest // block_size), j0 + blocks_per_tile)
            ids = table[s0:s1, j0:j1]
            t0, t = j0 * block_size, (j1 - j0) * block_size
            # [c, nb, B, Hkv, D] -> [c, Hkv, T, D]: whole-block gathers, then an in-cache relayout.
            k = k_cache[ids].view(c, t, num_kv_heads, head_dim).transpose(1, 2).float()
            v = v_cache[ids].view(c, t, num_kv_heads, head_dim).transpose(1, 2).float()
            scores = torch.matmul(qg, k.transpose(2, 3))  # [c, Hkv, G, T]
            if t0 + t > shortest:  # some sequence ends inside this tile
                pos = torch.arange(t0, t0 + t, device=q.device)
                scores.masked_fill_((pos[None, :] >= lens[:, None])[:, None, None, :],
                                    float("-inf"))
            tile_max = scores.amax(-1)
            m_new = tile_max if m is None else torch.maximum(m, tile_max)
            if t0 >= shortest:
                # A row may have no keys yet (m_new = -inf): use 0 so exp gives 0, not NaN.
                m_new = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = scores.sub_(m_new[..., None]).exp_()
            if m is None:
                l_sum, acc = p.sum(-1), torch.matmul(p, v)
            else:
                alpha = torch.exp(m - m_new)
                l_sum = l_sum.mul_(alpha).add_(p.sum(-1))
                acc = acc.mul_(alpha[..., None]).add_(torch.matmul(p, v))
            m = m_new
        assert acc is not None and l_sum is not None  # longest > 0: at least one tile ran
        # Zero-length sequences: no keys, l_sum == 0, output zeros.
        o = acc / torch.where(l_sum > 0, l_sum, 1.0)[..., None]
        out[s0:s1] = o.view(c, num_qo_heads, head_dim)
    return out


def prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of ``paged_prefill_attention`` (same arguments; see its docstring)."""
    # q: [T, Hq, D] packed  k/v_cache: [N, B, Hkv, D]  block_tables: [S, M]  seq_lens: [S]
    # qo_indptr: [S + 1]
    num_tokens, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_qo_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    indptr = qo_indptr.to(torch.int64)
    q_lens = indptr[1:] - indptr[:-1]
    lens = seq_lens.to(torch.int64)
    max_len = int(lens.max())
    num_blocks_used = -(-max_len // block_size)
    t = num_blocks_used * block_size
    per_seq = 2 * num_kv_heads * t * head_dim * 4
    for s0, s1 in _chunks(num_seqs, per_seq):
        c = s1 - s0
        tok0, tok1 = int(indptr[s0]), int(indptr[s1])
        if tok0 == tok1:
            continue
        k = _gather_kv(k_cache, block_tables[s0:s1], seq_lens[s0:s1], num_blocks_used).float()
        v = _gather_kv(v_cache, block_tables[s0:s1], seq_lens[s0:s1], num_blocks_used).float()
        ql, sl = q_lens[s0:s1], lens[s0:s1]
        max_q = int(ql.max())
        # Packed rows -> (sequence, row within its new tokens).
        seq_of_tok = torch.repeat_interleave(torch.arange(c, device=q.device), ql)
        row_of_tok = torch.arange(tok0, tok1, device=q.device) - indptr[s0:s1][seq_of_tok]
        keys = torch.arange(t, device=q.device)
        rows_per_pass = max(1, CHUNK_BYTES // max(1, c * num_qo_heads * t * 4 * 2))
        for r0 in range(0, max_q, rows_per_pass):
            r1 = min(max_q, r0 + rows_per_pass)
            sel = (row_of_tok >= r0) & (row_of_tok < r1)
            r = r1 - r0
            qp = q.new_zeros((c, r, num_qo_heads, head_dim), dtype=torch.float32)
            qp[seq_of_tok[sel], row_of_tok[sel] - r0] = q[tok0:tok1][sel].float()
            # [c, r, Hkv, G, D] -> [Hkv, c, G * r, D]
            qh = qp.view(c, r, num_kv_heads, group, head_dim).permute(2, 0, 3, 1, 4)
            qh = qh.reshape(num_kv_heads * c, group * r, head_dim)
            scores = torch.matmul(qh, k.view(num_kv_heads * c, t, head_dim).transpose(1, 2))
            scores = scores.view(num_kv_heads, c, group, r, t).mul_(scale)
            # Row i of a sequence is position seq_len - q_len + i: it sees keys up to itself.
            pos = (sl - ql)[:, None] + torch.arange(r0, r1, device=q.device)[None, :]  # [c, r]
            allowed = keys[None, None, :] <= pos[:, :, None]  # [c, r, T]
            scores.masked_fill_(~allowed[None, :, None], float("-inf"))
            p = torch.softmax(scores, dim=-1).view(num_kv_heads * c, group * r, t)
            o = torch.matmul(p, v.view(num_kv_heads * c, t, head_dim))
            o = o.view(num_kv_heads, c, group, r, head_dim).permute(1, 3, 0, 2, 4)
            o = o.reshape(c, r, num_qo_heads, head_dim)
            out[tok0:tok1][sel] = o[seq_of_tok[sel], row_of_tok[sel] - r0].to(out.dtype)
    return out


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Twin of ``reshape_and_cache`` (same arguments; see its docstring)."""
    # key/value: [T, Hkv, D]  k/v_cache: [N, B, Hkv, D]  slot_mapping: [T]
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # PAD_SLOT_ID (-1) rows are not written
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def copy_blocks_reference(kv_pool: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Twin of ``copy_blocks`` (same arguments; see its docstring)."""
    # kv_pool: [L, 2, N, B, Hkv, D]  block_mapping: [P, 2]
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    kv_pool.index_copy_(2, dst, kv_pool.index_select(2, src))
