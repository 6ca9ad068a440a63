"""One scheduler step's kernel metadata, built from the session's block tables.

The daemon is not on the per-token path: it hands out block tables once per Step, and the
worker derives everything the kernels need locally (layouts: ``blockd_gpu.layout``):

- ``slot_mapping[t] = table[p // B] * B + p % B`` for each new token t at position p (where
  ``reshape_and_cache`` writes its K/V; the seeds' "slot mapping", not the block table);
- per-sequence block-table rows and ``seq_lens`` (tokens of K/V each sequence has *after* this
  step's writes) for the attention kernels;
- ``qo_indptr`` for the packed prefill chunks.

``seq_lens`` comes from the worker's own count of written tokens, not from the daemon's
``num_tokens``: a prompt is admitted whole but prefilled in chunks, so the daemon's count runs
ahead of what the pool holds until the last chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockd_client.tables import BlockTables

__all__ = ["Work", "StepBatch"]


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step: ``tokens`` at positions ``start..start+len-1``."""

    seq_id: str
    tokens: Sequence[int]
    start: int
    #: Whether the step needs the logits of this work's last token.
    want_logits: bool


@dataclass(frozen=True)
class StepBatch:
    """Packed inputs of one step: prefill chunks first, then one token per decoding sequence.

    T = all new tokens, Tp = prefill tokens, Sp / Sd = prefill / decode sequences,
    M = block-table columns used (enough for the longest sequence in the step).
    """

    tokens: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], absolute positions (RoPE)
    slot_mapping: torch.Tensor  # int64 [T]
    num_prefill_tokens: int  # Tp
    prefill_tables: torch.Tensor  # int32 [Sp, M]
    prefill_seq_lens: torch.Tensor  # int32 [Sp]
    qo_indptr: torch.Tensor  # int32 [Sp + 1]
    max_q_len: int
    decode_tables: torch.Tensor  # int32 [Sd, M]
    decode_seq_lens: torch.Tensor  # int32 [Sd]
    logit_rows: torch.Tensor  # int64 [R], rows of T whose logits are returned

    @classmethod
    def build(cls, prefill: Sequence[Work], decode: Sequence[Work], tables: BlockTables,
              device: torch.device | str) -> StepBatch:
        if any(len(w.tokens) != 1 for w in decode):
            raise ValueError("decode work must be exactly one token per sequence")
        B = tables.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for w in (*prefill, *decode):
            table = tables.blocks(w.seq_id)
            end = w.start + len(w.tokens)
            if -(-end // B) > len(table):
                raise RuntimeError(f"sequence {w.seq_id}: {end} tokens but only {len(table)} "
                                   f"blocks of {B} in its table")
            tokens.extend(w.tokens)
            positions.extend(range(w.start, end))
            slots.extend(table[p // B] * B + p % B for p in range(w.start, end))
            if w.want_logits:
                logit_rows.append(len(tokens) - 1)
        max_len = max((w.start + len(w.tokens) for w in (*prefill, *decode)), default=0)
        cols = max(1, -(-max_len // B))

        def rows(work: Sequence[Work]) -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.tensor([tables.row(w.seq_id) for w in work], dtype=torch.int64,
                               device=tables.tensor.device)
            lens = torch.tensor([w.start + len(w.tokens) for w in work], dtype=torch.int32,
                                device=device)
            return tables.tensor[idx, :cols].to(device), lens

        q_lens = [len(w.tokens) for w in prefill]
        indptr = [0]
        for n in q_lens:
            indptr.append(indptr[-1] + n)
        prefill_tables, prefill_lens = rows(prefill)
        decode_tables, decode_lens = rows(decode)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(tokens=i64(tokens), positions=i64(positions), slot_mapping=i64(slots),
                   num_prefill_tokens=indptr[-1], prefill_tables=prefill_tables,
                   prefill_seq_lens=prefill_lens,
                   qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
                   max_q_len=max(q_lens, default=0), decode_tables=decode_tables,
                   decode_seq_lens=decode_lens, logit_rows=i64(logit_rows))
