"""One Step: validated against the per-request limits, then applied operation by operation.

``check`` runs before anything is applied: the step id (a retry is answered from the session's
last answer, not reapplied), the operation count, the Step's work (``tally``, bounded by
``server.max_work_per_call`` so that no call holds the shared event loop for long) and a bound
of the answer's size (an answer that cannot be sent would leave the worker with a Step applied
that it never learns about).
``apply_step`` then applies the operations in order; each operation's error becomes that
operation's ``OperationStatus`` (``blockd.runtime.convert.operation_status``) and the others
still apply.

A journal replay (``blockd.runtime.recovery``) calls ``apply_step`` itself with ``limits=None``:
the Step was accepted under the limits in force when it was first applied, and its answer must
come out the same.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.contract import KVManager
from blockd.core.errors import BlockdError, FailedPrecondition, InvalidArgument, ResourceExhausted
from blockd.core.preemption import REASON as PREEMPT_REASON
from blockd.core.results import DoesNotFit, SessionView
from blockd.runtime import convert
from blockd.runtime.remote import RemoteTier
from blockd.runtime.sessions import SessionInfo, Sessions

#: An upper bound of one preemption notice's encoded size: a minted 22-character sequence id,
#: the reason label and protobuf framing. Every pending notice goes into the session's next
#: answer: a worker must learn of a preemption before it launches that Step's kernels, since
#: the victim's blocks are reusable once the fence it reports completes.
PREEMPTED_NOTICE_BYTES = 48


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The per-request limits of ``server.*`` a Step is checked against."""

    max_operations_per_step: int
    max_tokens_per_operation: int
    max_message_bytes: int
    #: ``server.max_work_per_call``: the most work units (``tally``) one call may cost.
    max_work_per_call: int = 1 << 17


#: Work units (``tally``): one per token id hashed or stored, and these per operation,
#: per batch entry and per forked child. Measured on the daemon's own code: a unit is about a
#: tenth of a microsecond of loop time (an admit ~25 us, an append or release ~4-8 us, a batch
#: entry ~0.6 us, a token id ~0.1 us), so ``server.max_work_per_call`` bounds how long one call
#: holds the event loop every tenant shares.
ADMIT_UNITS = 256
OP_UNITS = 64
ENTRY_UNITS = 8
ATTACH_UNITS = 1024


#: The longest session id ``leading_session_id`` reads (minted ids are 24 characters): its
#: length fits one varint byte.
MAX_PEEKED_SESSION_ID = 127


def leading_session_id(raw: bytes) -> str:
    """The session id of a serialized StepRequest or LookupRequest, read without parsing it.

    The server takes a request's turn, and charges its bytes, before it parses it (so the
    parse runs in the tenant's own turn), which needs the tenant first: the session id is
    field 1 (a length-delimited string), which every protobuf encoder writes first. Only that
    leading field is read, in O(1): anything else (no leading field 1, an over-long or
    non-UTF-8 id, a truncated length) gives ``""``, and the call queues under its
    credential's own name. The parse decides what the request means; this only chooses whose
    turn and budget it waits for, among the tenants its caller acts for.
    """
    if len(raw) < 2 or raw[0] != 0x0A:  # field 1, wire type 2
        return ""
    n = raw[1]
    if n > MAX_PEEKED_SESSION_ID:  # a multi-byte length (>= 0x80): longer than any id
        return ""
    data = raw[2:2 + n]
    if len(data) != n:
        return ""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return ""


@dataclass(frozen=True, slots=True)
class Tally:
    """A Step's counts, read once from the request (nothing parsed or applied): what it costs
    in work units, and what its answer can hold (``answer_bound``)."""

    #: Work units (``tally``): the budget and the per-call bound charge these.
    units: int
    #: Batch entries and fork children: each adds a status or a result to the answer.
    entries: int
    #: Block ids the answer can list.
    blocks: int
    #: Bytes of request ids the answer echoes.
    echoed: int


def tally(req: pb.StepRequest, block_size: int) -> Tally:
    """One pass over the operations: 1 unit per token id, ``ADMIT_UNITS`` per admit,
    ``OP_UNITS`` per other operation or forked child, ``ENTRY_UNITS`` per batch entry; and per
    admit or append the blocks it can hand out (twice: a table and ``scrubbed_blocks``)."""
    B = block_size
    units = entries = blocks = echoed = 0
    for op in req.operations:
        kind = op.WhichOneof("op")
        if kind == "admit":
            n = len(op.admit.token_ids)
            units += ADMIT_UNITS + n
            blocks += n // B + 1
            echoed += len(op.admit.request_id) * 4  # UTF-8 of a str: at most 4 bytes each
        elif kind == "append":
            n = len(op.append.token_ids)
            units += OP_UNITS + n
            blocks += n // B + 2
        elif kind == "append_batch":
            batch = op.append_batch
            k = len(batch.sequence_ids)
            n = len(batch.token_ids)
            units += OP_UNITS + ENTRY_UNITS * k + n
            entries += k
            blocks += n // B + 2 * k
        elif kind == "fork":
            children = max(0, min(op.fork.num_children, 64))
            units += OP_UNITS * (1 + children)
            entries += children
        else:
            units += OP_UNITS
    return Tally(units, entries, blocks, echoed)


def check_work(limits: StepLimits, units: int, what: str, field: str) -> None:
    """Refuse a call costing more than ``server.max_work_per_call``, before it is applied."""
    if units > limits.max_work_per_call:
        raise ResourceExhausted(
            f"work: the {what} costs {units} work units, over server.max_work_per_call "
            f"({limits.max_work_per_call}): split it", reason="work", field=field)


def check_token_count(limits: StepLimits | None, count: int, field: str) -> None:
    """Refuse ``count`` token ids in one field if they are more than the limit."""
    if limits is not None and count > limits.max_tokens_per_operation:
        raise InvalidArgument(f"more than {limits.max_tokens_per_operation} token ids",
                              field=field)


#: From this many token ids on, ``token_bytes`` copies a field through numpy.
NUMPY_TOKENS = 128


def token_bytes(limits: StepLimits | None, tokens: Any, field: str) -> bytes:
    """A repeated uint32 field (refused if longer than the limit) as the core's uint32 bytes.

    A long field goes through numpy, which reads protobuf's repeated field through its
    ``__array__`` in one C copy: 0.01 ms for 16k token ids, against 0.5 ms through a list
    (``tokens[:]``), which keeps the few ids of a decode step cheaper (0.7 against 5 us for
    one id; even at about 128)."""
    check_token_count(limits, len(tokens), field)
    if len(tokens) >= NUMPY_TOKENS:
        return np.asarray(tokens, dtype="<u4").tobytes()
    return array("I", tokens[:]).tobytes()


def check(info: SessionInfo, req: pb.StepRequest, limits: StepLimits, block_size: int,
          view: SessionView, counts: Tally | None = None) -> pb.StepResponse | Tally:
    """Validate a Step before anything is applied: a retry's earlier answer, else the Step's
    ``Tally`` (what the caller charges to the tenant's budget; ``counts``: already taken by
    the server to price the Step's turn, so it is not counted twice)."""
    if req.step_id == 0:
        raise InvalidArgument("step_id must be >= 1", field="step_id")
    if req.step_id == info.last_step_id and info.last_response is not None:
        return info.last_response  # a retry: answered, not reapplied
    if req.step_id < info.last_step_id:
        raise FailedPrecondition(
            f"step_id {req.step_id} is older than the last step {info.last_step_id}",
            field="step_id")
    limit = limits.max_operations_per_step
    if len(req.operations) > limit:
        raise InvalidArgument(f"more than {limit} operations", field="operations")
    if counts is None:
        counts = tally(req, block_size)
    check_work(limits, counts.units, "Step", "operations")
    bound = answer_bound(counts, len(req.operations), view)
    if bound > limits.max_message_bytes:
        raise ResourceExhausted(
            f"the answer could reach {bound} bytes, over max_message_bytes "
            f"({limits.max_message_bytes}): split the Step", reason="message",
            field="operations")
    return counts


def answer_bound(counts: Tally, num_operations: int, view: SessionView) -> int:
    """A cheap upper bound of a Step's answer size, from its ``Tally`` (no op is applied).

    Per operation or batch entry at most ~120 bytes of status or result (ids, counts, an
    error field path), plus 10 bytes per block an admit or append can hand out (its id in
    a table and again in ``scrubbed_blocks``), plus what an answer echoes (request_ids),
    plus every preemption notice the answer can carry: those pending for the session and one
    per sequence of the session (the step's own admits may preempt any of them).
    """
    notices = PREEMPTED_NOTICE_BYTES * (view.num_unreported_preemptions + view.num_sequences)
    return (256 + 120 * (num_operations + counts.entries) + 10 * counts.blocks + counts.echoed
            + notices)


def apply_step(m: KVManager, sessions: Sessions, info: SessionInfo, req: pb.StepRequest, *,
               epoch: int, limits: StepLimits | None, errors: Counter[str],
               failed: dict[int, bytes] | None = None,
               remote: RemoteTier | None = None) -> pb.StepResponse:
    """Apply a checked Step; the answer lists the blocks to zero (``scrubbed_blocks``), which
    the caller zeroes in a live Step and not in a replay (workers wrote to them since).

    ``errors`` counts the failed operations and batch entries by status name. ``failed``
    (a replay of ``journal_record``): the operations that failed when the Step was first
    applied, by index, with their serialized status; they are answered with it, not applied
    (as are admits that were answered "pending" by the remote tier: an empty status).
    ``remote``: a live Step's remote tier (``RemoteTier.admit``).
    """
    sid = info.id
    m.begin_step(sid, req.fence, req.completed_fence)
    resp = pb.StepResponse(step_id=req.step_id, epoch=epoch)
    copies = resp.copies
    for i, op in enumerate(req.operations):
        kind = op.WhichOneof("op")
        result = resp.results.add()
        if failed is not None and i in failed:
            result.status.ParseFromString(failed[i])
            if result.status.code:
                errors[convert.status_name(result.status.code)] += 1
            continue
        try:
            if kind == "append_batch":
                for code in _append_batch(m, sid, i, op.append_batch, req.fence, result,
                                          copies, limits):
                    errors[convert.status_name(code)] += 1
            elif kind == "append":
                tokens = token_bytes(limits, op.append.token_ids, "token_ids")
                out = m.append(sid, op.append.sequence_id, tokens, req.fence)
                if isinstance(out, DoesNotFit):
                    _failed(result, out, i, kind, errors)
                else:
                    convert.append_result(result.append, op.append.sequence_id, out, copies)
            elif kind == "admit":
                a = op.admit
                convert.check_id(a.request_id, "request_id", required=False)
                scope = convert.scope(a.namespace)
                raw = token_bytes(limits, a.token_ids, "token_ids")
                cache = not a.disable_prefix_cache
                admitted = (m.admit(sid, scope, raw, cache=cache, priority=a.priority)
                            if remote is None else
                            remote.admit(m, sid, info.tenant_id, scope, raw, cache=cache,
                                         priority=a.priority, wait=a.wait_for_remote))
                if isinstance(admitted, int):  # nothing admitted: a fetch is under way
                    result.admit.request_id = a.request_id
                    result.admit.pending_remote_blocks = admitted
                elif isinstance(admitted, DoesNotFit):
                    _failed(result, admitted, i, kind, errors)
                else:
                    convert.admit_result(result.admit, admitted, a.request_id)
            elif kind == "release":
                n = m.release(sid, op.release.sequence_id, req.fence)
                result.release.num_blocks_released = n
            elif kind == "commit":
                n = m.commit(sid, op.commit.sequence_id, req.fence)
                result.commit.num_blocks_committed = n
            elif kind == "fork":
                children = m.fork(sid, op.fork.sequence_id, op.fork.num_children)
                result.fork.child_sequence_ids.extend(children)
            else:
                raise InvalidArgument("operation has no op set", field="op")
        except BlockdError as err:
            _failed(result, err, i, kind, errors)
    for seq_id in m.take_preempted(sid):
        resp.preempted.add(sequence_id=seq_id, reason=PREEMPT_REASON)
    resp.scrubbed_blocks.extend(m.take_scrubbed())
    sessions.stepped(info, req, resp)
    return resp


def journal_record(req: pb.StepRequest, resp: pb.StepResponse
                   ) -> tuple[bytes, dict[int, bytes]]:
    """What a journal keeps of an applied Step: the request without unknown fields and with
    every failed operation emptied, and those operations' statuses by index.

    A failed operation changed nothing (the core checks before it commits), so replaying its
    status instead of the operation rebuilds the same state and the same answer; the record
    holds what was applied (bounded by what the tenant's quota let it place) plus a few bytes
    per refusal, never a refused request's token ids or fields this daemon does not know.
    """
    kept = pb.StepRequest()
    kept.CopyFrom(req)
    kept.DiscardUnknownFields()
    statuses: dict[int, bytes] = {}
    for i, result in enumerate(resp.results):
        if result.status.code or result.admit.pending_remote_blocks:
            kept.operations[i].Clear()
            statuses[i] = result.status.SerializeToString()
    return kept.SerializeToString(), statuses


def _failed(result: pb.OperationResult, err: BlockdError | DoesNotFit, index: int,
            kind: str | None, errors: Counter[str]) -> None:
    """One operation failed: its result is only the status; the others still apply."""
    result.Clear()
    field = ""
    if isinstance(err, BlockdError):
        prefix = f"operations[{index}].{kind}." if kind else f"operations[{index}]."
        field = prefix + convert.proto_field(err.field)
    convert.operation_status(result.status, err, field)
    errors[convert.status_name(result.status.code)] += 1


def _append_batch(m: KVManager, sid: str, index: int, op: pb.AppendBatchOp, fence: int,
                  result: pb.OperationResult, copies: Any, limits: StepLimits | None
                  ) -> list[int]:
    ids = list(op.sequence_ids)
    if not ids:
        raise InvalidArgument("needs at least one sequence id", field="sequence_ids")
    if limits is not None and len(ids) > limits.max_operations_per_step:
        raise InvalidArgument(f"more than {limits.max_operations_per_step} sequence ids",
                              field="sequence_ids")
    counts = list(op.num_tokens) or None
    raw = token_bytes(limits, op.token_ids, "token_ids")
    out = m.append_batch(sid, ids, raw, counts, fence)
    return convert.append_batch_result(result.append_batch, out,
                                       f"operations[{index}].append_batch.", copies)
