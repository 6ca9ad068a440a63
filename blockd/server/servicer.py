"""BlockdService over gRPC: authenticate, one runtime call, convert. Nothing else.

Every handler names the caller (``Sessions.authenticate`` on the call's metadata), makes one
call of ``blockd.runtime.daemon.Daemon`` (which speaks protobuf messages), and returns its
answer; a ``BlockdError`` becomes the status of the one table in ``status.py``. Any other
exception is a bug: it is logged and answered with INTERNAL, and the daemon keeps serving.
With ``server.check_invariants`` every call ends with the core's invariant check, whose
failure (``blockd.core.errors.Internal``) is answered with INTERNAL like any core error.

Every call that does work for a tenant (Step, each StepStream message, Lookup, Attach,
ListSequences, GetBlockTable, Inspect, Stats, FlushNamespace) first takes its tenant's turn in
the daemon's fair gate (``blockd.runtime.fair_gate``), priced by its work units: turns go round
the tenants, so one tenant's queued calls never make another's wait behind all of them.
Heartbeat and Detach take no turn: they are cheap, keep leases alive and give resources back.

A refusal for rate (``OverBudget``) is answered once its retry hint has passed, up to a bound
(``blockd.runtime.refusal_holds``), outside any turn.

Step, StepStream and Lookup requests reach their handlers as bytes (``add_to_server``): gRPC
would otherwise parse them before any handler runs, outside every turn, so a tenant's flood of
large requests would hold the loop in parsing however the gate orders the calls. Their turn is
taken on the bytes (queued by the leading session id, priced by size), their bytes are charged
to the tenant's budget, and only then are they parsed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from blockd import logs
from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.core.errors import BlockdError, InvalidArgument, ResourceExhausted
from blockd.runtime import listing, packed, step
from blockd.runtime.budgets import OverBound, OverBudget, parse_units, reading_need, scan_units
from blockd.runtime.daemon import Daemon
from blockd.runtime.fair_gate import FairGate
from blockd.runtime.packed import PackedIds
from blockd.runtime.refusal_holds import RefusalHolds
from blockd.runtime.tenants_file import Principal
from blockd.server.metrics import Metrics
from blockd.server.status import details, grpc_status

log = logging.getLogger("blockd.servicer")
T = TypeVar("T")
M = TypeVar("M", bound=Message)


def _rpc(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map BlockdError to its status; anything else is INTERNAL and never kills the server."""

    @functools.wraps(fn)
    async def wrapper(self: BlockdServicer, request: Any,
                      context: grpc.aio.ServicerContext[Any, Any]
                      ) -> T:
        try:
            try:
                return await fn(self, request, context)
            finally:
                self.d.check()
        except Exception as exc:
            await _abort(context, await self._held(exc), fn.__name__)
        raise AssertionError("unreachable")  # abort raises

    return wrapper


class BlockdServicer(pb_grpc.BlockdServiceServicer):
    def __init__(self, daemon: Daemon, metrics: Metrics, gate: FairGate | None = None,
                 holds: RefusalHolds | None = None) -> None:
        self.d = daemon
        self.metrics = metrics
        self.gate = gate or FairGate()
        self.holds = holds or RefusalHolds()
        #: The tasks of the open streams (StepStream, WatchEvents): ended by ``end_streams``.
        self._streams: set[asyncio.Task[Any]] = set()

    def end_streams(self) -> int:
        """End every open stream with UNAVAILABLE (the drain's grace is over): each handler's
        task is cancelled at its await and answers the client itself, so nothing is left for
        the server's stop to cancel (grpc logs such a cancellation as an unhandled exception,
        with a raw traceback). Returns how many were open."""
        for task in self._streams:
            task.cancel()
        return len(self._streams)

    def _open_stream(self) -> asyncio.Task[Any]:
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        return task

    async def _held(self, exc: Exception) -> Exception:
        """A refusal for rate once its hint passed, one of a request over the per-call bound
        after the whole hold (``blockd.runtime.refusal_holds``): a client that ignores them
        cannot make refusals a flood; anything else at once."""
        if isinstance(exc, (OverBudget, OverBound)):
            return await self.holds.hold(exc)
        return exc

    def _caller(self, context: Any) -> Principal:
        return self.d.sessions.authenticate(context.invocation_metadata())

    def _turn(self, p: Principal, units: int, *, tenant_id: str = "", session_id: str = ""
              ) -> Any:
        key = self.d.gate_key(p, tenant_id=tenant_id, session_id=session_id)
        self._check_queue(key)
        return self.gate.turn(key, units)

    def _check_queue(self, key: str) -> None:
        """Refuse a call of a tenant that already has ``server.max_queued_calls_per_tenant``
        calls waiting (for a turn, or as held refusals), before it queues: what one tenant's
        concurrency holds of the daemon (their requests, their places in the gate) is
        bounded, and the refusal is answered at once, unparsed."""
        cap = self.d.cfg.server.max_queued_calls_per_tenant
        n = self.gate.waiting_of(key) + self.holds.waiting[key]
        if n >= cap:
            raise ResourceExhausted(
                f"queue: {key!r} has {n} calls waiting (server.max_queued_calls_per_tenant="
                f"{cap}): retry once some are answered", reason="queue")

    @_rpc
    async def Attach(self, request: pb.AttachRequest, context: Any) -> pb.AttachResponse:
        p = self._caller(context)
        async with self._turn(p, step.ATTACH_UNITS, tenant_id=request.tenant_id):
            return self.d.attach(p, request)

    @_rpc
    async def Detach(self, request: pb.DetachRequest, context: Any) -> pb.DetachResponse:
        return self.d.detach(self._caller(context), request)

    @_rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any
                        ) -> pb.HeartbeatResponse:
        return self.d.heartbeat(self._caller(context), request)

    def _raw_caller(self, context: Any, raw: bytes, cls: type[M], what: str) -> Principal:
        """The caller of a raw request. A caller that cannot be authenticated has no turn to
        parse in, and gets what it got when gRPC parsed first: INVALID_ARGUMENT for bytes
        that do not parse (parsed here, as before, outside any turn), else its own refusal."""
        try:
            return self._caller(context)
        except BlockdError:
            _parse(cls, raw, what)
            raise

    @asynccontextmanager
    async def _raw_turn(self, p: Principal, raw: bytes, what: str,
                        parse: Callable[[bytes], M], price: Callable[[M], int],
                        units: int | None = None, need: int | None = None
                        ) -> AsyncIterator[M]:
        """A Step's or Lookup's turns, taken on its raw bytes (``RAW_REQUESTS``), queued under
        the tenant of its leading session id (``step.leading_session_id``).

        The first is priced by what reading its bytes costs (``units``; default
        ``parse_units`` of its size). In it, that price is charged to the same budget before
        the bytes are read (``charge_bytes``: over budget, or short of ``need``, by default
        ``reading_need`` of every byte up to ``server.max_work_per_call``, it is refused
        unread), then they are read (``parse``; malformed bytes are INVALID_ARGUMENT) and the
        request's work priced (``price``). A request under ``SPLIT_BYTES`` is then served in
        the same turn; a larger one gets a second turn for its work, at the front of its
        tenant's queue, so that no other tenant's call waits for the reading and the work of
        one large request together (``FairGate.turn``). The body runs in the last turn.

        Bytes whose reading alone costs more than ``server.max_work_per_call`` are refused
        first (RESOURCE_EXHAUSTED ``work``, field ``request``), outside any turn, in O(1),
        once their units are charged to the same budget (``budgets.OverBound``: held like a
        refusal for rate; over the budget, refused for rate)."""
        units = parse_units(len(raw)) if units is None else units
        sid = step.leading_session_id(raw)
        key = self.d.gate_key(p, session_id=sid)
        self._check_queue(key)
        if units > self.d.limits.max_work_per_call:
            # Received in full all the same: paid for (refused for rate if the bucket cannot
            # pay), then refused unread and held (``_held``), so a flood of them is no cheaper
            # than the budget allows.
            self.d.charge_bytes(p, key, sid, units)
            try:
                step.check_work(self.d.limits, units, f"request of {len(raw)} bytes",
                                "request")
            except ResourceExhausted as exc:
                raise OverBound(key, exc) from None
        if need is None:
            need = reading_need(units, len(raw), self.d.limits.max_work_per_call)
        async with self.gate.turn(key, units) as spend:
            self.d.charge_bytes(p, key, sid, units, need)
            request = parse(raw)
            work = price(request)
            if len(raw) < SPLIT_BYTES:
                spend(work)
                yield request
                return
        async with self.gate.turn(key, work, resume=True):
            yield request

    @_rpc
    async def Step(self, request: bytes, context: Any) -> pb.StepResponse:
        return await self._step(request, context)

    async def _step(self, raw: bytes, context: Any) -> pb.StepResponse:
        raw = _raw(raw)
        p = self._raw_caller(context, raw, pb.StepRequest, "a StepRequest")
        counts: step.Tally | None = None

        def price(request: pb.StepRequest) -> int:
            nonlocal counts
            counts = step.tally(request, self.d.spec.block_size)
            # A Step over the bound is priced at the bound: the daemon refuses it.
            return min(counts.units, self.d.limits.max_work_per_call)

        async with self._raw_turn(p, raw, "a StepRequest",
                                  functools.partial(_parse, pb.StepRequest, what="a StepRequest"),
                                  price) as request:
            t0 = time.perf_counter()
            response = self.d.step(p, request, counts)  # counted once, in ``price``
            self.metrics.step_seconds.observe(time.perf_counter() - t0)
        return response

    async def StepStream(self, request_iterator: AsyncIterator[bytes],
                         context: Any) -> AsyncIterator[pb.StepResponse]:
        task = self._open_stream()
        try:
            async for request in request_iterator:
                try:
                    response = await self._step(request, context)
                finally:
                    self.d.check()
                yield response
        except asyncio.CancelledError:
            await _ended_by_drain(self.d, context)
        except Exception as exc:
            await _abort(context, await self._held(exc), "StepStream")
        finally:
            self._streams.discard(task)

    @_rpc
    async def Lookup(self, request: bytes, context: Any) -> pb.LookupResponse:
        request = _raw(request)
        p = self._raw_caller(context, request, pb.LookupRequest, "a LookupRequest")
        # The token ids are cut out of the bytes (O(top-level fields), before the turn); in the
        # turn, once the bytes are paid for, they are counted and checked with numpy, the
        # daemon charges their work and decodes only those its match reaches
        # (``Daemon.lookup``), and protobuf parses the small rest. Where they cannot be cut
        # out, protobuf parses it all.
        try:
            split = packed.split_field(request, LOOKUP_TOKEN_IDS)
        except packed.Malformed:
            split = None  # priced as a parse, which then refuses it (after the rate check)
        if split is None:
            units, id_bytes = parse_units(len(request)), len(request)
        else:
            id_bytes = len(request) - len(split[0])
            units = parse_units(len(split[0])) + scan_units(id_bytes)
        need = reading_need(units, id_bytes,
                            min(self.d.lookup_reach, self.d.limits.max_work_per_call))
        tokens: PackedIds | None = None

        def parse(raw: bytes) -> pb.LookupRequest:
            nonlocal tokens
            if split is None:
                return _parse(pb.LookupRequest, raw, "a LookupRequest")
            try:
                tokens = packed.PackedIds(split[1])  # counted and checked, decoded later
            except packed.Malformed:
                raise InvalidArgument("a LookupRequest could not be parsed",
                                      field="request") from None
            return _parse(pb.LookupRequest, split[0], "a LookupRequest")

        def price(req: pb.LookupRequest) -> int:
            count = len(req.token_ids) if tokens is None else tokens.count
            return min(count, self.d.lookup_reach, self.d.limits.max_work_per_call)

        async with self._raw_turn(p, request, "a LookupRequest", parse, price, units,
                                  need) as req:
            return self.d.lookup(p, req, tokens)

    @_rpc
    async def GetBlockTable(self, request: pb.GetBlockTableRequest, context: Any
                            ) -> pb.GetBlockTableResponse:
        p = self._caller(context)
        async with self._turn(p, step.OP_UNITS, session_id=request.session_id):
            return self.d.block_table(p, request)

    @_rpc
    async def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.InspectResponse:
        p = self._caller(context)
        async with self._turn(p, request.max_positions or 65536, session_id=request.session_id):
            return self.d.inspect(p, request)

    @_rpc
    async def ListSequences(self, request: pb.ListSequencesRequest, context: Any
                            ) -> pb.ListSequencesResponse:
        p = self._caller(context)
        size = min(request.page_size or listing.DEFAULT_LIST_PAGE, listing.MAX_LIST_PAGE)
        async with self._turn(p, listing.LIST_ENTRY_UNITS * size, tenant_id=request.tenant_id):
            return self.d.list_sequences(p, request)

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        p = self._caller(context)
        async with self._turn(p, step.OP_UNITS, tenant_id=min(p.tenants, default="")):
            return self.d.stats(p)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Any
                          ) -> AsyncIterator[pb.WatchEventsResponse]:
        task = self._open_stream()
        try:
            async for response in self.d.watch(self._caller(context), request.since_sequence):
                yield response
        except asyncio.CancelledError:
            await _ended_by_drain(self.d, context)
        except Exception as exc:
            await _abort(context, exc, "WatchEvents")
        finally:
            self._streams.discard(task)

    @_rpc
    async def FlushNamespace(self, request: pb.FlushNamespaceRequest, context: Any
                             ) -> pb.FlushNamespaceResponse:
        p = self._caller(context)
        async with self._turn(p, step.OP_UNITS, tenant_id=request.tenant_id):
            return self.d.flush(p, request)


async def _ended_by_drain(d: Daemon, context: Any) -> None:
    """A stream ``end_streams`` cancelled once the drain's grace ended answers UNAVAILABLE (a
    client reconnects to the next daemon, as after any restart). Any other cancellation (the
    client's, grpc's) propagates."""
    if not d.draining:
        raise asyncio.CancelledError
    await context.abort(grpc.StatusCode.UNAVAILABLE,
                        "the daemon is stopping: the drain's grace ended with this stream open")


def _raw(raw: bytes | Message) -> bytes:
    """A raw request's bytes (a test server registered with the generated deserializers
    passes the parsed message)."""
    return raw.SerializeToString() if isinstance(raw, Message) else raw


def _parse(cls: type[M], raw: bytes, what: str) -> M:
    """``cls`` from the bytes gRPC passed on unparsed: any failure is the client's fault."""
    try:
        message: M = cls.FromString(raw)
    except Exception:  # DecodeError, or a recursion limit hit: never INTERNAL
        raise InvalidArgument(f"{what} could not be parsed", field="request") from None
    return message


#: A raw request of this many bytes or more is read in one turn and served in another
#: (``BlockdServicer._raw_turn``): 64 KiB is ~0.2 ms of parsing.
SPLIT_BYTES = 1 << 16

#: LookupRequest.token_ids' field number (``packed.split_field`` reads it from the bytes).
LOOKUP_TOKEN_IDS = pb.LookupRequest.DESCRIPTOR.fields_by_name["token_ids"].number

#: RPCs whose requests reach their handlers as bytes, parsed in their tenant's turn
#: (``BlockdServicer._raw_turn``): the ones a tenant can send large.
RAW_REQUESTS = frozenset({"Step", "StepStream", "Lookup"})


def add_to_server(servicer: BlockdServicer, server: grpc.aio.Server) -> None:
    """``BlockdService``'s handlers, as the generated ``add_BlockdServiceServicer_to_server``
    registers them, except that ``RAW_REQUESTS`` get no request deserializer (bytes)."""
    service = pb.DESCRIPTOR.services_by_name["BlockdService"]
    handlers = {}
    for rpc in service.methods:
        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                }[(rpc.client_streaming, rpc.server_streaming)]
        parse = None if rpc.name in RAW_REQUESTS else getattr(pb, rpc.input_type.name).FromString
        handlers[rpc.name] = kind(getattr(servicer, rpc.name), request_deserializer=parse,
                                response_serializer=getattr(pb, rpc.output_type.name)
                                .SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


async def _abort(context: Any, exc: Exception, where: str) -> None:
    """End a streaming call with the status ``exc`` maps to (``_rpc``'s rule)."""
    if isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError)):
        raise exc
    if isinstance(exc, OverBudget):
        # The retry hint as metadata too, so a client need not parse the message.
        await context.abort(grpc_status(exc), details(exc),
                            (("retry-after-ms", str(exc.retry_after_ms)),))
    if isinstance(exc, BlockdError):
        await context.abort(grpc_status(exc), details(exc))
    log.exception("internal error", exc_info=exc, extra=logs.fields(rpc=where))
    await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged by blockd)")
