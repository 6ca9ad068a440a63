"""A KV connector that does nothing: the baseline that isolates BlockdConnector's own cost.

``bench/vllm_connector.py`` loads it through vLLM's ``kv_transfer_config`` exactly as it loads
BlockdConnector (``{"kv_connector": "NoopConnector", "kv_connector_module_path":
"noop_connector", "kv_role": "kv_both"}``, with ``bench/`` on the engine's ``PYTHONPATH``), so
an engine with it pays everything vLLM itself adds for *having* a connector (the connector calls
in ``schedule()`` and in every forward, the worker's connector output, the CPU binding vLLM picks
when a ``kv_transfer_config`` is set) and nothing of blockd's: every request gets 0 external
tokens, nothing is loaded, nothing is saved, and no request is held after it finishes.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class NoopMetadata(KVConnectorMetadata):
    """Nothing to load or save in any step."""


class NoopConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)

    # -- worker side: no copies ----------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side: never a hit -----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NoopMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
