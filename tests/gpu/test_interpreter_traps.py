"""One test per known trap of running (and testing) Triton kernels in the CPU interpreter.

1. bf16 ``tl.dot`` is wrong under TRITON_INTERPRET: the kernels upcast bf16 operands to fp32
   there. (Removing the upcast makes the bf16 comparisons fail by ~1e9.)
2. int32 offset arithmetic wraps silently: block ids and slots are widened to int64 before they
   multiply a stride. Tested on pools past 2**31 elements (below).
3. Nothing is bounds-checked (a bad block id is a wild read on a GPU, a segfault here): ids are
   validated on the host before any launch.
4. Zero-length sequences: no NaN from an empty softmax, zero rows out.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from _kvtest import PagedKv, assert_close, build_paged, rand, sdpa_decode, sdpa_prefill

import blockd_gpu as bg
from blockd_gpu._triton import decode_kernels, launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]


# --- 1. bf16 dot products ------------------------------------------------------------------

def test_bf16_dots_are_upcast_in_the_interpreter_only():
    assert decode_kernels.dot_dtype(torch.bfloat16, interpreted=True) == tl.float32
    assert decode_kernels.dot_dtype(torch.bfloat16, interpreted=False) == tl.bfloat16
    assert decode_kernels.dot_dtype(torch.float16, interpreted=True) == tl.float16
    assert decode_kernels.dot_dtype(torch.float32, interpreted=False) == tl.float32


def test_bf16_decode_and_prefill_match_sdpa_in_triton():
    # Large-magnitude values make a wrong bf16 dot unmistakable.
    kv = build_paged([1, 16, 33], 2, 64, 16, torch.bfloat16, seed=11, device=DEVICE)
    q = (rand((3, 4, 64), torch.float32, seed=12) * 4).to(torch.bfloat16).to(DEVICE)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    backend="triton")
    assert_close(out, sdpa_decode(q, kv))
    indptr = torch.tensor([0, 1, 1, 3], dtype=torch.int32, device=DEVICE)
    out = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr, backend="triton")
    assert_close(out, sdpa_prefill(q, indptr, kv))


# --- 2. int64 offsets ----------------------------------------------------------------------

BLOCK, HEADS, DIM = 16, 1, 16
BLOCK_NUMEL = BLOCK * HEADS * DIM  # 256 elements
FAR = 1 << 23  # FAR * BLOCK_NUMEL == 2**31: the first block whose offset int32 cannot hold
NUM_BLOCKS = FAR + 64


def huge_pool(num_layers: int = 1) -> torch.Tensor:
    """A stacked fp16 pool ``[num_layers, 2, 2**23 + 64, 16, 1, 16]``: ~2**32 elements (8 GiB)
    per layer, reserved with ``torch.empty`` as *virtual* memory. Linux maps pages lazily, so
    only the handful of blocks a test writes or reads become resident (a few MiB); neither
    backend touches the rest (the interpreter uses CPU tensors in place). Skips if the OS
    refuses the reservation."""
    try:
        return torch.empty((num_layers, 2, NUM_BLOCKS, BLOCK, HEADS, DIM), dtype=torch.float16,
                           device=DEVICE)
    except (RuntimeError, MemoryError) as exc:  # pragma: no cover - depends on the host
        pytest.skip(f"cannot reserve an 8 GiB virtual pool here: {exc}")


def far_kv(pool: torch.Tensor, lens: list[int], ids: list[list[int]]) -> PagedKv:
    """Write random K/V for each sequence into the given (mostly far) block ids."""
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    k_seqs, v_seqs = [], []
    table = torch.zeros((len(lens), max(map(len, ids))), dtype=torch.int32)
    for s, (n, blocks) in enumerate(zip(lens, ids, strict=True)):
        k = rand((n, HEADS, DIM), torch.float16, seed=20 + s)
        v = rand((n, HEADS, DIM), torch.float16, seed=40 + s)
        padded = torch.zeros((len(blocks) * BLOCK, HEADS, DIM), dtype=torch.float16)
        padded[:n] = k
        k_cache[blocks] = padded.view(len(blocks), BLOCK, HEADS, DIM).to(DEVICE)
        padded[:n] = v
        v_cache[blocks] = padded.view(len(blocks), BLOCK, HEADS, DIM).to(DEVICE)
        table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k_seqs.append(k)
        v_seqs.append(v)
    return PagedKv(k_seqs, v_seqs, k_cache, v_cache, table.to(DEVICE),
                   torch.tensor(lens, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_offsets_decode_and_prefill_beyond_2_31_elements(backend):
    pool = huge_pool()
    ids = [[FAR + 5, 3, FAR + 60], [NUM_BLOCKS - 1]]
    kv = far_kv(pool, [40, 9], ids)
    assert (NUM_BLOCKS - 1) * kv.k_cache.stride(0) > 2**31  # the offsets really overflow int32
    q = rand((2, 2, DIM), torch.float16, seed=3).to(DEVICE)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    backend=backend)
    assert_close(out, sdpa_decode(q, kv))
    plan = bg.plan_decode(2, 48, 2, 1, DIM, dtype=torch.float16, num_splits=2, tile=16)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    backend=backend, plan=plan)
    assert_close(out, sdpa_decode(q, kv))
    qp = rand((5, 2, DIM), torch.float16, seed=4).to(DEVICE)
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE)
    out = bg.paged_prefill_attention(qp, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr, backend=backend)
    assert_close(out, sdpa_prefill(qp, indptr, kv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_offsets_reshape_and_cache_and_copy_blocks(backend):
    pool = huge_pool()
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    key = rand((3, HEADS, DIM), torch.float16, seed=5).to(DEVICE)
    value = rand((3, HEADS, DIM), torch.float16, seed=6).to(DEVICE)
    blocks = [FAR + 1, NUM_BLOCKS - 1, 2]
    slots = torch.tensor([b * BLOCK + 7 for b in blocks], dtype=torch.int64, device=DEVICE)
    bg.reshape_and_cache(key, value, k_cache, v_cache, slots, backend=backend)
    for i, b in enumerate(blocks):
        assert torch.equal(k_cache[b, 7], key[i]) and torch.equal(v_cache[b, 7], value[i])
    # V of layer 0 starts 2**32 elements into the pool; copy a far block to a near one and back.
    mapping = torch.tensor([[FAR + 1, 9], [NUM_BLOCKS - 1, FAR + 30]], dtype=torch.int64,
                           device=DEVICE)
    bg.copy_blocks(pool, mapping, backend=backend)
    assert torch.equal(k_cache[9], k_cache[FAR + 1]) and torch.equal(v_cache[9, 7], value[0])
    assert torch.equal(v_cache[FAR + 30], v_cache[NUM_BLOCKS - 1])


# --- 3. invalid block ids are caught before launch -----------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if any Triton kernel is launched."""
    def refuse(self):
        raise AssertionError(f"{self.name} was launched with invalid arguments")
    monkeypatch.setattr(launch.Launch, "__call__", refuse)


@pytest.mark.parametrize("bad", [-1, 6, 1 << 30])
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_id_outside_pool_rejected_before_launch(no_launch, backend, bad):
    kv = build_paged([5, 20], 1, 64, 16, torch.float32, spare_blocks=3, device=DEVICE)
    assert kv.k_cache.shape[0] == 6
    kv.block_tables[1, 1] = bad  # a block that sequence 1 uses (tokens 16..19)
    q = rand((2, 2, 64), torch.float32).to(DEVICE)
    with pytest.raises(ValueError, match=rf"^block_tables: block id {bad} at \[1, 1\]"):
        bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                  backend=backend)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="^block_tables: block id"):
        bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                   indptr, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_slots_and_copy_ids_rejected_before_launch(no_launch, backend):
    k_cache = torch.zeros((4, 8, 1, 16), device=DEVICE)
    key = torch.zeros((2, 1, 16), device=DEVICE)
    for slots, msg in (([0, 32], "outside the pool"), ([-2, 1], "outside the pool"),
                       ([3, 3], "appears twice")):
        with pytest.raises(ValueError, match=f"^slot_mapping: .*{msg}"):
            bg.reshape_and_cache(key, key, k_cache, k_cache.clone(),
                                 torch.tensor(slots, device=DEVICE), backend=backend)
    pool = torch.zeros((2, 2, 4, 8, 1, 16), device=DEVICE)
    for pairs, msg in (([[0, 4]], "outside the pool"), ([[0, 1], [2, 1]], "appears twice"),
                       ([[0, 1], [1, 2]], "also a source")):
        with pytest.raises(ValueError, match=f"^block_mapping: .*{msg}"):
            bg.copy_blocks(pool, torch.tensor(pairs, device=DEVICE), backend=backend)


def test_unused_table_entries_are_not_checked_or_read():
    # build_paged fills entries past each sequence's last block with an out-of-pool id; the
    # call succeeds because only the blocks a sequence uses are validated and read.
    kv = build_paged([3, 17], 1, 64, 16, torch.float32, table_pad=2, device=DEVICE)
    assert int(kv.block_tables.max()) >= kv.k_cache.shape[0]
    q = rand((2, 1, 64), torch.float32).to(DEVICE)
    for backend in BACKENDS:
        out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                        kv.seq_lens, backend=backend)
        assert_close(out, sdpa_decode(q, kv))


# --- 4. zero-length sequences --------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length_sequences_in_prefill_and_decode(backend):
    kv = build_paged([0, 12, 0], 2, 64, 8, torch.float16, device=DEVICE)
    q = rand((3, 4, 64), torch.float16).to(DEVICE)
    out = bg.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                    backend=backend)
    assert torch.isfinite(out).all() and not out[0].any() and not out[2].any()
    # Prefill: sequences with no new tokens (and no cache) in a packed batch.
    indptr = torch.tensor([0, 0, 3, 3], dtype=torch.int32, device=DEVICE)
    out = bg.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                     indptr, backend=backend)
    assert_close(out, sdpa_prefill(q, indptr, kv))
