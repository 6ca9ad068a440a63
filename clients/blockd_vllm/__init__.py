"""blockd as the node-wide, multi-tenant prefix cache of vLLM engines (a vLLM KV connector).

Enable it with ``kv_connector="BlockdConnector"``, ``kv_connector_module_path="blockd_vllm"``
(docs/vllm.md). Modules: ``settings`` (the extra config, checked at start), ``namespace``
(what decides sharing), ``layout`` (vLLM's KV tensors and blockd's pool as one view),
``scheduler`` and ``worker`` (the two roles), ``metadata`` (what passes between them),
``stats``, ``connector`` (vLLM's interface).
"""

from typing import Any

__all__ = ["BlockdConnector"]


def __getattr__(name: str) -> Any:
    """``BlockdConnector`` on first use (vLLM's loader does ``getattr(module, name)``), so the
    data path (``worker``, ``layout``) imports without vLLM, as on a GPU machine that has none."""
    if name == "BlockdConnector":
        from blockd_vllm.connector import BlockdConnector

        return BlockdConnector
    raise AttributeError(name)
