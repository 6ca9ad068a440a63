"""The synchronous client: ``Client`` (one channel) and ``Session`` (one attached worker).

Every call has an explicit deadline; UNAVAILABLE (the daemon restarting, a connection reset) is
retried with exponential backoff and jitter for up to ``reconnect_s`` seconds (a daemon killed
and restarted by its supervisor comes back within that), nothing else is: the loop is
``blockd_client.retry``'s, shared with ``AsyncClient``. A Step keeps its
step_id across retries, so a Step the daemon applied before the connection dropped is answered
from its record (also by a daemon that recovered from a crash: it journals every Step before
answering), never applied twice. A Step whose call ended without an answer (a deadline passed:
the daemon may have applied it) is kept as ``Session.in_doubt``; ``Session.settle()`` sends it
again with its step_id, which gets its answer either way. When the pool's epoch changes (a
daemon without crash recovery restarted) the session re-attaches, re-maps the pool and raises
``EpochChanged`` so the engine re-admits its requests.

The credential is a ``token`` or a ``token_file`` (default ``$BLOCKD_TOKEN_FILE``), the latter
read at construction and again when the daemon answers UNAUTHENTICATED, so a rotated Kubernetes
Secret takes effect without restarting the worker (``blockd_client.retry.Credential``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd_client.errors import BlockdError, EpochChanged
from blockd_client.requests import layout_proto
from blockd_client.retry import Credential, RetryPolicy, channel_options
from blockd_client.session import SessionState, SessionViews, StepOutcome, left_in_doubt
from blockd_client.stream import StepStreamer

T = TypeVar("T")


class Connection:
    """What ``Client`` and ``AsyncClient`` share: the channel to one blockd (``target`` is
    ``unix:PATH`` or ``HOST:PORT``), its stub, the credential and the call policy
    (``blockd_client.retry.RetryPolicy``). A subclass names its channel constructor.

    ``token`` or ``token_file`` (not both; with neither, ``$BLOCKD_TOKEN_FILE`` if set): the
    bearer credential. A token file that cannot be read or holds no single token raises
    ``ValueError`` naming ``token_file`` and the path, before any channel is opened."""

    #: ``grpc.insecure_channel`` or ``grpc.aio.insecure_channel``.
    open_channel: Callable[..., Any] = staticmethod(grpc.insecure_channel)

    def __init__(self, target: str, *, token: str = "",
                 token_file: str | os.PathLike[str] | None = None, timeout: float = 10.0,
                 retries: int = 6, backoff: float = 0.05, reconnect_s: float = 30.0) -> None:
        self.target = target
        self.retry = RetryPolicy(timeout, retries, backoff, reconnect_s)
        self.credential = Credential(token, token_file)
        self.channel = self.open_channel(target, options=channel_options())
        self.stub = pb_grpc.BlockdServiceStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata of the current credential (it changes when a re-read token file
        holds a new token): read it per call, never keep it."""
        return self.credential.metadata


class Client(Connection):
    """A synchronous connection to one blockd."""

    def call(self, method: Callable[..., T], request: Any, *, timeout: float | None = None
             ) -> T:
        """One RPC with a deadline, retried on UNAVAILABLE (and once on UNAUTHENTICATED with a
        token file, after re-reading it)."""
        for attempt in self.retry.attempts(self.credential):
            with attempt:
                return method(request, metadata=self.metadata,
                              timeout=self.retry.deadline(timeout))
        raise AssertionError("unreachable: attempts() never ends")

    def attach(self, tenant_id: str, layout: Any, *, tp_size: int = 1, worker_name: str = "",
               lease_ms: int = 0, map_pool: bool = True, max_seqs: int = 1024,
               max_blocks: int = 1024, device: Any = "cpu", stream: bool = False,
               tables: bool = True) -> Session:
        """Open a session. ``layout`` is the ``blockd_gpu.KvLayout`` the kernels expect; any
        difference from the pool fails with FAILED_PRECONDITION naming the field. With
        ``stream`` its Steps go over one long-lived, self-reconnecting StepStream.

        ``tables`` False: keep no local block tables (``max_seqs`` rows of ``max_blocks``), for
        a caller that reads block ids from the results (a scheduler that launches no kernel,
        e.g. ``blockd_vllm``'s). Their upkeep writes a tensor per operation, and each write
        lets go of the GIL: a Step called off a thread that keeps the GIL busy (vLLM's engine
        core) waits for it again after every one (up to the switch interval, 5 ms)."""
        req = pb.AttachRequest(worker_name=worker_name, tenant_id=tenant_id,
                               layout=layout_proto(layout, tp_size), lease_ms=lease_ms)
        return Session(self, req, map_pool, max_seqs, max_blocks, device, stream, tables)

    def stats(self) -> pb.StatsResponse:
        return self.call(self.stub.Stats, pb.StatsRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session(SessionViews):
    """One attached worker: steps, fences, the mapped pool and the local block tables."""

    def __init__(self, client: Client, req: pb.AttachRequest, map_pool: bool, max_seqs: int,
                 max_blocks: int, device: Any, stream: bool = False, tables: bool = True
                 ) -> None:
        self.client = client
        self._attach_req = req
        self._map_pool = map_pool
        #: ``SessionState``'s arguments after the pool, kept for a re-attach.
        self._state_args = (max_seqs, max_blocks, device, tables)
        self.state = self._attach(req)
        self.streamer = StepStreamer(client) if stream else None
        #: The last Step, when its call ended without an answer (``settle``).
        self.in_doubt: pb.StepRequest | None = None

    def _attach(self, req: pb.AttachRequest) -> SessionState:
        resp = self.client.call(self.client.stub.Attach, req)
        pool = None
        if self._map_pool:
            from blockd_client.pool import open_pool

            pool = open_pool(resp.pool.handle_socket_path, resp.session_id, resp.fetch_secret,
                             resp.tenant_id)
        return SessionState(resp, pool, *self._state_args)

    def step(self, ops: Sequence[pb.Operation]) -> StepOutcome:
        """Apply one scheduler iteration. Copy-on-write copies are done on return; run the
        step's kernels, then call ``complete_on_stream(outcome.fence)`` (or ``complete`` once
        the host knows they are done)."""
        ops = list(ops)
        return self._exchange(self.state.request(ops), ops)

    def settle(self) -> StepOutcome | None:
        """The answer of ``in_doubt``, the last Step, whose call ended without one (None when
        there is none): sent again with its step_id, it is answered from the daemon's record
        if the daemon applied it, and applied now if it never arrived, so it applies exactly
        once either way. Call it before the next ``step`` once the daemon answers again; the
        outcome tells what the lost answer said (e.g. the sequences its admits created, which
        only this answer names). Raises like ``step``; it stays in doubt while unanswered."""
        req = self.in_doubt
        if req is None:
            return None
        return self._exchange(req, list(req.operations), fence=req.fence)

    def _exchange(self, req: pb.StepRequest, ops: list[pb.Operation],
                  fence: int | None = None) -> StepOutcome:
        """Send Step ``req`` (of ``ops``) and apply its answer. A call that ended unanswered
        leaves it ``in_doubt`` (it may have been applied: ``settle``); an answer or a refusal
        (a later Step supersedes it: its step_id can no longer be answered) leaves nothing."""
        try:
            resp = self._send(req)
        except BlockdError as err:
            self.in_doubt = left_in_doubt(req, err)
            self._maybe_new_epoch(err)
            raise
        self.in_doubt = None
        return self.state.apply(ops, resp, fence=fence)

    def _send(self, req: pb.StepRequest) -> pb.StepResponse:
        if self.streamer is None:
            return self.client.call(self.client.stub.Step, req)
        try:
            return self.streamer.round_trip(req)
        except BlockdError as err:
            # The daemon authenticates every Step of a stream: after a token rotation the open
            # stream's old token is refused and the stream ends. Re-read the token file and
            # resend once on a fresh stream (same step_id: a refused Step was never applied).
            if (err.status != grpc.StatusCode.UNAUTHENTICATED
                    or not self.client.credential.reload()):
                raise
            return self.streamer.round_trip(req)

    def complete(self, fence: int) -> None:
        """The step's GPU work is done (the host knows it): publish its fence now."""
        self.state.complete(fence)

    def complete_on_stream(self, fence: int, stream: Any = None) -> str:
        """Enqueue the fence on the worker's CUDA stream (published at once on CPU tensors):
        ``SessionState.complete_on_stream``. The one call a worker needs after each step's
        kernels: it never waits for the GPU."""
        return self.state.complete_on_stream(fence, stream)

    def heartbeat(self) -> pb.HeartbeatResponse:
        try:
            return self.client.call(self.client.stub.Heartbeat, pb.HeartbeatRequest(
                session_id=self.session_id, epoch=self.epoch,
                completed_fence=self.state.completed_fence()))
        except BlockdError as err:
            self._maybe_new_epoch(err)
            raise

    def lookup(self, ns: pb.CacheNamespace, tokens: Sequence[int]) -> int:
        return self.client.call(self.client.stub.Lookup, pb.LookupRequest(
            session_id=self.session_id, epoch=self.epoch, namespace=ns,
            token_ids=tokens)).num_cached_tokens

    def block_table(self, seq_id: str) -> pb.GetBlockTableResponse:
        return self.client.call(self.client.stub.GetBlockTable, pb.GetBlockTableRequest(
            session_id=self.session_id, sequence_id=seq_id))

    def inspect(self, seq_id: str) -> pb.InspectResponse:
        return self.client.call(self.client.stub.Inspect, pb.InspectRequest(
            session_id=self.session_id, sequence_id=seq_id))

    def detach(self) -> int:
        if self.streamer is not None:
            self.streamer.close()
        n = self.client.call(self.client.stub.Detach,
                             pb.DetachRequest(session_id=self.session_id))
        self._close_pool()
        return n.num_sequences_released

    def _close_pool(self) -> None:
        if self.state.pool is not None:
            self.state.tables = None  # type: ignore[assignment]
            self.state.pool.close()
            self.state.pool = None

    def _maybe_new_epoch(self, err: BlockdError) -> None:
        """A stale epoch or a forgotten session (daemon restart): re-attach, then tell."""
        stale = err.status == grpc.StatusCode.FAILED_PRECONDITION and err.field == "epoch"
        gone = err.status == grpc.StatusCode.NOT_FOUND and err.field == "session_id"
        if not (stale or gone):
            return
        old = self.epoch
        req = pb.AttachRequest()
        req.CopyFrom(self._attach_req)
        req.resume_session_id = self.session_id
        self._close_pool()
        self.in_doubt = None  # of the old session: its sequences are gone
        self.state = self._attach(req)
        raise EpochChanged(old, self.epoch) from err
