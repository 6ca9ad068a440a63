"""Atheris target: the conversion layer and the core's Step dispatch, in process.

Each input is one selector byte and a serialized request: ``AttachRequest``, ``LookupRequest``
or ``StepRequest``. Bytes that do not parse are dropped (grpc answers those before any daemon
code runs; see docs/fuzzing.md). The parsed request goes through ``blockd.runtime.convert``
(``check_id``, ``scope``, ``spec_from_layout``) and, like the servicer does, through an
in-process ``BlockManager``: Step operations are dispatched one by one with the servicer's
rules (per-operation errors, limits), Lookup is a pure read, Attach opens a session.

Asserted for every input:

* only ``BlockdError`` subclasses are raised, and never ``Internal`` (a broken invariant);
* a request or operation that fails (an error, or ``DoesNotFit``) leaves the manager exactly as
  it was; a Lookup never changes anything, not even LRU order;
* ``BlockManager.check_invariants()`` holds (every ``CHECK_EVERY`` inputs, default 1).

Ids: the fuzzer cannot guess the manager's random ids, so short ones are mapped onto live
objects: a session_id of at most 2 characters names a live session, a sequence id of at most 2
characters a live sequence, one starting with ``~`` a released one; longer ids are used as
they are (unknown ids).

Run::

    .venv/bin/python fuzz/fuzz_convert.py fuzz/corpus/convert -atheris_runs=100000
    .venv/bin/python fuzz/fuzz_convert.py --write-corpus fuzz/corpus/convert   # seed inputs

``tests/fuzz/test_convert_smoke.py`` runs ``test_one_input`` on a few hundred inputs without
atheris, so CI exercises this harness.
"""

from __future__ import annotations

import os
import sys
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHECK_EVERY = int(os.environ.get("FUZZ_CHECK_EVERY", "1"))
MAX_OPS = 4096
MAX_TOKENS = 1 << 20
NUM_BLOCKS = 32
#: Reset the manager once it holds this many sequences (keeps every input fast).
MAX_SEQUENCES = 300

pb: Any = None
convert: Any = None
core: Any = None


def load() -> None:
    """Import blockd (separate, so that atheris can instrument these imports)."""
    global pb, convert, core
    import types

    from blockd.api.v1 import blockd_pb2
    from blockd.core import errors, manager, spec, tenants
    from blockd.runtime import convert as conv

    pb, convert = blockd_pb2, conv
    core = types.SimpleNamespace(errors=errors, manager=manager, spec=spec, tenants=tenants)


class Harness:
    """One BlockManager with a few tenants and sessions, fed parsed requests."""

    def __init__(self) -> None:
        if pb is None:
            load()
        self.inputs = 0
        self.errors = 0
        self.reset()

    def reset(self) -> None:
        t = core.tenants
        self.spec = core.spec.PoolSpec(block_size=4, num_blocks=NUM_BLOCKS, num_layers=2,
                                       num_kv_heads=2, head_dim=8, dtype="float16")
        policies = [
            t.TenantPolicy("acme", quota_blocks=20),
            t.TenantPolicy("globex", quota_blocks=20, guaranteed_blocks=4),
            t.TenantPolicy("initech", quota_blocks=16, sharing=t.Sharing.GROUP, group="labs"),
            t.TenantPolicy("umbrella", quota_blocks=16, sharing=t.Sharing.GROUP, group="labs",
                           scrub_on_reuse=False),
        ]
        self.m = core.manager.BlockManager(self.spec, policies, seed=0)
        self.sessions = [self.m.open_session(x) for x in ("acme", "acme", "globex",
                                                              "initech", "umbrella")]
        self.released: list[str] = []

    # -- ids ---------------------------------------------------------------------------------

    def session(self, sid: str) -> str:
        if len(sid) <= 2 and self.sessions:
            return self.sessions[sum(map(ord, sid)) % len(self.sessions)]
        return sid

    def sequence(self, seq: str) -> str:
        live = list(self.m.sequences)
        if seq.startswith("~") and self.released:
            return self.released[sum(map(ord, seq)) % len(self.released)]
        if len(seq) <= 2 and live:
            return live[sum(map(ord, seq)) % len(live)]
        return seq

    # -- checks ------------------------------------------------------------------------------

    def snapshot(self, deep: bool = False) -> tuple[Any, ...]:
        m = self.m
        a = m.blocks
        c = m.counters
        base = (tuple(a.count_states()), tuple(a.usage), tuple(a.cached), a.num_free,
                len(m.sequences), len(m.sessions), len(m.namespaces), len(m.index.map),
                c.queried_tokens, c.hit_tokens, c.evictions, c.cow_copies,
                tuple((s.issued, s.completed, len(s.waiting)) for s in m.sessions.values()))
        if deep:
            base += (tuple(tuple(a.lru_order(t)) for t in range(len(a.usage))),
                     tuple(sorted((k, tuple(v.table), v.num_tokens)
                                  for k, v in m.sequences.items())))
        return base

    def guarded(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """Call ``fn``; a BlockdError (never Internal) or DoesNotFit must change nothing."""
        before = self.snapshot()
        try:
            out = fn(*args, **kw)
        except core.errors.BlockdError as err:
            assert not isinstance(err, core.errors.Internal), err
            assert isinstance(err.status, core.errors.StatusCode)
            self.errors += 1
            after = self.snapshot()
            assert after == before, f"{fn.__name__} raised {err!r} but changed {before}->{after}"
            return err
        if isinstance(out, core.manager.DoesNotFit):
            after = self.snapshot()
            assert after == before, f"{fn.__name__} did not fit but changed the manager"
        return out

    # -- requests ----------------------------------------------------------------------------

    def attach(self, req: Any) -> None:
        def run() -> None:
            convert.check_id(req.tenant_id, "tenant_id")
            convert.check_id(req.worker_name, "worker_name", required=False)
            if not req.HasField("layout"):
                raise core.errors.InvalidArgument("layout", field="layout")
            wanted = convert.spec_from_layout(req.layout, NUM_BLOCKS)
            assert wanted.num_blocks == NUM_BLOCKS
            if self.spec.layout_mismatches(wanted):
                raise core.errors.FailedPrecondition("layout mismatch", field="layout")
            assert convert.spec_from_layout(convert.layout_of(wanted), NUM_BLOCKS) == wanted
            if len(self.sessions) < 16:
                self.sessions.append(self.m.open_session(req.tenant_id))

        self.guarded(run)

    def lookup(self, req: Any) -> None:
        before = self.snapshot(deep=True)
        sid = self.session(req.session_id)

        def run() -> int:
            scope = convert.scope(req.namespace)
            if len(req.token_ids) > MAX_TOKENS:
                raise core.errors.InvalidArgument("too many", field="token_ids")
            return self.m.lookup(sid, scope, req.token_ids)

        n = self.guarded(run)
        if isinstance(n, int):
            assert n % self.spec.block_size == 0
            assert n == 0 or n < len(req.token_ids)
        assert self.snapshot(deep=True) == before, "a lookup changed the manager"

    def step(self, req: Any) -> None:
        m = self.m
        sid = self.session(req.session_id)
        if req.step_id == 0 or len(req.operations) > MAX_OPS:
            return  # the servicer refuses these before touching the manager
        if isinstance(self.guarded(m.begin_step, sid, req.fence, req.completed_fence),
                      core.errors.BlockdError):
            return
        fence = req.fence
        for op in req.operations:
            kind = op.WhichOneof("op")
            if kind == "admit":
                a = op.admit

                def admit(a: Any = a) -> Any:
                    convert.check_id(a.request_id, "request_id", required=False)
                    scope = convert.scope(a.namespace)
                    if len(a.token_ids) > MAX_TOKENS:
                        raise core.errors.InvalidArgument("too many", field="token_ids")
                    return m.admit(sid, scope, a.token_ids, cache=not a.disable_prefix_cache,
                                   priority=a.priority)

                out = self.guarded(admit)
                if isinstance(out, core.manager.AdmitResult):
                    assert out.num_cached_tokens % self.spec.block_size == 0
                    assert out.num_cached_tokens < out.num_tokens == len(a.token_ids)
            elif kind == "append":
                self.guarded(m.append, sid, self.sequence(op.append.sequence_id),
                             op.append.token_ids, fence)
            elif kind == "append_batch":
                ab = op.append_batch
                ids = [self.sequence(s) for s in ab.sequence_ids]
                if not ids or len(ids) > MAX_OPS or len(ab.token_ids) > MAX_TOKENS:
                    continue
                raw = array("I", ab.token_ids).tobytes()
                out = self.guarded(m.append_batch, sid, ids, raw, list(ab.num_tokens) or None,
                                   fence)
                if isinstance(out, core.manager.BatchAppend):
                    for _, err in out.errors:
                        assert not isinstance(err, core.errors.Internal), err
            elif kind == "release":
                seq = self.sequence(op.release.sequence_id)
                if isinstance(self.guarded(m.release, sid, seq, fence), int):
                    self.released = (self.released + [seq])[-50:]
            elif kind == "commit":
                self.guarded(m.commit, sid, self.sequence(op.commit.sequence_id), fence)
            elif kind == "fork":
                self.guarded(m.fork, sid, self.sequence(op.fork.sequence_id),
                             op.fork.num_children)
        m.take_scrubbed()
        if req.step_id % 2 and sid in m.sessions:
            # A heartbeat reporting every fence done (what a worker does once its GPU caught up).
            m.complete_fence(sid, m.sessions[sid].issued)

    def run(self, data: bytes) -> None:
        if not data:
            return
        kind, body = data[0] % 3, data[1:]
        cls = (pb.AttachRequest, pb.LookupRequest, pb.StepRequest)[kind]
        try:
            req = cls.FromString(body)
        except Exception as exc:  # DecodeError; grpc answers these itself
            if type(exc).__name__ != "DecodeError":
                raise
            return
        self.inputs += 1
        (self.attach, self.lookup, self.step)[kind](req)
        if self.inputs % CHECK_EVERY == 0:
            self.m.check_invariants()
        if len(self.m.sequences) > MAX_SEQUENCES:
            self.reset()


_HARNESS: Harness | None = None


def test_one_input(data: bytes) -> None:
    """The fuzz target (atheris, or the pytest smoke test)."""
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness()
    _HARNESS.run(data)


def seed_inputs() -> list[bytes]:
    """Valid requests of each kind: a starting corpus."""
    if pb is None:
        load()
    layout = pb.KvLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                         dtype=pb.KV_DTYPE_FLOAT16, kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                         tp_size=1)
    ns = pb.CacheNamespace(model_id="tiny", model_revision="r1")
    salted = pb.CacheNamespace(model_id="tiny", cache_salt=b"s", tokenizer_digest=b"d" * 16)
    prompt = list(range(100, 110))
    op = pb.Operation
    steps = [
        [op(admit=pb.AdmitOp(namespace=ns, token_ids=prompt))],
        [op(commit=pb.CommitOp(sequence_id="a"))],
        [op(append=pb.AppendOp(sequence_id="a", token_ids=[1, 2, 3]))],
        [op(fork=pb.ForkOp(sequence_id="a", num_children=2))],
        [op(append_batch=pb.AppendBatchOp(sequence_ids=["a", "b", "c"], token_ids=[1, 2, 3]))],
        [op(release=pb.ReleaseOp(sequence_id="a")), op(release=pb.ReleaseOp(sequence_id="a"))],
        [op(admit=pb.AdmitOp(namespace=salted, token_ids=prompt, disable_prefix_cache=True)),
         op(append=pb.AppendOp(sequence_id="~", token_ids=[9]))],
    ]
    out = [bytes([0]) + pb.AttachRequest(tenant_id="acme", layout=layout).SerializeToString(),
           bytes([0]) + pb.AttachRequest(tenant_id="globex", layout=layout,
                                         worker_name="w").SerializeToString(),
           bytes([1]) + pb.LookupRequest(session_id="a", namespace=ns,
                                         token_ids=prompt).SerializeToString()]
    for i, ops in enumerate(steps, 1):
        req = pb.StepRequest(session_id="a", step_id=i, fence=i, completed_fence=i - 1,
                             operations=ops)
        out.append(bytes([2]) + req.SerializeToString())
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-corpus":
        d = Path(sys.argv[2])
        d.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(seed_inputs()):
            (d / f"seed-{i:02d}").write_bytes(data)
        print(f"wrote {len(seed_inputs())} seeds to {d}")
        return
    import atheris

    with atheris.instrument_imports():
        load()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
