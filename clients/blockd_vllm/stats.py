"""The connector's figures in vLLM's own connector stats (logged and exported by vLLM)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

KEYS = ("loaded_blocks", "saved_blocks", "load_failures", "save_failures", "map_failures")


@dataclass
class BlockdConnectorStats(KVConnectorStats):
    """Counts since the last collection: blocks loaded from and saved to blockd, failures."""

    @classmethod
    def take(cls, counters: Counter[str]) -> BlockdConnectorStats:
        data = {k: int(counters.pop(k, 0)) for k in KEYS}
        return cls(data=data)

    def reset(self) -> None:
        self.data = {k: 0 for k in KEYS}

    def aggregate(self, other: KVConnectorStats) -> BlockdConnectorStats:
        for k in KEYS:
            self.data[k] = int(self.data.get(k, 0)) + int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: int(self.data.get(k, 0)) for k in KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in KEYS)

    def to_dict(self) -> dict[str, Any]:
        return self.data
