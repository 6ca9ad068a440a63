"""Stateful property test of the BlockManager against an independent reference model.

The machine drives every Step operation (admit, append, fork, release, commit), fence completion,
lookups, flushes and session close/reopen on a small pool with a few tenants, and after every
step compares the manager with a dict-based model that it maintains itself:

* the *worker simulation*: per physical slot, what K/V the worker wrote there. A slot's content is
  ``(namespace, token prefix up to and including that position)``, because a position's K/V
  depends on every earlier token (and on the model). Admit writes the uncached suffix, append
  applies the copy op and writes the new tokens at ``table[p // B] * B + p % B``. Every live
  sequence must read exactly its own K/V at every position (this is "no foreign KV": a prefix hit
  that hands out a block computed for another prefix, namespace or tenant fails it);
* which blocks may be hit: committed (with cache on) in a given namespace, after the commit's
  fence completed, not flushed and not reallocated since;
* which blocks are still covered by an incomplete release fence (never reallocated or scrubbed);
* per-tenant quotas, "does not fit changes nothing", invalid fences change nothing.

Fences: the model keeps, per session, ``issued`` (highest fence announced by a *successful*
operation or ``begin_step``; an operation that fails announces nothing) and ``completed``; a
fence-0 release or commit waits for ``issued``.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from colliding_hashers import LenHasher, TailHasher
from helpers import CountingIds, state_of
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blockd.core import (
    AdmitResult,
    AppendResult,
    BlockManager,
    DoesNotFit,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PoolSpec,
    PrefixScope,
    Sharing,
    TenantPolicy,
    snapshot,
)

SCOPES = [
    PrefixScope("m1"),
    PrefixScope("m1", lora_id="l1"),
    PrefixScope("m2", model_revision="r1", tokenizer_digest=b"tk"),
    PrefixScope("m1", salt=b"s"),
]
#: Index into SCOPES, biased towards the first so that prefix hits happen.
SCOPE_CHOICE = st.sampled_from([0, 0, 0, 0, 0, 0, 1, 2, 3])
SHARING_CHOICES = ["private", "group:g1", "group:g1", "group:g2", "public", "public"]
MAX_LIVE = 12

Content = tuple[tuple, tuple[int, ...]]


def domain_of(sharing: str, tenant_id: str) -> str:
    """The sharing domain, computed independently of ``TenantPolicy.sharing_domain``."""
    if sharing == "private":
        return f"private:{tenant_id}"
    return sharing  # "group:<name>" or "public"


def policy_of(tenant_id: str, sharing: str, quota: int, guaranteed: int, scrub: bool
              ) -> TenantPolicy:
    if sharing == "private":
        return TenantPolicy(tenant_id, quota, guaranteed, sharing=Sharing.PRIVATE,
                            scrub_on_reuse=scrub)
    if sharing == "public":
        return TenantPolicy(tenant_id, quota, guaranteed, sharing=Sharing.PUBLIC,
                            scrub_on_reuse=scrub)
    return TenantPolicy(tenant_id, quota, guaranteed, sharing=Sharing.GROUP,
                        group=sharing.split(":", 1)[1], scrub_on_reuse=scrub)


@dataclass
class RSeq:
    session: str
    tenant: int
    ns: tuple
    tokens: list[int]
    table: list[int]
    num_committed: int
    cache: bool
    #: Id of the admitted sequence this one descends from by forks.
    family: str


@dataclass
class RSession:
    tenant: int
    completed: int = 0
    issued: int = 0
    #: Incomplete fences in issue order: (fence, "release" | "commit", blocks, ns).
    events: list[tuple[int, str, list[int], tuple | None]] = field(default_factory=list)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: BlockManager | None = None
        #: What happened in this run (reported as hypothesis events at teardown).
        self.seen: set[str] = set()
        self.steps = 0

    def teardown(self) -> None:
        event(f"steps run: {self.steps // 10 * 10}+")
        for what in sorted(self.seen):
            event(f"run saw: {what}")

    # -- setup --------------------------------------------------------------------------------

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        B = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
        N = data.draw(st.integers(12, 24), label="num_blocks")
        n_tenants = data.draw(st.integers(2, 3), label="tenants")
        self.hasher = data.draw(st.sampled_from(["xxh3", "xxh3", "len", "tail"]), label="hasher")
        policies = []
        self.domains: list[str] = []
        for t in range(n_tenants):
            tid = f"t{t}"
            sharing = data.draw(st.sampled_from(SHARING_CHOICES), label=f"sharing {tid}")
            quota = data.draw(st.integers(N // 2, N), label=f"quota {tid}")
            guaranteed = 0
            if t == 0:
                guaranteed = data.draw(st.integers(1, min(4, quota)), label="guaranteed")
            scrub = data.draw(st.booleans(), label=f"scrub {tid}")
            policies.append(policy_of(tid, sharing, quota, guaranteed, scrub))
            self.domains.append(domain_of(sharing, tid))
        self.B = B
        self.N = N
        self.policies = policies
        factory: object = None
        if self.hasher == "len":
            factory = LenHasher
        elif self.hasher == "tail":
            factory = type("TailHasherB", (TailHasher,), {"chunk": 4 * B})
        self.m = BlockManager(PoolSpec(block_size=B, num_blocks=N), policies, seed=12345,
                              hasher_factory=factory)  # type: ignore[arg-type]
        # Deterministic sequence ids: the manager iterates sets of them (close_session), so
        # random ids would make a failing run impossible to replay and shrink.
        self.m.set_ids(CountingIds())
        # System prompts: 0 and 1 share their first block, 3 shares only its second block with
        # 0 (a stale child of 0's first block must never serve it), 2 is unrelated.
        self.system = [
            list(range(10, 10 + 2 * B)),
            list(range(10, 10 + B)) + list(range(30, 30 + B)),
            list(range(50, 50 + 3 * B)),
            list(range(70, 70 + B)) + list(range(10 + B, 10 + 2 * B)),
        ]
        # -- the reference model --
        self.sessions: dict[str, RSession] = {}
        self.session_tenant: dict[str, int] = {}
        for t in range(n_tenants):
            for k in range(data.draw(st.integers(1, 2), label=f"sessions t{t}")):
                sid = f"s{t}{k}"
                self.m.open_session(f"t{t}", sid)
                self.sessions[sid] = RSession(t)
                self.session_tenant[sid] = t
        self.seqs: dict[str, RSeq] = {}
        #: Token lists of admitted sequences (at admit and at release), to draw prompts from.
        self.history: list[list[int]] = []
        #: slot -> what the simulated worker wrote there.
        self.sim: dict[int, Content | None] = {}
        #: block -> namespace it may be hit in.
        self.hittable: dict[int, tuple] = {}
        #: block -> tenant slot that last allocated it.
        self.owner: dict[int, int] = {}
        #: Blocks committed (by any sequence naming them) since they were allocated.
        self.committed: set[int] = set()
        event(f"hasher={self.hasher} B={B}")

    # -- helpers ------------------------------------------------------------------------------

    def ns_of(self, tenant: int, scope: PrefixScope) -> tuple:
        return (scope.model_id, scope.model_revision, scope.lora_id, scope.tokenizer_digest,
                self.domains[tenant], scope.salt)

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        """A system prompt, an earlier sequence's tokens, or nothing; plus a random suffix."""
        which = data.draw(st.sampled_from(["sys0", "sys1", "sys2", "sys3", "earlier", "earlier",
                                           "none"]), label="prompt start")
        if which == "earlier" and self.history:
            start = data.draw(st.sampled_from(self.history), label="earlier prompt")
        elif which.startswith("sys"):
            start = self.system[int(which[3])]
        else:
            start = []
        suffix = data.draw(st.lists(st.integers(0, 3), max_size=self.B + 1), label="suffix")
        return (start + suffix) or [0]

    def snapshot(self) -> object:
        """The manager's whole state (``helpers.state_of``), for "changed nothing" checks."""
        assert self.m is not None
        return state_of(self.m)

    def covered(self) -> set[int]:
        out: set[int] = set()
        for rs in self.sessions.values():
            for _f, kind, blocks, _ns in rs.events:
                if kind == "release":
                    out.update(blocks)
        return out

    def live_users(self) -> dict[int, list[tuple[str, int]]]:
        users: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for sid, rs in self.seqs.items():
            for i, b in enumerate(rs.table):
                users[b].append((sid, i))
        return users

    def expected(self, rs: RSeq, p: int) -> Content:
        return (rs.ns, tuple(rs.tokens[: p + 1]))

    def slot(self, table: list[int], p: int) -> int:
        return table[p // self.B] * self.B + p % self.B

    def choose_fence(self, data: st.DataObject, rs: RSession) -> tuple[int, bool]:
        """(fence, valid) for a step's operation."""
        kind = data.draw(st.sampled_from(["zero", "zero", "next", "next", "same", "invalid"]),
                         label="fence kind")
        if kind == "same" and rs.issued > rs.completed:
            return rs.issued, True
        if kind == "invalid":
            top = max(rs.completed, rs.issued - 1)
            bad = data.draw(st.sampled_from([-1, *range(1, top + 1)]), label="bad fence")
            return bad, False
        if kind == "next":
            return rs.issued + data.draw(st.integers(1, 2), label="fence step"), True
        return 0, True

    def effective(self, rs: RSession, fence: int) -> int:
        if fence:
            rs.issued = max(rs.issued, fence)
            return fence
        return rs.issued

    def model_release(self, rs: RSession, blocks: list[int], eff: int) -> None:
        if eff > rs.completed:
            rs.events.append((eff, "release", list(blocks), None))

    def model_commit(self, rs: RSession, blocks: list[int], ns: tuple, eff: int) -> None:
        if eff > rs.completed:
            rs.events.append((eff, "commit", list(blocks), ns))
        else:
            for b in blocks:
                self.hittable[b] = ns

    def model_complete(self, rs: RSession, value: int) -> None:
        rs.completed = max(rs.completed, value)
        while rs.events and rs.events[0][0] <= rs.completed:
            _f, kind, blocks, ns = rs.events.pop(0)
            if kind == "commit":
                assert ns is not None
                for b in blocks:
                    self.hittable[b] = ns

    def check_new_blocks(self, new: list[int], tenant: int, scrubbed: list[int]) -> None:
        """Blocks an operation just allocated: really free, past every fence; scrub as needed."""
        users = self.live_users()
        covered = self.covered()
        assert len(set(new)) == len(new), f"allocation names a block twice: {new}"
        for b in new:
            assert b not in users, f"block {b} allocated while sequences {users[b]} still use it"
            assert b not in covered, f"block {b} reallocated before its release fence completed"
            assert self.m is not None and self.m.block_state(b) == "writing"
            prev = self.owner.get(b)
            if prev is not None and prev != tenant and self.policies[prev].scrub_on_reuse:
                assert b in scrubbed, f"block {b} of t{prev} handed to t{tenant} unscrubbed"
            self.owner[b] = tenant
            self.hittable.pop(b, None)
            self.committed.discard(b)
            for o in range(self.B):
                self.sim[b * self.B + o] = None

    def write(self, rs: RSeq, start: int) -> None:
        """The simulated worker writes K/V of positions ``start..`` of ``rs``."""
        for p in range(start, len(rs.tokens)):
            b = rs.table[p // self.B]
            assert b not in self.hittable, f"write into committed/indexed block {b}"
            assert self.m is not None and self.m.block_state(b) == "writing"
            self.sim[self.slot(rs.table, p)] = self.expected(rs, p)

    def pick_seq(self, data: st.DataObject) -> tuple[str, RSeq]:
        sid = data.draw(st.sampled_from(list(self.seqs)), label="sequence")
        return sid, self.seqs[sid]

    def pending_hittable(self, sid: str) -> dict[int, tuple]:
        """Blocks the session committed under a fence not yet complete: hittable by that
        session's own admissions only (its worker orders its kernels after the K/V write)."""
        return {b: ns for _f, kind, blocks, ns in self.sessions[sid].events if kind == "commit"
                for b in blocks}

    def best_hit_blocks(self, ns: tuple, prompt: list[int], sid: str) -> int:
        """Upper bound of a correct hit: leading blocks some block hittable by the session
        holds exactly."""
        by_content: set[tuple] = set()
        for b, bns in (self.hittable | self.pending_hittable(sid)).items():
            if bns == ns:
                by_content.add(tuple(self.sim.get(b * self.B + o) for o in range(self.B)))
        n = 0
        for i in range((len(prompt) - 1) // self.B):
            want = tuple((ns, tuple(prompt[: p + 1])) for p in range(i * self.B, (i + 1) * self.B))
            if want not in by_content:
                break
            n += 1
        return n

    def do_commit(self, seq_id: str, fence: int) -> None:
        """Commit with a valid fence, in the manager and the model."""
        m = self.m
        assert m is not None
        rs = self.seqs[seq_id]
        sess = self.sessions[rs.session]
        n = m.commit(rs.session, seq_id, fence=fence)
        eff = self.effective(sess, fence)
        full = len(rs.tokens) // self.B
        blocks = rs.table[rs.num_committed:full]
        assert n == len(blocks)
        if blocks:
            self.seen.add("commit")
            rs.num_committed = full
            self.committed.update(blocks)
            if rs.cache:
                self.model_commit(sess, blocks, rs.ns, eff)

    def do_complete(self, sid: str, value: int) -> None:
        m = self.m
        assert m is not None
        m.complete_fence(sid, value)
        self.model_complete(self.sessions[sid], value)

    # -- rules --------------------------------------------------------------------------------

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        sid = data.draw(st.sampled_from(sorted(self.sessions)), label="session")
        if len(self.seqs) >= MAX_LIVE:
            return
        t = self.session_tenant[sid]
        scope = SCOPES[data.draw(SCOPE_CHOICE, label="scope")]
        prompt = self.draw_prompt(data)
        cache = data.draw(st.sampled_from([True, True, True, True, False]), label="cache")
        ns = self.ns_of(t, scope)
        looked = m.lookup(sid, scope, prompt)
        before = self.snapshot()
        res = m.admit(sid, scope, prompt, cache=cache)
        scrubbed = m.take_scrubbed()
        if isinstance(res, DoesNotFit):
            self.seen.add(f"admit does not fit ({res.reason})")
            assert self.snapshot() == before, "a DoesNotFit admit changed the manager"
            assert scrubbed == []
            assert res.reason in ("quota", "pool", "guarantee")
            assert res.available < res.needed
            return
        assert isinstance(res, AdmitResult)
        B = self.B
        L = len(prompt)
        assert res.num_tokens == L
        assert len(res.block_table) == -(-L // B)
        assert res.num_cached_tokens % B == 0 and 0 <= res.num_cached_tokens < L
        if not cache:
            assert res.num_cached_tokens == 0
        else:
            assert res.num_cached_tokens == looked, "lookup and admit disagree"
        h = res.num_cached_tokens // B
        self.seen.add("admit hit" if h else "admit miss")
        hits, new = res.block_table[:h], res.block_table[h:]
        own_pending = self.pending_hittable(sid)
        for i, b in enumerate(hits):
            if b not in self.hittable:
                self.seen.add("admit hit on the session's own pending commit")
            assert self.hittable.get(b) == ns or own_pending.get(b) == ns, (
                f"hit block {b} is neither a completed commit nor this session's pending one "
                f"in namespace {ns} (model: {self.hittable.get(b)}, {own_pending.get(b)})")
            for p in range(i * B, (i + 1) * B):
                got = self.sim.get(b * B + p % B)
                assert got == (ns, tuple(prompt[: p + 1])), (
                    f"foreign KV: hit block {b} position {p} holds {got}")
        assert not set(hits) & set(new)
        self.check_new_blocks(new, t, scrubbed)
        rs = RSeq(sid, t, ns, list(prompt), res.block_table.copy(), h, cache, res.seq_id)
        self.history.append(list(prompt))
        self.seqs[res.seq_id] = rs
        self.write(rs, res.num_cached_tokens)
        # What an engine does next: prefill, then commit the full blocks (and maybe report).
        then = data.draw(st.sampled_from(["nothing", "commit", "commit", "commit+complete"]),
                         label="after admit")
        if then != "nothing":
            self.matches_reference()
            self.do_commit(res.seq_id, 0)
            if then == "commit+complete":
                self.matches_reference()
                self.do_complete(sid, self.sessions[sid].issued)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        seq_id, rs = self.pick_seq(data)
        sess = self.sessions[rs.session]
        B = self.B
        toks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2 * B), label="tokens")
        fence, valid = self.choose_fence(data, sess)
        before = self.snapshot()
        if not valid:
            with pytest.raises(InvalidArgument) as exc:
                m.append(rs.session, seq_id, toks, fence=fence)
            assert exc.value.field == "fence"
            assert self.snapshot() == before
            return
        sharers = self.sharers(seq_id)
        res = m.append(rs.session, seq_id, toks, fence=fence)
        scrubbed = m.take_scrubbed()
        if isinstance(res, DoesNotFit):
            self.seen.add(f"append does not fit ({res.reason})")
            assert self.snapshot() == before, "a DoesNotFit append changed the manager"
            assert scrubbed == []
            assert res.available < res.needed
            return
        assert isinstance(res, AppendResult)
        eff = self.effective(sess, fence)
        self.apply_append(seq_id, toks, sharers, res, eff, scrubbed)
        assert set(scrubbed) <= set(res.block_ids), f"scrubbed {scrubbed}, new {res.block_ids}"

    def apply_append(self, seq_id: str, toks: list[int], sharers: int, res: AppendResult,
                     eff: int, scrubbed: list[int]) -> None:
        """Check a successful append against the model, then simulate the worker."""
        rs = self.seqs[seq_id]
        B = self.B
        old_len = len(rs.tokens)
        old_table = rs.table
        new_len = old_len + len(toks)
        assert res.num_tokens == new_len
        new_table = old_table[: res.start_index] + res.block_ids
        assert len(new_table) == -(-new_len // B)
        if res.copy is not None:
            self.seen.add("append copy-on-write")
            assert old_len % B != 0, "copy op for a full last block"
            assert res.copy.src == old_table[-1]
            assert sharers >= 2, f"copy-on-write of block {res.copy.src} that was not shared"
            assert res.start_index == len(old_table) - 1
            assert res.block_ids[0] == res.copy.dst
        else:
            assert res.start_index == len(old_table)
            if old_len % B != 0:
                assert sharers == 1, (
                    f"in-place write into partial block {old_table[-1]} shared by {sharers}")
        self.check_new_blocks(res.block_ids, rs.tenant, scrubbed)
        if res.copy is not None:
            for o in range(B):
                self.sim[res.copy.dst * B + o] = self.sim.get(res.copy.src * B + o)
            self.model_release(self.sessions[rs.session], [res.copy.src], eff)
        rs.table = new_table
        rs.tokens += toks
        self.write(rs, old_len)

    def sharers(self, seq_id: str) -> int:
        last = self.seqs[seq_id].table[-1]
        return sum(1 for o in self.seqs.values() if last in o.table)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append_batch(self, data: st.DataObject) -> None:
        """A decode step: many sequences of one session, one token each or counts per entry."""
        m = self.m
        assert m is not None
        sid = data.draw(st.sampled_from(sorted({rs.session for rs in self.seqs.values()})),
                        label="session")
        sess = self.sessions[sid]
        mine = [q for q, rs in self.seqs.items() if rs.session == sid]
        others = [q for q, rs in self.seqs.items() if rs.session != sid]
        pool = mine + mine + others[:1] + ["no-such-sequence"]
        ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6), label="ids")
        one_each = data.draw(st.booleans(), label="one token each")
        if one_each:
            counts = [1] * len(ids)
        else:
            counts = data.draw(st.lists(st.integers(0, 2 * self.B), min_size=len(ids),
                                        max_size=len(ids)), label="counts")
        toks = [data.draw(st.lists(st.integers(0, 3), min_size=c, max_size=c), label="tokens")
                for c in counts]
        raw = array("I", [t for ts in toks for t in ts]).tobytes()
        fence, valid = self.choose_fence(data, sess)
        before = self.snapshot()
        if not valid:
            with pytest.raises(InvalidArgument) as exc:
                m.append_batch(sid, ids, raw, None if one_each else counts, fence=fence)
            assert exc.value.field == "fence"
            assert self.snapshot() == before
            return
        if not one_each and data.draw(st.integers(0, 9), label="bad batch") == 0:
            with pytest.raises(InvalidArgument) as exc:
                m.append_batch(sid, ids, raw, counts + [1], fence=fence)
            assert exc.value.field == "num_tokens"
            with pytest.raises(InvalidArgument) as exc:
                m.append_batch(sid, ids, raw + b"\0\0\0\0", counts, fence=fence)
            assert exc.value.field == "token_ids"
            assert self.snapshot() == before
            return
        # The model runs the entries in order; each needs its sharer count before it applies.
        out = m.append_batch(sid, ids, raw, None if one_each else counts, fence=fence)
        scrubbed = m.take_scrubbed()
        errors = dict(out.errors)
        deltas = dict(out.deltas)
        assert len(errors) == len(out.errors) and len(deltas) == len(out.deltas)
        assert not set(errors) & set(deltas)
        assert len(out.num_tokens) == len(ids)
        eff = fence if fence else sess.issued
        all_new: list[int] = []
        ok = 0
        for i, q in enumerate(ids):
            if q not in self.seqs:
                assert isinstance(errors.get(i), NotFound), (i, errors.get(i))
                continue
            if self.seqs[q].session != sid:
                assert isinstance(errors.get(i), PermissionDenied), (i, errors.get(i))
                continue
            rs = self.seqs[q]
            if i in errors:
                err = errors[i]
                assert isinstance(err, DoesNotFit), (i, err)
                self.seen.add(f"batch entry does not fit ({err.reason})")
                assert out.num_tokens[i] == 0
                continue
            ok += 1
            old_len = len(rs.tokens)
            assert out.num_tokens[i] == old_len + counts[i]
            res = deltas.get(i)
            if res is None:
                # Written in place: the last block had room and was not shared.
                if counts[i]:
                    self.seen.add("batch in-place")
                    assert old_len % self.B and self.sharers(q) == 1
                    assert old_len // self.B == (old_len + counts[i] - 1) // self.B
                    rs.tokens += toks[i]
                    self.write(rs, old_len)
                continue
            self.seen.add("batch delta")
            self.apply_append(q, toks[i], self.sharers(q), res, eff, scrubbed)
            all_new += res.block_ids
        assert set(scrubbed) <= set(all_new)
        if ok and fence:
            self.effective(sess, fence)

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        seq_id, rs = self.pick_seq(data)
        k = data.draw(st.integers(1, 3), label="children")
        children = m.fork(rs.session, seq_id, k)
        assert len(children) == k and len(set(children)) == k
        for c in children:
            assert c not in self.seqs
            self.seqs[c] = RSeq(rs.session, rs.tenant, rs.ns, rs.tokens.copy(), rs.table.copy(),
                                rs.num_committed, rs.cache, rs.family)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        seq_id, rs = self.pick_seq(data)
        sess = self.sessions[rs.session]
        fence, valid = self.choose_fence(data, sess)
        if not valid:
            before = self.snapshot()
            with pytest.raises(InvalidArgument) as exc:
                m.release(rs.session, seq_id, fence=fence)
            assert exc.value.field == "fence"
            assert self.snapshot() == before
            return
        n = m.release(rs.session, seq_id, fence=fence)
        assert n == len(rs.table)
        eff = self.effective(sess, fence)
        del self.seqs[seq_id]
        self.history.append(rs.tokens.copy())
        self.model_release(sess, rs.table, eff)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        seq_id, rs = self.pick_seq(data)
        sess = self.sessions[rs.session]
        fence, valid = self.choose_fence(data, sess)
        if not valid:
            before = self.snapshot()
            with pytest.raises(InvalidArgument) as exc:
                m.commit(rs.session, seq_id, fence=fence)
            assert exc.value.field == "fence"
            assert self.snapshot() == before
            return
        self.do_commit(seq_id, fence)
        if data.draw(st.booleans(), label="worker catches up"):
            self.matches_reference()
            self.do_complete(rs.session, sess.issued)

    @rule(data=st.data())
    def complete_fence(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        sid = data.draw(st.sampled_from(sorted(self.sessions)), label="session")
        sess = self.sessions[sid]
        if data.draw(st.integers(0, 9), label="invalid completion") == 0:
            bad = data.draw(st.sampled_from([-1, sess.issued + 1]),
                            label="bad completion")
            before = self.snapshot()
            with pytest.raises(InvalidArgument) as exc:
                m.complete_fence(sid, bad)
            assert exc.value.field == "completed_fence"
            assert self.snapshot() == before
            return
        if data.draw(st.booleans(), label="complete all"):
            value = sess.issued
        else:
            value = data.draw(st.integers(0, sess.issued), label="completed")
        self.do_complete(sid, value)

    @rule(data=st.data())
    def begin_step(self, data: st.DataObject) -> None:
        """A Step's header: the worker's progress, then the step's fence (validated together)."""
        m = self.m
        assert m is not None
        sid = data.draw(st.sampled_from(sorted(self.sessions)), label="session")
        sess = self.sessions[sid]
        completed = data.draw(st.integers(0, sess.issued), label="completed")
        kind = data.draw(st.sampled_from(["zero", "next", "next", "bad fence", "bad completion"]),
                         label="step fence")
        done = max(sess.completed, completed)
        if kind == "bad completion":
            completed = sess.issued + 1
            fence, field_ = sess.issued + 2, "completed_fence"
        elif kind == "bad fence":
            fence = data.draw(st.sampled_from([-1] + list(range(1, max(done, sess.issued - 1)
                                                                + 1))), label="fence")
            field_ = "fence"
        else:
            fence, field_ = (sess.issued + 1 if kind == "next" else 0), ""
        if field_:
            before = self.snapshot()
            with pytest.raises(InvalidArgument) as exc:
                m.begin_step(sid, fence, completed)
            assert exc.value.field == field_
            assert self.snapshot() == before
            return
        m.begin_step(sid, fence, completed)
        self.model_complete(sess, completed)
        self.effective(sess, fence)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        sid = data.draw(st.sampled_from(sorted(self.sessions)), label="session")
        scope = SCOPES[data.draw(SCOPE_CHOICE, label="scope")]
        prompt = self.draw_prompt(data)
        before = self.snapshot()
        n = m.lookup(sid, scope, prompt)
        assert self.snapshot() == before, "lookup changed the manager"
        assert n % self.B == 0 and 0 <= n < len(prompt)
        bound = self.best_hit_blocks(self.ns_of(self.session_tenant[sid], scope), prompt, sid)
        assert n // self.B <= bound, f"lookup reports {n} tokens, only {bound} blocks are valid"

    @rule(data=st.data())
    def flush(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        model_id = data.draw(st.sampled_from([None, "m1", "m2"]), label="flush model")
        lora = data.draw(st.sampled_from([None, None, "l1"]), label="flush lora")
        tenant = data.draw(st.sampled_from([None] + list(range(len(self.policies)))),
                           label="flush tenant")
        if model_id is None and lora is None and tenant is None:
            before = self.snapshot()
            with pytest.raises(InvalidArgument):
                m.flush()
            assert self.snapshot() == before
            return
        n = m.flush(model_id=model_id, lora_id=lora,
                    tenant_id=None if tenant is None else f"t{tenant}")
        victims = [
            b for b, ns in self.hittable.items()
            if (model_id is None or ns[0] == model_id) and (lora is None or ns[2] == lora)
            and (tenant is None or self.owner.get(b) == tenant)
        ]
        assert n <= len(victims)
        for b in victims:
            del self.hittable[b]

    @rule(data=st.data())
    def close_and_reopen(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        sid = data.draw(st.sampled_from(sorted(self.sessions)), label="session")
        sess = self.sessions[sid]
        mine = [q for q, rs in self.seqs.items() if rs.session == sid]
        assert m.close_session(sid) == len(mine)
        for q in mine:
            self.model_release(sess, self.seqs.pop(q).table, sess.issued)
        # Every fence completes; commits the worker never reported are dropped.
        for _f, kind, _blocks, _ns in sess.events:
            assert kind in ("release", "commit")
        sess.events.clear()
        with pytest.raises(NotFound):
            m.lookup(sid, SCOPES[0], [1])
        m.open_session(f"t{sess.tenant}", sid)
        self.sessions[sid] = RSession(sess.tenant)

    @rule()
    def restart_from_snapshot(self) -> None:
        """Crash recovery's core: the manager is replaced by one restored from a snapshot.

        The restored manager must equal the original in every field (``snapshot.canonical``,
        counters included) and then behave exactly like it under every later rule: the model
        checks that.
        """
        m = self.m
        assert m is not None
        data = snapshot.dump(m)  # may turn caching off for a sequence, in m too
        custom = m.index._new_hasher if self.hasher != "xxh3" else None
        restored = snapshot.load(data, hasher_factory=custom, ids=m.ids)
        assert snapshot.canonical(restored) == snapshot.canonical(m), (
            "a restored manager differs from the original")
        self.m = restored
        for seq_id, seq in restored.sequences.items():
            if self.seqs[seq_id].cache and not seq.cache:
                # Its committed token ids were nowhere (flushed prefix): it stops caching.
                self.seen.add("snapshot uncached a sequence")
                self.seqs[seq_id].cache = False
        self.seen.add("restart from snapshot")

    @precondition(lambda self: self.seqs and len(self.sessions) > 1)
    @rule(data=st.data())
    def wrong_session(self, data: st.DataObject) -> None:
        m = self.m
        assert m is not None
        seq_id, rs = self.pick_seq(data)
        other = data.draw(st.sampled_from(sorted(s for s in self.sessions if s != rs.session)),
                          label="other session")
        before = self.snapshot()
        with pytest.raises(PermissionDenied):
            m.release(other, seq_id)
        with pytest.raises(NotFound):
            m.append(rs.session, seq_id + "x", [1])
        assert self.snapshot() == before

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def matches_reference(self) -> None:
        m = self.m
        if m is None:
            return
        self.steps += 1
        m.check_invariants()
        B = self.B
        assert set(m.sessions) == set(self.sessions)
        for sid, rs in self.sessions.items():
            s = m.sessions[sid]
            assert s.completed == rs.completed
            assert s.issued == rs.issued, f"{sid}: issued {s.issued}, model {rs.issued}"
        assert set(m.sequences) == set(self.seqs)
        for seq_id, rs in self.seqs.items():
            table, n = m.block_table(rs.session, seq_id)
            assert table == rs.table, f"{seq_id}: table {table} but model {rs.table}"
            assert n == len(rs.tokens)
            assert len(table) == -(-n // B)
            # The sequence's namespace is interned (its id cannot be recycled meanwhile).
            ns_obj = m.sequences[seq_id].ns
            assert m.namespaces.get(ns_obj.id) is ns_obj, f"{seq_id}: namespace not interned"
            fields = ns_obj.fields
            assert (fields.model_id, fields.model_revision, fields.lora_id,
                    fields.tokenizer_digest, fields.sharing_domain, fields.salt) == rs.ns
            for p in range(n):
                got = self.sim.get(self.slot(table, p))
                assert got == self.expected(rs, p), (
                    f"{seq_id} position {p} (block {table[p // B]}) holds {got}")
        users = self.live_users()
        for b, us in users.items():
            assert len({i for _q, i in us}) == 1, f"block {b} at different logical indexes {us}"
            if len({self.seqs[q].family for q, _i in us}) > 1:
                for q, i in us:
                    rs = self.seqs[q]
                    assert (i + 1) * B <= len(rs.tokens) and b in self.committed, (
                        f"block {b} shared across unrelated sequences but not a committed "
                        f"full block of {q}")
        covered = self.covered()
        for b in range(self.N):
            state = m.block_state(b)
            if b in users:
                assert state in ("writing", "committed"), f"block {b} in use but {state}"
            else:
                assert state in ("free", "pending", "cached"), f"unused block {b} is {state}"
                if b in covered:
                    assert state == "pending", f"block {b} under a release fence is {state}"
        for slot, policy in enumerate(self.policies):
            assert m.blocks.usage[slot] <= policy.quota_blocks
        # Everything in the index is a completed commit whose stored tokens are what the worker
        # wrote, in the namespace the model expects.
        for b in m.index.map.values():
            assert b in self.hittable, f"indexed block {b} is not a completed, unflushed commit"
            fields = m.namespaces.get(m.index.ns[b]).fields
            ns = (fields.model_id, fields.model_revision, fields.lora_id,
                  fields.tokenizer_digest, fields.sharing_domain, fields.salt)
            assert ns == self.hittable[b]
            contents = [self.sim.get(b * B + o) for o in range(B)]
            assert all(c is not None and c[0] == ns for c in contents)
            assert m.index.tokens[b] == array("I", [c[1][-1] for c in contents]).tobytes()


TestBlockManagerStateMachine = BlockManagerMachine.TestCase
TestBlockManagerStateMachine.settings = settings(stateful_step_count=50, report_multiple_bugs=False)


def test_append_that_does_not_fit_does_not_announce_its_fence() -> None:
    """All-or-nothing: an append that does not fit must not announce its fence either.

    Regression: ``append`` used to record the fence before the fit check, so a DoesNotFit
    append with fence 5 raised ``session.issued`` to 5 and a later fence-0 release waited for a
    fence that no successful step named.
    """
    m = BlockManager(PoolSpec(block_size=2, num_blocks=2), [TenantPolicy("t", 2)], seed=1)
    sid = m.open_session("t", "s")
    res = m.admit(sid, SCOPES[0], [1, 2, 3, 4])
    assert isinstance(res, AdmitResult)
    before = m.sessions[sid].issued
    out = m.append(sid, res.seq_id, [5], fence=5)
    assert isinstance(out, DoesNotFit)
    assert m.sessions[sid].issued == before, "a failed append announced its fence"


def test_admit_that_evicts_its_own_namespace_keeps_it_alive() -> None:
    """An admit whose eviction drops the last indexed block of its own namespace.

    Ops (B=1, one block, quota 1): admit [1], commit, release (the block is cached and is the
    namespace's only reference); admit [2] in the same scope evicts it, which drops the namespace
    from the table while the new sequence still uses it. Expected: the namespace stays interned
    and commit/release work. Regression: the commit used to raise KeyError in
    ``namespaces.get`` (and the freed id could be recycled for another tenant's namespace).
    """
    m = BlockManager(PoolSpec(block_size=1, num_blocks=1), [TenantPolicy("t", 1)], seed=1)
    sid = m.open_session("t", "s")
    first = m.admit(sid, SCOPES[0], [1])
    assert isinstance(first, AdmitResult)
    m.commit(sid, first.seq_id)
    m.release(sid, first.seq_id)
    second = m.admit(sid, SCOPES[0], [2])
    assert isinstance(second, AdmitResult)
    assert len(m.namespaces) == 1, "the live sequence's namespace was dropped"
    m.commit(sid, second.seq_id)
    m.release(sid, second.seq_id)
    m.check_invariants()


def test_fork_during_a_pending_commit_keeps_identical_prefixes_hittable() -> None:
    """Cache efficiency (not safety): a fork taken while the parent's commit waits for its fence
    keeps the parent's *own* block as the chain parent, although the commit, once applied, found
    an identical block already indexed and re-chained the parent (only) to it. The child's later
    commit then indexes its next block under the prefix's key with an unindexed parent: every
    lookup rejects it, and the key stays taken, so nobody can index a usable block there.

    Ops (B=2): A admits [1, 2]; S admits [1, 2, 9] and commits (block o indexed for [1, 2]);
    A commits with fence 1; fork A -> C; complete fence 1; C appends [3, 4] and commits.
    Expected: lookup([1, 2, 3, 4, 5]) == 4. Regression: it used to stay 2, even after A also
    committed [3, 4].
    """
    m = BlockManager(PoolSpec(block_size=2, num_blocks=16), [TenantPolicy("t", 16)], seed=1)
    sid = m.open_session("t", "s")
    a = m.admit(sid, SCOPES[0], [1, 2])
    s = m.admit(sid, SCOPES[0], [1, 2, 9])
    assert isinstance(a, AdmitResult) and isinstance(s, AdmitResult)
    m.commit(sid, s.seq_id)
    m.commit(sid, a.seq_id, fence=1)
    (child,) = m.fork(sid, a.seq_id)
    m.complete_fence(sid, 1)
    assert isinstance(m.append(sid, child, [3, 4]), AppendResult)
    m.commit(sid, child)
    m.check_invariants()
    assert m.lookup(sid, SCOPES[0], [1, 2, 3, 4, 5]) == 4


def test_duplicate_block_indexed_after_its_twin_was_flushed() -> None:
    """A block recorded as the duplicate of an indexed twin must stop being one once it is
    indexed itself (found by the state machine under the fuzz profile).

    Ops (B=1): X and Y admit [1, 2] (no hits yet); fork Y -> Z; commit X (its blocks are
    indexed); commit Z (the shared blocks find their keys taken by X's: recorded as duplicates);
    flush(model_id) (X's blocks leave the index; X still holds them); commit Y (Y never committed
    itself, so it commits the shared blocks again: now they are indexed). Expected:
    ``check_invariants()`` passes. Today: AssertionError "stale duplicate 2" (the duplicate
    record outlives the indexing; an evicted block keeps it after it is freed).
    """
    m = BlockManager(PoolSpec(block_size=1, num_blocks=8), [TenantPolicy("t", 8)], seed=1)
    sid = m.open_session("t", "s")
    x = m.admit(sid, SCOPES[0], [1, 2])
    y = m.admit(sid, SCOPES[0], [1, 2])
    assert isinstance(x, AdmitResult) and isinstance(y, AdmitResult)
    (z,) = m.fork(sid, y.seq_id)
    m.commit(sid, x.seq_id)
    m.commit(sid, z)
    m.check_invariants()
    assert m.flush(model_id=SCOPES[0].model_id) == 2
    m.commit(sid, y.seq_id)
    m.check_invariants()
    for seq in (x.seq_id, y.seq_id, z):
        m.release(sid, seq)
    m.check_invariants()
    assert m.lookup(sid, SCOPES[0], [1, 2, 3]) == 2
