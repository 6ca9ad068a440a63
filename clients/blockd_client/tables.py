"""The worker's copy of its sequences' block tables, kept as one int32 tensor.

The daemon sends block-table *deltas* (a start index and the block ids from there on); the
worker applies them to ``block_tables`` (int32 ``[max_seqs, max_blocks]``, on the kernels'
device) and computes slot mappings locally: ``slot = table[p // B] * B + p % B``. The daemon is
never on the per-token path.
"""

from __future__ import annotations

from typing import Any


class BlockTables:
    def __init__(self, max_seqs: int, max_blocks: int, block_size: int,
                 device: Any = "cpu") -> None:
        import torch

        self.block_size = block_size
        self.tensor = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self._rows: dict[str, int] = {}
        self._free = list(range(max_seqs - 1, -1, -1))
        #: Host copy of each row's block ids (no device round trip to compute slots).
        self._host: dict[str, list[int]] = {}

    def row(self, seq_id: str) -> int:
        return self._rows[seq_id]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._rows

    def add(self, seq_id: str, block_ids: list[int], num_tokens: int) -> int:
        if not self._free:
            raise RuntimeError("block table is full: raise max_seqs")
        r = self._free.pop()
        self._rows[seq_id] = r
        self._host[seq_id] = []
        self.apply(seq_id, 0, block_ids, num_tokens)
        return r

    def apply(self, seq_id: str, start: int, block_ids: list[int], num_tokens: int) -> None:
        """Replace/extend the table from logical index ``start`` (a Step's delta)."""
        import torch

        host = self._host[seq_id]
        del host[start:]
        host.extend(block_ids)
        if len(host) > self.tensor.shape[1]:
            raise RuntimeError(f"sequence needs {len(host)} blocks: raise max_blocks")
        r = self._rows[seq_id]
        if block_ids:
            self.tensor[r, start:start + len(block_ids)] = torch.tensor(block_ids,
                                                                        dtype=torch.int32)
        self.lens[r] = num_tokens

    def set_len(self, seq_id: str, num_tokens: int) -> None:
        """A token count change that left the table as it was."""
        self.lens[self._rows[seq_id]] = num_tokens

    def remove(self, seq_id: str) -> None:
        r = self._rows.pop(seq_id)
        del self._host[seq_id]
        self.lens[r] = 0
        self._free.append(r)

    def blocks(self, seq_id: str) -> list[int]:
        return list(self._host[seq_id])

    def slots(self, seq_id: str, start: int, end: int) -> Any:
        """int64 slot mapping of positions ``start..end-1``."""
        import torch

        B = self.block_size
        table = self._host[seq_id]
        return torch.tensor([table[p // B] * B + p % B for p in range(start, end)],
                            dtype=torch.int64, device=self.tensor.device)
