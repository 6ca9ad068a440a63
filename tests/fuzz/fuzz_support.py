"""The fuzz suite's view of a live daemon: its ids, its contract, and the input counter.

``World`` wraps one real daemon subprocess (``daemon_proc.start`` with
``server.check_invariants: true``): it keeps a pool of real ids (live, foreign and recycled
sessions and sequences) for the strategies to draw from, sends requests, and checks every answer
against the contract of ``proto/blockd/v1/blockd.proto``:

* the status code is one the proto documents for that RPC (``ALLOWED``); never UNKNOWN and never
  an INTERNAL from the daemon (with ``check_invariants`` an INTERNAL means a broken invariant or
  a handler that raised). The two transport-level outcomes grpc itself produces are recognised
  by their details: RESOURCE_EXHAUSTED for a request over ``max_message_bytes``, and UNKNOWN
  ``Unexpected <class 'google.protobuf.message.DecodeError'>`` for bytes that do not parse
  (what grpc's asyncio server answers; the daemon's code never runs). A Step may also be refused
  whole with RESOURCE_EXHAUSTED ``operations: the answer could reach ...`` (its answer could
  exceed ``max_message_bytes``; nothing is applied);
* a request answered with an error left the daemon's ``Stats`` (admin view) unchanged, and so
  did a Step whose every operation failed;
* OK answers are well formed (result counts, block ids < num_blocks, cached tokens a multiple of
  the block size, ...);
* the daemon process is alive and answers a gRPC health check.

``COUNTS`` counts every input sent; ``conftest.py`` prints it and writes ``.last_run.json``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from daemon_proc import LAYOUT, NS, TOKENS, Daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

S = grpc.StatusCode
SERVICE = "blockd.v1.BlockdService"
#: Every input sent to a daemon or to the conversion harness, by kind. Printed at the end of
#: the run (tests/fuzz/conftest.py) and written to tests/fuzz/.last_run.json.
COUNTS: Counter[str] = Counter()

NUM_BLOCKS = 64
BLOCK_SIZE = LAYOUT.block_size
MAX_MESSAGE_BYTES = 256 * 1024
#: Fuzz daemon configuration: a small pool and message limit, leases that never expire during
#: a run (a reaped session would change Stats between the before/after snapshots).
DAEMON_EXTRA: dict[str, dict[str, Any]] = {
    "server": {"max_message_bytes": MAX_MESSAGE_BYTES, "max_sessions": 48,
               "grace_seconds": 0.2},
    "lease": {"default_ms": 600_000, "min_ms": 600_000, "max_ms": 600_000},
}

#: Workers of tests/server/daemon_proc.py and the tenants they may act for.
WORKERS = {"alice": ("acme",), "bob": ("globex",), "carol": ("initech",),
           "dave": ("umbrella",), "multi": ("acme", "globex"), "admin": ()}
TENANTS = ("acme", "globex", "initech", "umbrella")

#: Whole-RPC status codes the proto documents per RPC. Authentication applies to every RPC
#: (UNAUTHENTICATED for a missing/unknown token, PERMISSION_DENIED for another worker's object).
_AUTH = {S.OK, S.UNAUTHENTICATED, S.PERMISSION_DENIED}
ALLOWED: dict[str, set[grpc.StatusCode]] = {
    "Attach": _AUTH | {S.INVALID_ARGUMENT, S.FAILED_PRECONDITION, S.RESOURCE_EXHAUSTED},
    "Detach": _AUTH | {S.NOT_FOUND},
    "Heartbeat": _AUTH | {S.NOT_FOUND, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT},
    "Step": _AUTH | {S.NOT_FOUND, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT},
    "StepStream": _AUTH | {S.NOT_FOUND, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT},
    "Lookup": _AUTH | {S.NOT_FOUND, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT},
    "GetBlockTable": _AUTH | {S.NOT_FOUND},
    "Inspect": _AUTH | {S.NOT_FOUND, S.INVALID_ARGUMENT},
    "Stats": {S.OK, S.UNAUTHENTICATED},
    # NOT_FOUND: an admin naming a tenant that is not configured (field tenant_id).
    "FlushNamespace": _AUTH | {S.INVALID_ARGUMENT, S.NOT_FOUND},
    # NOT_FOUND: an admin naming a tenant that is not configured (field tenant_id).
    "ListSequences": _AUTH | {S.INVALID_ARGUMENT, S.NOT_FOUND},
    # OK: the stream stayed open until the test's own deadline.
    "WatchEvents": {S.OK, S.UNAUTHENTICATED, S.PERMISSION_DENIED, S.OUT_OF_RANGE},
}
#: Per-operation status codes inside a Step (OperationStatus.code, IndexedStatus.status.code).
OP_CODES = {3, 5, 7, 8, 9, 10}  # 10: ABORTED, a sequence preempted by a higher priority

#: grpc's own answers, recognised by their details (the daemon's code never runs).
TOO_LARGE_REQUEST = "SERVER: Received message larger than max"
UNPARSEABLE = "Unexpected <class 'google.protobuf.message.DecodeError'>"

#: grpc's answer when a handler's response exceeds max_message_bytes: the request was applied but
#: its answer never arrives. Always a violation (findings F2, F5, F6; the daemon bounds the answer
#: before applying a Step and refuses it with the status below).
RESPONSE_TOO_LARGE = "SERVER: Sent message larger than max"
#: The daemon's refusal of a Step whose answer could exceed max_message_bytes (nothing applied).
STEP_TOO_LARGE = "operations: the answer could reach"
#: The refusal of a call over ``server.max_work_per_call`` (field, then reason "work").
OVER_WORK_BOUND = ("operations: work: ", "token_ids: work: ", "request: work: ")


def md(who: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),) if who else ()


#: Credentials a request may carry: a worker name, or one of these malformed ones.
BAD_CREDENTIALS: dict[str, tuple[tuple[str, str], ...]] = {
    "none": (),
    "unknown-token": (("authorization", "Bearer nope"),),
    "basic-scheme": (("authorization", f"Basic {TOKENS['alice']}"),),
    "empty-token": (("authorization", "Bearer "),),
    "no-scheme": (("authorization", TOKENS["alice"]),),
}


def metadata_for(cred: str) -> tuple[tuple[str, str], ...]:
    return BAD_CREDENTIALS[cred] if cred in BAD_CREDENTIALS else md(cred)


def utf8_len(s: str) -> int:
    return len(s.encode("utf-8"))


@dataclass
class SessionRef:
    """A session the harness attached, with what it knows of its step and fence counters."""

    sid: str
    who: str
    tenant: str
    epoch: int
    #: step_id of the last Step the daemon applied for it.
    step_id: int = 0
    #: Highest fence announced / reported complete.
    issued: int = 0
    completed: int = 0
    alive: bool = True
    seqs: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    response: Any = None
    #: StepStream / WatchEvents: the messages received before the stream ended.
    responses: list[Any] = field(default_factory=list)


class ContractViolation(AssertionError):
    pass


#: step_id is a uint64 that only grows within a session.
MAX_STEP_ID = 2**64 - 1


class World:
    """A live daemon plus the ids it minted; see the module docstring."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        opts = [("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        self.channel = grpc.insecure_channel(f"unix:{daemon.endpoints['unix']}", options=opts)
        self.stub = pb_grpc.BlockdServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.sessions: list[SessionRef] = []
        self.dead_sessions: list[str] = []
        self.seq_session: dict[str, SessionRef] = {}
        self.dead_seqs: list[str] = []
        self.epoch = 0
        #: Prompts committed into the prefix cache, per tenant (for lookups that hit).
        self.prompts: list[list[int]] = [list(range(100, 100 + 4 * k + 2)) for k in (1, 2, 3)]
        self.seed()

    # -- setup and housekeeping (not counted as fuzz inputs) ----------------------------------

    def attach(self, who: str, tenant: str) -> SessionRef:
        r = self.stub.Attach(pb.AttachRequest(worker_name=who, tenant_id=tenant, layout=LAYOUT),
                             metadata=md(who), timeout=10)
        self.epoch = r.epoch
        ref = SessionRef(r.session_id, who, tenant, r.epoch)
        self.sessions.append(ref)
        return ref

    def step(self, ref: SessionRef, ops: list[pb.Operation], fence: int = 0,
             completed: int = 0) -> pb.StepResponse:
        req = pb.StepRequest(session_id=ref.sid, epoch=self.epoch, step_id=ref.step_id + 1,
                             fence=fence, completed_fence=completed, operations=ops)
        resp = self.stub.Step(req, metadata=md(ref.who), timeout=10)
        self.learn_step(req, Outcome(S.OK, "", resp))
        return resp

    def seed(self) -> None:
        """Sessions of every worker, live sequences, cached prefixes, recycled ids."""
        for who, tenants in WORKERS.items():
            for tenant in tenants:
                self.attach(who, tenant)
        for ref in list(self.sessions):
            if ref.step_id > MAX_STEP_ID - 8:
                # The fuzzer stepped it with an id near the top of uint64: it cannot take the
                # few more Steps seeding needs (step ids only grow), so it is retired.
                self.detach(ref)
                continue
            for prompt in self.prompts[:2]:
                r = self.step(ref, [pb.Operation(admit=pb.AdmitOp(namespace=NS,
                                                                  token_ids=prompt))])
                seq = r.results[0].admit.sequence_id
                self.step(ref, [pb.Operation(commit=pb.CommitOp(sequence_id=seq))],
                          fence=ref.issued + 1)
            self.step(ref, [], completed=ref.issued)
        # Recycled ids: a released sequence and a detached session.
        gone = self.attach("alice", "acme")
        r = self.step(gone, [pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=[1, 2]))])
        seq = r.results[0].admit.sequence_id
        self.step(gone, [pb.Operation(release=pb.ReleaseOp(sequence_id=seq))])
        self.detach(gone)

    def detach(self, ref: SessionRef) -> None:
        self.stub.Detach(pb.DetachRequest(session_id=ref.sid), metadata=md(ref.who), timeout=10)
        self.forget_session(ref)

    def forget_session(self, ref: SessionRef) -> None:
        ref.alive = False
        if ref in self.sessions:
            self.sessions.remove(ref)
        self.dead_sessions.append(ref.sid)
        for seq in ref.seqs:
            self.seq_session.pop(seq, None)
            self.dead_seqs.append(seq)
        ref.seqs.clear()
        del self.dead_sessions[:-50]
        del self.dead_seqs[:-200]

    def housekeep(self) -> None:
        """Keep the daemon small: bounded sessions and sequences, every worker attached."""
        while len(self.sessions) > 14:
            self.detach(self.sessions[0])
        for ref in list(self.sessions):
            if len(ref.seqs) > 16:
                self.detach(ref)
        have = {(r.who, r.tenant) for r in self.sessions}
        for who, tenants in WORKERS.items():
            for tenant in tenants:
                if (who, tenant) not in have:
                    self.attach(who, tenant)

    # -- what the harness learns from answers -------------------------------------------------

    def session_ref(self, sid: str) -> SessionRef | None:
        for ref in self.sessions:
            if ref.sid == sid:
                return ref
        return None

    def learn(self, method: str, request: Any, out: Outcome, cred: str) -> None:
        if method in ("Step", "StepStream"):
            reqs = request if isinstance(request, list) else [request]
            resps = out.responses if method == "StepStream" else [out.response]
            for req, resp in zip(reqs, resps, strict=False):
                if resp is not None:
                    self.learn_step(req, Outcome(S.OK, "", resp))
            return
        if out.code != S.OK:
            return
        if method == "Attach":
            self.epoch = out.response.epoch
            if self.session_ref(out.response.session_id) is None:
                self.sessions.append(SessionRef(out.response.session_id, cred,
                                                out.response.tenant_id, out.response.epoch))
        elif method == "Detach":
            ref = self.session_ref(request.session_id)
            if ref is not None:
                self.forget_session(ref)
        elif method == "Heartbeat":
            ref = self.session_ref(request.session_id)
            if ref is not None:
                ref.completed = max(ref.completed, request.completed_fence)

    def learn_step(self, req: pb.StepRequest, out: Outcome) -> None:
        ref = self.session_ref(req.session_id)
        resp = out.response
        if ref is None or resp is None:
            return
        retry = req.step_id == ref.step_id
        ref.step_id = max(ref.step_id, req.step_id)
        if retry:
            return
        ref.completed = max(ref.completed, req.completed_fence)
        if req.fence:
            ref.issued = max(ref.issued, req.fence)
        for op, res in zip(req.operations, resp.results, strict=False):
            if res.status.code:
                continue
            kind = op.WhichOneof("op")
            if kind == "admit":
                self._own(ref, res.admit.sequence_id)
            elif kind == "fork":
                for child in res.fork.child_sequence_ids:
                    self._own(ref, child)
            elif kind == "release":
                seq = op.release.sequence_id
                if seq in self.seq_session:
                    owner = self.seq_session.pop(seq)
                    if seq in owner.seqs:
                        owner.seqs.remove(seq)
                self.dead_seqs.append(seq)

    def _own(self, ref: SessionRef, seq: str) -> None:
        self.seq_session[seq] = ref
        ref.seqs.append(seq)

    # -- sending ------------------------------------------------------------------------------

    def snapshot(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), metadata=md("admin"), timeout=10)

    def call(self, method: str, request: Any, metadata: Iterable[tuple[str, str]],
             timeout: float = 10.0) -> Outcome:
        """One unary RPC; ``request`` is a message or raw serialized bytes."""
        COUNTS["requests"] += 1
        COUNTS[f"rpc.{method}"] += 1
        if isinstance(request, bytes):
            fn = self.channel.unary_unary(f"/{SERVICE}/{method}")
        else:
            fn = getattr(self.stub, method)
        try:
            resp = fn(request, metadata=tuple(metadata), timeout=timeout)
        except grpc.RpcError as err:
            return Outcome(err.code(), err.details() or "")
        if isinstance(request, bytes):
            resp = getattr(pb, f"{method}Response").FromString(resp)
        return Outcome(S.OK, "", resp)

    def stream(self, requests: list[Any], metadata: Iterable[tuple[str, str]],
               timeout: float = 10.0) -> Outcome:
        """A StepStream carrying ``requests`` (messages or raw bytes)."""
        COUNTS["requests"] += len(requests)
        COUNTS["rpc.StepStream"] += len(requests)
        COUNTS["streams"] += 1
        raw = any(isinstance(r, bytes) for r in requests)
        if raw:
            fn = self.channel.stream_stream(f"/{SERVICE}/StepStream")
            reqs = [r if isinstance(r, bytes) else r.SerializeToString() for r in requests]
        else:
            fn, reqs = self.stub.StepStream, requests
        out: list[Any] = []
        try:
            for resp in fn(iter(reqs), metadata=tuple(metadata), timeout=timeout):
                out.append(pb.StepResponse.FromString(resp) if raw else resp)
        except grpc.RpcError as err:
            return Outcome(err.code(), err.details() or "", responses=out)
        return Outcome(S.OK, "", responses=out)

    def watch(self, request: Any, metadata: Iterable[tuple[str, str]],
              timeout: float) -> Outcome:
        COUNTS["requests"] += 1
        COUNTS["rpc.WatchEvents"] += 1
        if isinstance(request, bytes):
            fn = self.channel.unary_stream(f"/{SERVICE}/WatchEvents")
        else:
            fn = self.stub.WatchEvents
        out: list[Any] = []
        try:
            for ev in fn(request, metadata=tuple(metadata), timeout=timeout):
                out.append(pb.WatchEventsResponse.FromString(ev) if isinstance(ev, bytes)
                           else ev)
        except grpc.RpcError as err:
            if err.code() == S.DEADLINE_EXCEEDED:
                return Outcome(S.OK, "open until the test's deadline", responses=out)
            return Outcome(err.code(), err.details() or "", responses=out)
        return Outcome(S.OK, "", responses=out)

    def alive(self) -> None:
        """The daemon process runs and answers a health check for its service."""
        if self.d.proc.poll() is not None:
            raise ContractViolation(f"the daemon exited with {self.d.proc.returncode}:\n"
                                    + self.d.log_text()[-4000:])
        for service in ("", SERVICE):
            r = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                raise ContractViolation(f"health of {service!r} is {r.status}")


def fail(msg: str, method: str, request: Any, out: Outcome) -> None:
    shown = request if isinstance(request, bytes) else str(request)[:3000]
    raise ContractViolation(f"{method}: {msg}\n  status: {out.code} {out.details[:500]!r}\n"
                            f"  request: {shown!r}"[:6000])


def check_status(method: str, request: Any, out: Outcome, parsed: bool = True) -> None:
    """The status is one documented for ``method`` (or grpc's own, recognised by details)."""
    if out.code == S.RESOURCE_EXHAUSTED and out.details.startswith(TOO_LARGE_REQUEST):
        return  # grpc refuses an oversized message before parsing it
    if not parsed:
        # Bytes that do not parse: grpc answers a unary or server-streaming RPC itself; Step,
        # StepStream and Lookup get their bytes (parsed in the tenant's turn, issue 15) and
        # the daemon answers INVALID_ARGUMENT (F1).
        if out.code == S.UNKNOWN and out.details.startswith(UNPARSEABLE):
            return
        if method in ("Step", "StepStream", "Lookup") and out.code == S.INVALID_ARGUMENT:
            return
        fail("an unparseable request must get INVALID_ARGUMENT or grpc's own UNKNOWN "
             "(DecodeError)", method, request, out)
    if out.code == S.RESOURCE_EXHAUSTED and RESPONSE_TOO_LARGE in out.details:
        fail("the answer exceeded max_message_bytes: applied, but never answered (F2)", method,
             request, out)
    if out.code == S.INTERNAL:
        fail("INTERNAL from the daemon (a broken invariant or a handler that raised)", method,
             request, out)
    if out.code == S.UNKNOWN:
        fail("UNKNOWN status", method, request, out)
    if (method in ("Step", "StepStream") and out.code == S.RESOURCE_EXHAUSTED
            and out.details.startswith(STEP_TOO_LARGE)):
        return
    if (method in ("Step", "StepStream", "Lookup") and out.code == S.RESOURCE_EXHAUSTED
            and out.details.startswith(OVER_WORK_BOUND)):
        return  # documented: a call over server.max_work_per_call, refused before applied
    if out.code not in ALLOWED[method]:
        fail(f"status {out.code.name} is not documented for {method}", method, request, out)


def stats_equal(a: pb.StatsResponse, b: pb.StatsResponse) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def all_ops_failed(req: pb.StepRequest, resp: pb.StepResponse) -> bool:
    for res in resp.results:
        if res.status.code:
            continue
        ab = res.append_batch if res.WhichOneof("result") == "append_batch" else None
        if ab is not None and len(ab.errors) == len(ab.num_tokens):
            continue
        return False
    return True


def over_128(*values: str) -> bool:
    return any(utf8_len(v) > 128 for v in values)


def admit_out_of_bounds(op: pb.AdmitOp) -> bool:
    """An AdmitOp field outside its documented bounds (INVALID_ARGUMENT in its result)."""
    ns = op.namespace
    return (over_128(op.request_id, ns.model_id) or not ns.model_id or not op.token_ids
            or (ns.HasField("model_revision") and over_128(ns.model_revision))
            or (ns.HasField("lora_id") and over_128(ns.lora_id))
            or (ns.HasField("tokenizer_digest") and len(ns.tokenizer_digest) > 64)
            or (ns.HasField("cache_salt") and len(ns.cache_salt) > 64))


def out_of_bounds(method: str, request: Any) -> bool:
    """Whole-request fields the daemon checks right after authentication (INVALID_ARGUMENT)."""
    if method == "Attach":
        return not request.tenant_id or over_128(request.tenant_id, request.worker_name)
    if method == "FlushNamespace":
        return over_128(request.model_id, request.model_revision, request.lora_id,
                        request.tenant_id)
    return False


def check_step_response(method: str, req: pb.StepRequest, resp: pb.StepResponse,
                        retry: bool) -> None:
    out = Outcome(S.OK, "", resp)
    if resp.step_id != req.step_id:
        fail("step_id not echoed", method, req, out)
    if not retry and len(resp.results) != len(req.operations):
        fail("one result per operation", method, req, out)
    ops = req.operations if not retry else [None] * len(resp.results)
    for op, res in zip(ops, resp.results, strict=True):
        code = res.status.code
        kind = res.WhichOneof("result")
        if (code and code != 3 and op is not None and op.WhichOneof("op") == "admit"
                and admit_out_of_bounds(op.admit)):
            fail(f"an admit outside the documented bounds got {code}, not 3", method, req, out)
        if code:
            if code not in OP_CODES:
                fail(f"operation status {code} is not documented", method, req, out)
            if kind is not None:
                fail("a failed operation carries a result", method, req, out)
            if len(res.status.message.encode()) > 1024:
                fail("OperationStatus.message over 1024 bytes", method, req, out)
            continue
        if op is not None and kind != op.WhichOneof("op"):
            fail(f"result {kind} for operation {op.WhichOneof('op')}", method, req, out)
        if op is not None and kind == "admit" and admit_out_of_bounds(op.admit):
            fail("an admit outside the documented bounds succeeded", method, req, out)
        if kind == "admit":
            a = res.admit
            if (a.num_cached_tokens % BLOCK_SIZE or a.num_cached_tokens >= a.num_tokens
                    or len(a.block_table) != -(-a.num_tokens // BLOCK_SIZE)
                    or len(set(a.block_table)) != len(a.block_table)
                    or any(b >= NUM_BLOCKS for b in a.block_table)):
                fail("malformed AdmitResult", method, req, out)
            if op is not None and (a.num_tokens != len(op.admit.token_ids)
                                   or a.request_id != op.admit.request_id):
                fail("AdmitResult does not echo the request", method, req, out)
        elif kind == "fork" and op is not None:
            if len(res.fork.child_sequence_ids) != op.fork.num_children:
                fail("num_children children expected", method, req, out)
        elif kind == "append_batch":
            ab = res.append_batch
            for e in ab.errors:
                if e.status.code not in OP_CODES:
                    fail(f"append_batch entry status {e.status.code}", method, req, out)
        elif kind == "append":
            d = res.append.delta
            if any(b >= NUM_BLOCKS for b in d.block_ids):
                fail("block id out of range", method, req, out)
    for c in resp.copies:
        if c.src_block == c.dst_block or max(c.src_block, c.dst_block) >= NUM_BLOCKS:
            fail("malformed CopyOp", method, req, out)
    if any(b >= NUM_BLOCKS for b in resp.scrubbed_blocks):
        fail("scrubbed block out of range", method, req, out)


def check_response(method: str, request: Any, resp: Any, who: str | None) -> None:
    """Documented properties of an OK answer (Step is checked by check_step_response)."""
    out = Outcome(S.OK, "", resp)
    if method == "Attach":
        if not resp.session_id or utf8_len(resp.session_id) > 128 or resp.epoch < 1:
            fail("malformed AttachResponse", method, request, out)
        if resp.tenant_id != request.tenant_id or resp.lease_ms < 1:
            fail("AttachResponse does not echo the tenant", method, request, out)
        if resp.pool.num_blocks != NUM_BLOCKS or resp.pool.layout != LAYOUT:
            fail("AttachResponse pool differs from the daemon's", method, request, out)
    elif method == "Lookup":
        n = len(request.token_ids)
        if (resp.num_cached_tokens != resp.num_cached_blocks * BLOCK_SIZE
                or (n and resp.num_cached_tokens >= n) or (not n and resp.num_cached_tokens)):
            fail("malformed LookupResponse", method, request, out)
    elif method == "GetBlockTable":
        if (len(resp.block_ids) != -(-resp.num_tokens // BLOCK_SIZE)
                or resp.block_size != BLOCK_SIZE or resp.sequence_id != request.sequence_id
                or any(b >= NUM_BLOCKS for b in resp.block_ids)):
            fail("malformed GetBlockTableResponse", method, request, out)
    elif method == "Inspect":
        limit = request.max_positions or 65536
        if len(resp.positions) > limit:
            fail("more positions than max_positions", method, request, out)
        for p in resp.positions:
            if (p.slot != p.physical_block * BLOCK_SIZE + p.offset
                    or p.logical_block != p.position // BLOCK_SIZE
                    or p.offset != p.position % BLOCK_SIZE or p.position >= resp.num_tokens
                    or p.position < request.start_position):
                fail("malformed PositionInfo", method, request, out)
        for b in resp.blocks:
            if b.ref_count < 1 or b.physical_block >= NUM_BLOCKS or b.state in (0, 1):
                fail("malformed BlockInfo", method, request, out)
    elif method == "ListSequences":
        # Never another tenant's sequence for a non-admin; one ordered, bounded page.
        allowed = set(TENANTS) if who == "admin" else set(WORKERS.get(who or "", ()))
        ids = [s.sequence_id for s in resp.sequences]
        if ids != sorted(ids) or len(ids) > (request.page_size or 1000):
            fail("ListSequences page out of order or too long", method, request, out)
        if who != "admin" and any(s.tenant_id not in allowed for s in resp.sequences):
            fail("ListSequences lists another tenant's sequence", method, request, out)
        if resp.block_size != BLOCK_SIZE or (request.page_token and ids
                                             and ids[0] <= request.page_token):
            fail("malformed ListSequencesResponse", method, request, out)
    elif method == "Stats":
        total = (resp.blocks_free + resp.blocks_writing + resp.blocks_committed
                 + resp.blocks_pending + resp.blocks_cached)
        if total != resp.num_blocks or resp.num_blocks != NUM_BLOCKS:
            fail("the blocks_* gauges do not sum to num_blocks", method, request, out)
        allowed = set(TENANTS) if who == "admin" else set(WORKERS.get(who or "", ()))
        listed = [t.tenant_id for t in resp.tenants]
        if not set(listed) <= allowed or listed != sorted(listed):
            fail(f"Stats lists tenants {listed} to {who}", method, request, out)
    elif method == "Heartbeat" and (
            resp.epoch < 1 or resp.lease_expires_unix_ms < time.time() * 1000 - 60_000):
        fail("malformed HeartbeatResponse", method, request, out)


def check_events(request: pb.WatchEventsRequest, events: list[pb.WatchEventsResponse], *,
                 admin: bool) -> None:
    """An admin sees every event, gap-free from ``since_sequence``; another credential sees
    only its tenants' domains (docs/kv_events.md), so its numbers only ever increase."""
    out = Outcome(S.OK, "", responses=events)
    for prev, ev in zip(events, events[1:], strict=False):
        if admin and ev.sequence_number != prev.sequence_number + 1:
            fail("event sequence numbers are not gap-free", "WatchEvents", request, out)
        if ev.sequence_number <= prev.sequence_number:
            fail("event sequence numbers go backwards", "WatchEvents", request, out)
    first = events[0].sequence_number if events else None
    since = request.since_sequence
    if first is not None and since and (first != since if admin else first < since):
        fail("replay does not start at since_sequence", "WatchEvents", request, out)
    for ev in events:
        if ev.WhichOneof("event") == "block_stored":
            s = ev.block_stored
            if s.token_ids and len(s.token_ids) != s.block_size * len(s.block_hashes):
                fail("BlockStored token_ids length", "WatchEvents", request, out)
            if any(len(h) != 16 for h in s.block_hashes) or len(s.namespace) > 64:
                fail("malformed BlockStored", "WatchEvents", request, out)
