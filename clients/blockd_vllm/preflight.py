"""Checks at engine start that need blockd itself, made from the worker process.

vLLM builds the worker side of a connector before it loads the model and the scheduler side only
after the KV cache exists, so the scheduler's Attach (which checks the whole layout) comes a
model load later. This asks blockd's Stats at once: whether the target answers, whether the
token is accepted, whether the token may act for the tenant, and whether the pool's block size
is vLLM's, each refused with the extra-config key and both values named.
"""

from __future__ import annotations

import grpc

from blockd_client import BlockdError, Client
from blockd_vllm.layout import KvShape
from blockd_vllm.link import until_answered
from blockd_vllm.settings import Settings


def preflight(settings: Settings, shape: KvShape) -> None:
    client = Client(settings.target, token_file=settings.token_file,
                    timeout=settings.rpc_timeout_s, retries=1, backoff=0.02, reconnect_s=0.0)
    try:
        stats = until_answered(settings, client.stats)
    except BlockdError as err:
        what = ("rejected the credential" if err.status == grpc.StatusCode.UNAUTHENTICATED
                else f"refused Stats ({err.status.name})")
        raise RuntimeError(
            f"blockd_vllm: blockd at {settings.target!r} {what} "
            f"(kv_connector_extra_config.token_file={settings.token_file!r}): "
            f"{err.message}") from None
    finally:
        client.close()
    if stats.block_size != shape.block_size:
        raise RuntimeError(f"blockd_vllm: block size mismatch: blockd's pool at "
                           f"{settings.target!r} has block_size={stats.block_size}, vLLM's "
                           f"block_size is {shape.block_size}")
    tenants = [t.tenant_id for t in stats.tenants]
    if settings.tenant not in tenants:
        raise RuntimeError(f"blockd_vllm: kv_connector_extra_config.tenant={settings.tenant!r} "
                           f"is not a tenant this credential may act for at {settings.target!r}"
                           f" (it may act for {tenants})")
