"""BlockdService: protobuf in, core calls, protobuf out. Nothing else.

Every handler authenticates the caller, converts the request, calls the daemon/core, and converts
the result; a ``BlockdError`` becomes the status of the one table in ``status.py``. Inside a
Step, each operation's error becomes that operation's ``OperationStatus``; the others still
apply. Any other exception is a bug: it is logged and answered with INTERNAL, and the daemon
keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.core.allocator import STATE_NAMES
from blockd.core.errors import (
    BlockdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StatusCode,
)
from blockd.core.manager import DoesNotFit
from blockd.core.preemption import REASON as PREEMPT_REASON
from blockd.server import convert
from blockd.server.daemon import Daemon, SessionInfo
from blockd.server.events import CLEARED, REMOVED, STORED, Event
from blockd.server.metrics import Metrics
from blockd.server.status import details, grpc_status

log = logging.getLogger("blockd.servicer")
T = TypeVar("T")

_BLOCK_STATE = {name: getattr(pb, f"BLOCK_STATE_{name.upper()}") for name in STATE_NAMES}

#: An upper bound of one preemption notice's encoded size: a minted 22-character sequence id,
#: the reason label and protobuf framing. Every pending notice goes into the session's next
#: answer: a worker must learn of a preemption before it launches that Step's kernels, since
#: the victim's blocks are reusable once the fence it reports completes.
PREEMPTED_NOTICE_BYTES = 48


def _rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map BlockdError to its status; anything else is INTERNAL and never kills the server."""

    @functools.wraps(fn)
    async def wrapper(self: BlockdServicer, request: Any, context: grpc.aio.ServicerContext
                      ) -> T:
        try:
            try:
                return await fn(self, request, context)
            finally:
                self.check()
        except BlockdError as err:
            await context.abort(grpc_status(err), details(err))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by blockd)")
        raise AssertionError("unreachable")  # abort raises

    return wrapper


class BlockdServicer(pb_grpc.BlockdServiceServicer):
    def __init__(self, daemon: Daemon, metrics: Metrics) -> None:
        self.d = daemon
        self.m = daemon.manager
        self.metrics = metrics
        #: vLLM's medium names: where the blocks live.
        self._medium = "GPU" if daemon.pool.backend == "cuda" else "CPU"

    # -- sessions ------------------------------------------------------------------------------

    @_rpc
    async def Attach(self, request: pb.AttachRequest, context: Any) -> pb.AttachResponse:
        principal = self.d.authenticate(context.invocation_metadata())
        convert.check_id(request.tenant_id, "tenant_id")
        convert.check_id(request.worker_name, "worker_name", required=False)
        if not request.HasField("layout"):
            raise InvalidArgument("the worker must state its KV layout", field="layout")
        wanted = convert.spec_from_layout(request.layout, self.d.spec.num_blocks)
        mismatch = self.d.spec.layout_mismatches(wanted)
        if mismatch:
            name = mismatch[0]
            raise FailedPrecondition(
                f"layout mismatch: the pool has {name}={getattr(self.d.spec, name)!r}, the "
                f"worker expects {getattr(wanted, name)!r}", field=f"layout.{name}")
        info = self.d.attach(principal, request)
        policy = self.m.tenants.policies[self.m.tenants.slot(info.tenant_id)]
        return pb.AttachResponse(
            session_id=info.id, epoch=self.d.epoch, lease_ms=info.lease_ms,
            pool=pb.PoolInfo(layout=convert.layout_of(self.d.spec),
                             num_blocks=self.d.spec.num_blocks,
                             block_bytes=self.d.spec.block_bytes,
                             backend=(pb.POOL_BACKEND_CUDA_VMM if self.d.pool.backend == "cuda"
                                      else pb.POOL_BACKEND_HOST_SHM),
                             handle_socket_path=self.d.cfg.server.handle_socket),
            tenant_id=info.tenant_id,
            sharing_domain_kind=getattr(pb, f"SHARING_DOMAIN_KIND_{policy.sharing.name}"),
        )

    @_rpc
    async def Detach(self, request: pb.DetachRequest, context: Any) -> pb.DetachResponse:
        info = self._session(request.session_id, context)
        return pb.DetachResponse(num_sequences_released=self.d.detach(info, "detach"))

    @_rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any
                        ) -> pb.HeartbeatResponse:
        info = self._session(request.session_id, context, request.epoch)
        if request.completed_fence:
            self.d.complete_fence(info, request.completed_fence)
        self.d.renew(info)
        expires = time.time() + info.lease_ms / 1000
        return pb.HeartbeatResponse(lease_expires_unix_ms=int(expires * 1000),
                                    epoch=self.d.epoch)

    # -- Step ----------------------------------------------------------------------------------

    @_rpc
    async def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResponse:
        return self._step(request, context)

    async def StepStream(self, request_iterator: AsyncIterator[pb.StepRequest],
                         context: Any) -> AsyncIterator[pb.StepResponse]:
        try:
            async for request in request_iterator:
                try:
                    response = self._step(request, context)
                finally:
                    self.check()
                yield response
        except BlockdError as err:
            await context.abort(grpc_status(err), details(err))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except DecodeError:
            # grpc parses each stream message as the handler iterates: the client's fault.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request: a StepRequest on the stream could not be parsed")
        except Exception:
            log.exception("internal error in StepStream")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by blockd)")

    def _answer_bound(self, req: pb.StepRequest, session_id: str) -> int:
        """A cheap upper bound of a Step's answer size, from counts alone (no op is applied).

        Per operation or batch entry at most ~120 bytes of status or result (ids, counts, an
        error field path), plus 10 bytes per block an admit or append can hand out (its id in
        a table and again in ``scrubbed_blocks``), plus what an answer echoes (request_ids),
        plus every preemption notice the answer can carry: those pending for the session and one
        per sequence of the session (the step's own admits may preempt any of them).
        """
        B = self.d.spec.block_size
        entries = 0
        blocks = 0
        echoed = 0
        for op in req.operations:
            kind = op.WhichOneof("op")
            if kind == "admit":
                blocks += len(op.admit.token_ids) // B + 1
                echoed += len(op.admit.request_id) * 4  # UTF-8 of a str: at most 4 bytes each
            elif kind == "append":
                blocks += len(op.append.token_ids) // B + 2
            elif kind == "append_batch":
                n = len(op.append_batch.sequence_ids)
                entries += n
                blocks += len(op.append_batch.token_ids) // B + 2 * n
            elif kind == "fork":
                entries += min(op.fork.num_children, 64)
        # A new block id can appear twice: in a table and among the scrubbed blocks.
        core = self.m.sessions[session_id]
        notices = PREEMPTED_NOTICE_BYTES * (len(core.preempted) + core.num_sequences)
        return 256 + 120 * (len(req.operations) + entries) + 10 * blocks + echoed + notices

    def check(self) -> None:
        """With ``server.check_invariants``: assert the core's invariants after each call."""
        if self.d.cfg.server.check_invariants:
            self.m.check_invariants()

    def _step(self, req: pb.StepRequest, context: Any) -> pb.StepResponse:
        info = self._session(req.session_id, context, req.epoch)
        if req.step_id == 0:
            raise InvalidArgument("step_id must be >= 1", field="step_id")
        if req.step_id == info.last_step_id and info.last_response is not None:
            return info.last_response  # a retry: answered, not reapplied
        if req.step_id < info.last_step_id:
            raise FailedPrecondition(
                f"step_id {req.step_id} is older than the last step {info.last_step_id}",
                field="step_id")
        limit = self.d.cfg.server.max_operations_per_step
        if len(req.operations) > limit:
            raise InvalidArgument(f"more than {limit} operations", field="operations")
        bound = self._answer_bound(req, info.id)
        if bound > self.d.cfg.server.max_message_bytes:
            # Checked before anything is applied: an answer that cannot be sent would leave the
            # worker with a Step applied that it never learns about.
            raise ResourceExhausted(
                f"the answer could reach {bound} bytes, over max_message_bytes "
                f"({self.d.cfg.server.max_message_bytes}): split the Step", reason="message",
                field="operations")
        self.d.poll_fence(info)
        return self.apply_step(info, req)

    def apply_step(self, info: SessionInfo, req: pb.StepRequest) -> pb.StepResponse:
        """Apply a validated Step and journal it; also how a restarted daemon replays one.

        A replay (``self.d.replaying``) rebuilds the same answer (a retried step_id gets it)
        without the side effects that already happened: the scrubbed blocks are not zeroed
        again (workers wrote to them since), and the per-request limits of the configuration
        are not re-applied (the Step was accepted under the limits in force then).
        """
        t0 = time.perf_counter()
        sid = info.id
        if self.m.minted:
            self.m.minted.clear()
        self.m.begin_step(sid, req.fence, req.completed_fence)
        self.d.note_fences(info, req.fence)
        resp = pb.StepResponse(step_id=req.step_id, epoch=self.d.epoch)
        results = resp.results
        copies = resp.copies
        for i, op in enumerate(req.operations):
            kind = op.WhichOneof("op")
            result = results.add()
            try:
                if kind == "append_batch":
                    self._append_batch(sid, i, op.append_batch, req.fence, result, copies)
                elif kind == "append":
                    self._append(sid, op.append, req.fence, result, copies)
                elif kind == "admit":
                    self._admit(sid, op.admit, result)
                elif kind == "release":
                    n = self.m.release(sid, op.release.sequence_id, req.fence)
                    result.release.num_blocks_released = n
                elif kind == "commit":
                    n = self.m.commit(sid, op.commit.sequence_id, req.fence)
                    result.commit.num_blocks_committed = n
                elif kind == "fork":
                    children = self.m.fork(sid, op.fork.sequence_id, op.fork.num_children)
                    result.fork.child_sequence_ids.extend(children)
                else:
                    raise InvalidArgument("operation has no op set", field="op")
            except BlockdError as err:
                prefix = f"operations[{i}].{kind}." if kind else f"operations[{i}]."
                result.Clear()
                result.status.code = err.status
                result.status.message = err.message
                result.status.field = prefix + convert.proto_field(err.field)
                self.metrics.op_errors[err.status.name] += 1
        for seq_id in self.m.take_preempted(sid):
            resp.preempted.add(sequence_id=seq_id, reason=PREEMPT_REASON)
        scrub = self.m.take_scrubbed()
        if scrub:
            if not self.d.replaying:
                self.d.pool.zero_blocks(scrub)
            resp.scrubbed_blocks.extend(scrub)
        info.last_step_id = req.step_id
        info.last_response = resp
        self.d.renew(info)
        self.d.record_step(info, req)
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        return resp

    def _tokens(self, tokens: Any, field: str) -> Any:
        if len(tokens) > self.d.cfg.server.max_tokens_per_operation and not self.d.replaying:
            raise InvalidArgument(
                f"more than {self.d.cfg.server.max_tokens_per_operation} token ids", field=field)
        return tokens

    def _append(self, sid: str, op: pb.AppendOp, fence: int, result: pb.OperationResult,
                copies: Any) -> None:
        out = self.m.append(sid, op.sequence_id, self._tokens(op.token_ids, "token_ids"), fence)
        if isinstance(out, DoesNotFit):
            self._does_not_fit(out, result)
            return
        r = result.append
        r.sequence_id = op.sequence_id
        r.delta.start_index = out.start_index
        r.delta.block_ids.extend(out.block_ids)
        r.num_tokens = out.num_tokens
        if out.copy is not None:
            copies.add(src_block=out.copy.src, dst_block=out.copy.dst)

    def _append_batch(self, sid: str, index: int, op: pb.AppendBatchOp, fence: int,
                      result: pb.OperationResult, copies: Any) -> None:
        ids = list(op.sequence_ids)
        limit = self.d.cfg.server.max_operations_per_step
        if not ids or (len(ids) > limit and not self.d.replaying):
            raise InvalidArgument(f"needs 1..{limit} sequence ids", field="sequence_ids")
        counts = list(op.num_tokens) or None
        raw = array("I", self._tokens(op.token_ids, "token_ids")).tobytes()
        out = self.m.append_batch(sid, ids, raw, counts, fence)
        r = result.append_batch
        r.num_tokens.extend(out.num_tokens)
        for i, res in out.deltas:
            d = r.deltas.add(index=i).delta
            d.start_index = res.start_index
            d.block_ids.extend(res.block_ids)
            if res.copy is not None:
                copies.add(src_block=res.copy.src, dst_block=res.copy.dst)
        prefix = f"operations[{index}].append_batch."
        for i, err in out.errors:
            st = r.errors.add(index=i).status
            if isinstance(err, DoesNotFit):
                st.code = StatusCode.RESOURCE_EXHAUSTED
                st.message = f"does not fit ({err.reason}): needs {err.needed} blocks"
                st.field = err.reason
            else:
                st.code = err.status
                st.message = err.message
                st.field = f"{prefix}sequence_ids[{i}]"
            self.metrics.op_errors[StatusCode(st.code).name] += 1

    def _admit(self, sid: str, op: pb.AdmitOp, result: pb.OperationResult) -> None:
        convert.check_id(op.request_id, "request_id", required=False)
        scope = convert.scope(op.namespace)
        out = self.m.admit(sid, scope, self._tokens(op.token_ids, "token_ids"),
                           cache=not op.disable_prefix_cache, priority=op.priority)
        if isinstance(out, DoesNotFit):
            self._does_not_fit(out, result)
            return
        r = result.admit
        r.sequence_id = out.seq_id
        r.request_id = op.request_id
        r.num_cached_tokens = out.num_cached_tokens
        r.block_table.extend(out.block_table)
        r.num_tokens = out.num_tokens

    @staticmethod
    def _does_not_fit(out: DoesNotFit, result: pb.OperationResult) -> None:
        result.status.code = StatusCode.RESOURCE_EXHAUSTED
        result.status.message = (f"does not fit ({out.reason}): needs {out.needed} blocks, "
                                 f"{out.available} available")
        result.status.field = out.reason

    # -- queries -------------------------------------------------------------------------------

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        info = self._session(request.session_id, context, request.epoch)
        scope = convert.scope(request.namespace)
        tokens = self._tokens(request.token_ids, "token_ids")
        n = self.m.lookup(info.id, scope, tokens)
        return pb.LookupResponse(num_cached_tokens=n, num_cached_blocks=n // self.d.spec.block_size)

    def _owning_session(self, session_id: str, sequence_id: str, context: Any) -> SessionInfo:
        """The named session; an admin (an operator's blockctl) may leave it empty."""
        principal = self.d.authenticate(context.invocation_metadata())
        if not session_id and principal.admin:
            seq = self.m.sequences.get(sequence_id)
            if seq is None:
                raise NotFound("unknown sequence", field="sequence_id")
            session_id = seq.session
        return self.d.session(principal, session_id)

    @_rpc
    async def GetBlockTable(self, request: pb.GetBlockTableRequest, context: Any
                            ) -> pb.GetBlockTableResponse:
        info = self._owning_session(request.session_id, request.sequence_id, context)
        table, n = self.m.block_table(info.id, request.sequence_id)
        return pb.GetBlockTableResponse(sequence_id=request.sequence_id, epoch=self.d.epoch,
                                        block_ids=table, num_tokens=n,
                                        block_size=self.d.spec.block_size)

    @_rpc
    async def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.InspectResponse:
        info = self._owning_session(request.session_id, request.sequence_id, context)
        if request.max_positions > 65536:
            raise InvalidArgument("max_positions is at most 65536", field="max_positions")
        count = request.max_positions or 65536
        positions = self.m.inspect(info.id, request.sequence_id, request.start_position, count)
        table, n = self.m.block_table(info.id, request.sequence_id)
        a = self.m.alloc
        resp = pb.InspectResponse(sequence_id=request.sequence_id, epoch=self.d.epoch,
                                  block_size=self.d.spec.block_size, num_tokens=n)
        for p in positions:
            resp.positions.add(position=p.position, logical_block=p.logical_block,
                               offset=p.offset, physical_block=p.physical_block, slot=p.slot)
        for lb, b in enumerate(table):
            resp.blocks.add(logical_block=lb, physical_block=b,
                            state=_BLOCK_STATE[STATE_NAMES[a.state[b]]], ref_count=a.ref[b],
                            shared=a.ref[b] > 1)
        return resp

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        principal = self.d.authenticate(context.invocation_metadata())
        counts = self.m.state_counts()
        c = self.m.counters
        a = self.m.alloc
        resp = pb.StatsResponse(
            epoch=self.d.epoch, num_blocks=self.d.spec.num_blocks,
            block_size=self.d.spec.block_size, blocks_free=counts["free"],
            blocks_writing=counts["writing"], blocks_committed=counts["committed"],
            blocks_pending=counts["pending"], blocks_cached=counts["cached"],
            prefix_queried_tokens_total=c.queried_tokens, prefix_hit_tokens_total=c.hit_tokens,
            evictions_total=c.evictions, cow_copies_total=c.cow_copies,
            num_sessions=len(self.d.sessions), num_sequences=len(self.m.sequences))
        for slot, policy in enumerate(self.m.tenants.policies):
            if not self.m.tenants.active[slot]:
                continue
            if principal.admin or policy.tenant_id in principal.tenants:
                resp.tenants.add(tenant_id=policy.tenant_id, used_blocks=a.usage[slot],
                                 quota_blocks=policy.quota_blocks,
                                 guaranteed_blocks=policy.guaranteed_blocks,
                                 cached_blocks=a.cached[slot])
        return resp

    # -- events and flushes --------------------------------------------------------------------

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Any
                          ) -> AsyncIterator[pb.WatchEventsResponse]:
        try:
            principal = self.d.authenticate(context.invocation_metadata())
            if not principal.admin:
                raise PermissionDenied("watching events needs an admin credential",
                                       field="authorization")
        except BlockdError as err:
            await context.abort(grpc_status(err), details(err))
            return
        log_ = self.d.events
        nxt = request.since_sequence or log_.next_seq
        if nxt < log_.oldest_seq:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"since_sequence: events before {log_.oldest_seq} are gone")
            return
        while not self.d.draining:
            batch = log_.since(nxt)
            if not batch:
                await log_.wait()
                continue
            if batch[0].seq != nxt:  # fell behind the bounded buffer
                await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                    f"since_sequence: events before {batch[0].seq} are gone")
                return
            for ev in batch:
                yield self._event(ev)
            nxt = batch[-1].seq + 1

    def _event(self, ev: Event) -> pb.WatchEventsResponse:
        out = pb.WatchEventsResponse(sequence_number=ev.seq, epoch=self.d.epoch)
        if ev.kind == STORED:
            tokens = memoryview(ev.token_bytes).cast("I").tolist() if ev.token_bytes else []
            out.block_stored.CopyFrom(pb.BlockStored(
                block_hashes=list(ev.block_hashes), parent_block_hash=ev.parent_hash,
                token_ids=tokens, block_size=self.d.spec.block_size, lora_id=ev.lora_id,
                medium=self._medium, namespace=ev.namespace))
        elif ev.kind == REMOVED:
            out.block_removed.CopyFrom(pb.BlockRemoved(block_hashes=list(ev.block_hashes),
                                                       medium=self._medium))
        elif ev.kind == CLEARED:
            out.all_blocks_cleared.SetInParent()
        return out

    @_rpc
    async def FlushNamespace(self, request: pb.FlushNamespaceRequest, context: Any
                             ) -> pb.FlushNamespaceResponse:
        principal = self.d.authenticate(context.invocation_metadata())
        for name in ("model_id", "model_revision", "lora_id", "tenant_id"):
            convert.check_id(getattr(request, name), name, required=False)
        if not principal.admin:
            if not request.tenant_id:
                raise PermissionDenied("without an admin credential a flush must name one of "
                                       "the caller's tenants", field="tenant_id")
            principal.require_tenant(request.tenant_id)
        n = self.d.flush(model_id=request.model_id or None,
                         model_revision=request.model_revision or None,
                         lora_id=request.lora_id or None,
                         tenant_id=request.tenant_id or None)
        return pb.FlushNamespaceResponse(num_blocks_flushed=n)

    # -- helpers -------------------------------------------------------------------------------

    def _session(self, session_id: str, context: Any, epoch: int | None = None) -> SessionInfo:
        principal = self.d.authenticate(context.invocation_metadata())
        return self.d.session(principal, session_id, epoch)
