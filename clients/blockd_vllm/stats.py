"""The connector's figures in vLLM's own connector stats (logged and exported by vLLM).

Two roles report: each worker its copies (``KEYS``: blocks loaded from and saved to blockd,
failures), the scheduler role the scheduler thread's cost (``SCHEDULER_KEYS``: ``schedule()``
calls, blockd Steps sent for them, nanoseconds the scheduler thread spent in the connector's
hooks, lock waits included). vLLM aggregates both into one object per interval; ``reduce`` (what
vLLM's "KV Transfer metrics" log line prints) adds the ratios a benchmark reads: Steps per
schedule and the connector's microseconds per schedule. Every figure is also a Prometheus
counter of vLLM's (``BlockdPromMetrics``: ``vllm:blockd_<key>_total``, the times in
microseconds as ``vllm:blockd_scheduler_us_total`` and ``vllm:blockd_idle_wait_us_total``:
``LLM.get_metrics()`` reads counters as integers), which ``LLM.get_metrics()`` and
``/metrics`` show.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

KEYS = ("loaded_blocks", "saved_blocks", "load_failures", "save_failures", "map_failures")
#: What went wrong on the scheduler side (each request it concerns was computed, or asked again).
FAULT_KEYS = ("degraded_episodes", "epoch_changes", "admits_resent", "admit_refused",
              "late_answers")
SCHEDULER_KEYS = ("schedules", "blockd_steps", "scheduler_ns", "idle_wait_ns", "async_loads",
                  "admit_wait_expired", *FAULT_KEYS)
DOCS = {
    "loaded_blocks": "Blocks the workers loaded from blockd.",
    "saved_blocks": "Blocks the workers saved to blockd.",
    "load_failures": "Blocks whose load could not run (vLLM recomputed them).",
    "save_failures": "Steps whose saves failed (never committed).",
    "map_failures": "Times a worker could not map blockd's pool.",
    "schedules": "schedule() calls (build_connector_meta).",
    "blockd_steps": "blockd Steps the scheduler side sent (off the scheduler thread).",
    "scheduler_ns": "Time vLLM's scheduler thread spent in the connector's hooks (idle waits "
                    "apart).",
    "idle_wait_ns": "Time an engine with nothing else to run waited in the connector's hooks "
                    "for blockd's answer to an admit (instead of stepping again at once).",
    "async_loads": "Requests answered (n, True): loaded asynchronously from blockd's remote "
                   "tier while they waited in WAITING_FOR_REMOTE_KVS.",
    "admit_wait_expired": "New requests computed without the cache because blockd's answer to "
                          "their admit took longer than admit_wait_s while the engine ran "
                          "others (their prompts were saved once it came).",
    "degraded_episodes": "Times blockd stopped answering (requests computed until it answered).",
    "epoch_changes": "Times the session re-attached: blockd restarted (a new pool epoch) or "
                     "had reaped the session (its lease ran out while the engine stalled).",
    "admits_resent": "Admits sent again on a re-attached session (the Step carrying them "
                     "found the old session gone).",
    "admit_refused": "Admits blockd refused (those requests were computed).",
    "late_answers": "Steps that went unanswered (a deadline passed) and were answered once "
                    "blockd answered again: applied exactly once, the sequences their admits "
                    "created released.",
}


@dataclass
class BlockdConnectorStats(KVConnectorStats):
    """Counts since the last collection."""

    @classmethod
    def take(cls, counters: Counter[str]) -> BlockdConnectorStats:
        data = {k: int(counters.pop(k, 0)) for k in KEYS}
        return cls(data=data)

    def reset(self) -> None:
        self.data = {k: 0 for k in KEYS}

    def aggregate(self, other: KVConnectorStats) -> BlockdConnectorStats:
        for k in (*KEYS, *SCHEDULER_KEYS):
            if k in self.data or k in other.data:
                self.data[k] = int(self.data.get(k, 0)) + int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in KEYS}
        if any(k in self.data for k in SCHEDULER_KEYS):
            schedules = int(self.data.get("schedules", 0))
            steps = int(self.data.get("blockd_steps", 0))
            ns = int(self.data.get("scheduler_ns", 0))
            out.update(schedules=schedules, blockd_steps=steps,
                       steps_per_schedule=round(steps / schedules, 3) if schedules else 0.0,
                       scheduler_us_per_schedule=round(ns / schedules / 1e3, 1)
                       if schedules else 0.0)
            out.update({k: int(self.data.get(k, 0)) for k in FAULT_KEYS})
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in (*KEYS, *SCHEDULER_KEYS))

    def to_dict(self) -> dict[str, Any]:
        return self.data


class SchedulerFigures:
    """The scheduler side's cumulative counters as deltas since the last collection."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {k: 0 for k in SCHEDULER_KEYS}

    def take(self, counters: Counter[str]) -> BlockdConnectorStats:
        now = {k: int(counters[k]) for k in SCHEDULER_KEYS}
        data = {k: now[k] - self._last[k] for k in SCHEDULER_KEYS}
        self._last = now
        return BlockdConnectorStats(data=data)


class BlockdPromMetrics(KVConnectorPromMetrics):
    """Each figure as a counter of vLLM's Prometheus metrics, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key in (*KEYS, *SCHEDULER_KEYS):
            name = key[:-3] + "_us" if key.endswith("_ns") else key
            counter = self._counter_cls(name=f"vllm:blockd_{name}", documentation=DOCS[key],
                                        labelnames=labelnames)
            self.counters[key] = {i: counter.labels(*values)
                                  for i, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            value = transfer_stats_data.get(key)
            if value:
                per_engine[engine_idx].inc(value / 1e3 if key.endswith("_ns") else value)
