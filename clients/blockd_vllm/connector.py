"""``BlockdConnector``: vLLM's KV-connector interface (v1) over blockd.

vLLM makes one instance per role: the SCHEDULER one (in the engine core) decides what blockd
holds and plans the copies (``blockd_vllm.scheduler``), the WORKER one (in each worker process)
does the copies and publishes the fence (``blockd_vllm.worker``). Enabled with::

    --kv-transfer-config '{"kv_connector": "BlockdConnector",
                           "kv_connector_module_path": "blockd_vllm", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"target": "unix:/run/blockd/blockd.sock",
                                                         "tenant": "acme",
                                                         "token_file": "/var/run/blockd/token"}}'

(docs/vllm.md). Loads are synchronous from the scheduler's view (they finish inside the step,
before attention reads the blocks), saves are reported a step or two later (on CPU they run on
the worker's copy thread, ``blockd_vllm.copier``). The scheduler role never
waits on blockd: a new request is answered None until its admit (sent with the other admits of
the same ``schedule()``, off the scheduler thread) is answered, at most a step or two; a request
that ended with a generated block still to save keeps its vLLM blocks for one more step
(``request_finished`` answers True, the worker reports it in ``finished_sending``). While
blockd fetches a prompt's prefix from its remote tier the answer is ``(n, True)``: vLLM's
async-load path (``blockd_vllm.remote_loads``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from blockd_vllm.layout import engine_shape
from blockd_vllm.link import detach_session
from blockd_vllm.metadata import BlockdMetadata
from blockd_vllm.settings import Settings
from blockd_vllm.stats import BlockdConnectorStats

log = logging.getLogger("blockd_vllm")


class BlockdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        self.settings = Settings.parse(kvt.kv_connector_extra_config)
        self.shape = engine_shape(vllm_config)
        self.scheduler: Any = None
        self.worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            if kvt.kv_load_failure_policy != "recompute":
                # A cache miss must never fail a request: a load that could not run is
                # recomputed (vLLM reads this right after constructing the connector).
                log.info("blockd_vllm: kv_load_failure_policy %r -> 'recompute'",
                         kvt.kv_load_failure_policy)
                kvt.kv_load_failure_policy = "recompute"
            from blockd_vllm.scheduler import SchedulerSide

            self.scheduler = SchedulerSide(vllm_config, self.settings, self.shape,
                                           block_ids_of=self._block_ids)
        else:
            from blockd_vllm.preflight import preflight
            from blockd_vllm.worker import WorkerSide

            preflight(self.settings, self.shape)
            self.worker = WorkerSide(self.shape,
                                     getattr(vllm_config.cache_config, "kv_cache_layout", None))

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.shape.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker.rank = get_tensor_model_parallel_rank()
        self.worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """First thing in a step: the earlier steps' saves may run on the copy thread now,
        during this step's forward; after a preemption they run first, before this step's
        loads and forward may write the preempted requests' blocks (``blockd_vllm.copier``)."""
        if isinstance(kv_connector_metadata, BlockdMetadata) and kv_connector_metadata.drain:
            self.worker.drain()
        else:
            self.worker.release()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, BlockdMetadata):
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves run once per step in ``wait_for_save``, after every layer wrote its K/V."""

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, BlockdMetadata):
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks vLLM kept for a save (``request_finished`` True) and whose
        save ran in this step (vLLM frees their blocks now), and requests answered ``(n, True)``
        whose loads ran in this step (vLLM schedules them now)."""
        if self.worker is None:
            return None, None
        sent, recving = self.worker.take_finished()
        return sent or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.take_report() if self.worker is not None else None

    def get_kv_connector_stats(self) -> Any:
        """The worker's copies, or (the scheduler role, which vLLM aggregates with them) the
        scheduler thread's cost: schedules, Steps sent, time in the connector's hooks."""
        if self.worker is not None:
            counters = self.worker.take_counters()
            if not counters:
                return None  # (most steps)
            stats = BlockdConnectorStats.take(counters)
        else:
            stats = self.scheduler.take_stats()
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return BlockdConnectorStats(data=dict(data)) if data is not None else \
            BlockdConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from blockd_vllm.stats import BlockdPromMetrics

        return BlockdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """A clean exit detaches the engine's session (blockd releases what it held now, not
        when its lease runs out). The worker does it: vLLM shuts the workers down first,
        after their last step (no copy in flight), and may kill the engine core before its
        own shutdown reaches the scheduler side, which detaches too when it gets there."""
        if self.worker is not None:
            ref = self.worker.pool_ref
            last = self.worker.retire()  # (tensor parallel: the last rank to retire detaches)
            self.worker.close()
            if ref is not None and last and detach_session(self.settings, ref.session_id):
                log.info("blockd_vllm: detached session %s (engine shut down)", ref.session_id)
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side ------------------------------------------------------------------------

    def _block_ids(self, request_id: str) -> Any:
        return self._kv_cache_manager.get_block_ids(request_id)

    def on_new_request(self, request: Any) -> None:
        self.scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        if num_external_tokens > 0:
            self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.saves_reported(getattr(connector_output, "kv_connector_worker_meta",
                                              None))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, block_ids), None
