"""Checks at engine start that need blockd itself, made from the worker process.

vLLM builds the worker side of a connector before it loads the model and the scheduler side only
after the KV cache exists, so the scheduler's Attach comes a model load later (minutes for a
large model). This checks everything that Attach will check, at once: whether the target
answers (``connect_timeout_s``), whether the token is accepted, whether it may act for the
tenant and whether the pool's block size is vLLM's (blockd's Stats), then the whole KV layout
through a probe session that is detached at once (an Attach with the engine's layout, mapping
nothing). Each refusal raises RuntimeError naming the extra-config key and both values, in the
worker's constructor, where vLLM's own error path ends the engine.
"""

from __future__ import annotations

import contextlib

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import BlockdError, Client
from blockd_vllm.layout import KvShape
from blockd_vllm.link import kv_layout, start_error, until_answered
from blockd_vllm.settings import Settings

#: Appended to ``worker_name`` for the probe session (it shows in blockd's logs as such).
PROBE_SUFFIX = "-preflight"


def preflight(settings: Settings, shape: KvShape) -> None:
    client = Client(settings.target, token_file=settings.token_file,
                    timeout=settings.rpc_timeout_s, retries=1, backoff=0.02, reconnect_s=0.0)
    try:
        stats = until_answered(settings, client.stats)
        _check_stats(settings, shape, stats)
        try:
            probe = until_answered(settings, lambda: client.attach(
                settings.tenant, kv_layout(shape), tp_size=shape.tp_size, map_pool=False,
                tables=False, worker_name=settings.worker_name + PROBE_SUFFIX,
                lease_ms=settings.lease_ms))
        except BlockdError as err:
            raise RuntimeError(start_error(settings, shape, err)) from None
        with contextlib.suppress(BlockdError):  # else its lease ends it
            probe.detach()
    except BlockdError as err:
        what = ("rejected the credential" if err.status == grpc.StatusCode.UNAUTHENTICATED
                else f"refused Stats ({err.status.name})")
        raise RuntimeError(
            f"blockd_vllm: blockd at {settings.target!r} {what} "
            f"(kv_connector_extra_config.token_file={settings.token_file!r}): "
            f"{err.message}") from None
    finally:
        client.close()


def _check_stats(settings: Settings, shape: KvShape, stats: pb.StatsResponse) -> None:
    block_size = stats.block_size
    if block_size != shape.block_size:
        raise RuntimeError(f"blockd_vllm: block size mismatch: blockd's pool at "
                           f"{settings.target!r} has block_size={block_size}, vLLM's "
                           f"block_size is {shape.block_size}")
    tenants = [t.tenant_id for t in stats.tenants]
    if settings.tenant not in tenants:
        raise RuntimeError(f"blockd_vllm: kv_connector_extra_config.tenant={settings.tenant!r} "
                           f"is not a tenant this credential may act for at {settings.target!r}"
                           f" (it may act for {tenants})")
