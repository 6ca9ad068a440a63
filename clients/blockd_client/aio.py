"""The asyncio client: the same requests, errors, call loop (``blockd_client.retry``) and
session state as ``Client``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client.client import Connection
from blockd_client.errors import BlockdError
from blockd_client.requests import layout_proto
from blockd_client.session import SessionState, SessionViews, StepOutcome, left_in_doubt


class AsyncClient(Connection):
    """An asyncio connection to one blockd (same arguments as ``Client``, ``token_file``
    included; the file is re-read on the event loop, a few bytes from a local mount)."""

    open_channel = staticmethod(grpc.aio.insecure_channel)

    async def call(self, method: Any, request: Any, *, timeout: float | None = None) -> Any:
        """One RPC with a deadline, retried on UNAVAILABLE (and once on UNAUTHENTICATED with a
        token file, after re-reading it): the sync client's loop."""
        for attempt in self.retry.attempts(self.credential):
            async with attempt:
                return await method(request, metadata=self.metadata,
                                    timeout=self.retry.deadline(timeout))
        raise AssertionError("unreachable: attempts() never ends")

    async def attach(self, tenant_id: str, layout: Any, *, tp_size: int = 1,
                     worker_name: str = "", lease_ms: int = 0, map_pool: bool = True,
                     max_seqs: int = 1024, max_blocks: int = 1024, device: Any = "cpu",
                     tables: bool = True) -> AsyncSession:
        """``Client.attach`` (``tables``: see there), without ``stream``."""
        req = pb.AttachRequest(worker_name=worker_name, tenant_id=tenant_id,
                               layout=layout_proto(layout, tp_size), lease_ms=lease_ms)
        resp = await self.call(self.stub.Attach, req)
        pool = None
        if map_pool:
            from blockd_client.pool import open_pool

            pool = await asyncio.to_thread(open_pool, resp.pool.handle_socket_path,
                                           resp.session_id, resp.fetch_secret)
        return AsyncSession(self, SessionState(resp, pool, max_seqs, max_blocks, device,
                                               tables))

    async def stats(self) -> pb.StatsResponse:
        return await self.call(self.stub.Stats, pb.StatsRequest())

    async def close(self) -> None:
        await self.channel.close()


class AsyncSession(SessionViews):
    def __init__(self, client: AsyncClient, state: SessionState) -> None:
        self.client = client
        self.state = state
        #: The last Step, when its call ended without an answer (``Session.in_doubt``).
        self.in_doubt: pb.StepRequest | None = None

    async def step(self, ops: Sequence[pb.Operation]) -> StepOutcome:
        ops = list(ops)
        return await self._exchange(self.state.request(ops), ops)

    async def settle(self) -> StepOutcome | None:
        """As ``Session.settle``: ``in_doubt`` sent again with its step_id, so that it applies
        exactly once; its outcome, or None when nothing is in doubt."""
        req = self.in_doubt
        if req is None:
            return None
        return await self._exchange(req, list(req.operations), fence=req.fence)

    async def _exchange(self, req: pb.StepRequest, ops: list[pb.Operation],
                        fence: int | None = None) -> StepOutcome:
        """As ``Session._exchange``."""
        try:
            resp = await self.client.call(self.client.stub.Step, req)
        except BlockdError as err:
            self.in_doubt = left_in_doubt(req, err)
            raise
        self.in_doubt = None
        return self.state.apply(ops, resp, fence=fence)

    def complete(self, fence: int) -> None:
        self.state.complete(fence)

    def complete_on_stream(self, fence: int, stream: Any = None) -> str:
        """As ``Session.complete_on_stream`` (never awaits: the stream writes the fence)."""
        return self.state.complete_on_stream(fence, stream)

    async def detach(self) -> int:
        resp = await self.client.call(self.client.stub.Detach,
                                      pb.DetachRequest(session_id=self.session_id))
        if self.state.pool is not None:
            self.state.pool.close()
            self.state.pool = None
        return resp.num_sequences_released
