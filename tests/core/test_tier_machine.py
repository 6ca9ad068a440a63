"""Stateful property test of tiers: whatever tier a hit comes from, it holds its own K/V.

A small pool with a host and a disk tier, a few tenants with different sharing domains, and
prompts drawn from a few shared system prompts plus random suffixes. The simulated worker writes
into each block it computes a digest of (namespace, every token up to the end of that block): a
position's K/V depends on the whole prefix and the model, so a hit that hands out a block
computed for another prefix, namespace or tenant shows as wrong bytes. Rules run requests,
keep some sequences live, corrupt lower slots (a load must then fail its check and be a miss),
flush, and take a snapshot round trip. After every rule: the manager's invariants (lower tiers
included), and every cached block any live sequence was given holds exactly its own K/V.

Weak key hashes (``colliding_hashers``) make keys collide on purpose: only the verification
(tokens, parent serial, namespace) keeps prefixes apart on every tier.
"""

from __future__ import annotations

import hashlib

from colliding_hashers import LenHasher, TailHasher
from helpers import CountingIds
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tier_sim import SimIO

from blockd.core import BlockManager, DoesNotFit, PoolSpec, PrefixScope, Sharing, TenantPolicy
from blockd.core import snapshot as snap
from blockd.core.tiering import TierLimits

SCOPES = [PrefixScope("m1"), PrefixScope("m1", lora_id="l1"), PrefixScope("m2", salt=b"s")]
SHARING = [Sharing.PRIVATE, Sharing.PUBLIC, Sharing.PUBLIC]


def kv(ns: tuple, tokens: list[int]) -> bytes:
    """What a worker writes for the block ending at ``len(tokens)``: depends on all of them."""
    return hashlib.blake2b(repr((ns, tuple(tokens))).encode(), digest_size=16).digest()


class TierMachine(RuleBasedStateMachine):
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.B = B = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
        self.n = n = data.draw(st.integers(3, 8), label="num_blocks")
        host = data.draw(st.integers(0, 6), label="host slots")
        disk = data.draw(st.integers(0, 6), label="disk slots")
        hasher = data.draw(st.sampled_from(["xxh3", "xxh3", "len", "tail"]), label="hasher")
        factory: object = {"len": LenHasher,
                           "tail": type("T", (TailHasher,), {"chunk": 4 * B})}.get(hasher)
        self.policies = []
        for t in range(3):
            sharing = SHARING[t]
            quota = data.draw(st.sampled_from([None, 1, 3]), label=f"host quota t{t}")
            self.policies.append(TenantPolicy(
                f"t{t}", quota_blocks=n, sharing=sharing, priority=t % 2,
                host_quota_bytes=None if quota is None else quota * PoolSpec(
                    block_size=B, num_blocks=1).slot_bytes))
        self.m = BlockManager(PoolSpec(block_size=B, num_blocks=n), self.policies, seed=7,
                              hasher_factory=factory,  # type: ignore[arg-type]
                              tiers=TierLimits(host_slots=host, disk_slots=disk,
                                               max_spill_blocks=data.draw(
                                                   st.sampled_from([1, 3, 64]), label="spills"),
                                               max_load_blocks=data.draw(
                                                   st.sampled_from([1, 64]), label="loads")))
        self.m.set_ids(CountingIds())
        self.io = SimIO()
        self.m.set_tier_io(self.io)
        self.sessions = [self.m.open_session(f"t{t}") for t in range(3)]
        self.fence = [0, 0, 0]
        self.system = [list(range(10, 10 + 3 * B)), list(range(10, 10 + B)) + [99] * B,
                       list(range(50, 50 + 2 * B))]
        #: Live sequences: id -> (tenant, namespace key, tokens, table, cached tokens).
        self.live: dict[str, tuple[int, tuple, list[int], list[int], int]] = {}
        self.history: list[tuple[int, int, list[int]]] = []
        event(f"hasher={hasher} host={host} disk={disk}")
        # Every run starts with traffic, so that even a short one evicts and revisits.
        self.requests(data, data.draw(st.integers(4, 16), label="first requests"))

    def ns_key(self, t: int, scope: PrefixScope) -> tuple:
        domain = self.policies[t].sharing_domain
        return (scope.model_id, scope.lora_id, scope.salt, domain)

    @rule(data=st.data(), n=st.integers(1, 8))
    def requests(self, data: st.DataObject, n: int) -> None:
        """A few requests in a row (so that even a short run evicts and revisits)."""
        for _ in range(n):
            self.request(data)
            self.m.check_invariants()

    def request(self, data: st.DataObject) -> None:
        if self.history and data.draw(st.booleans(), label="an earlier request again"):
            # Revisited after other requests evicted it (mostly by the same tenant, in the
            # same namespace): where tier hits come from.
            t, k, base = data.draw(st.sampled_from(self.history), label="earlier")
            if data.draw(st.integers(0, 3), label="another tenant") == 0:
                t = data.draw(st.integers(0, 2), label="tenant")
        else:
            t = data.draw(st.integers(0, 2), label="tenant")
            k = data.draw(st.sampled_from([0, 0, 0, 1, 2]), label="scope")
            base = self.system[data.draw(st.integers(0, 2), label="system prompt")]
        scope = SCOPES[k]
        base = base[:(self.n - 2) * self.B]  # a prompt the pool can hold beside another
        prompt = base + data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=2 * self.B),
                                  label="suffix")
        self.history = (self.history + [(t, k, prompt)])[-6:]
        sid = self.sessions[t]
        self.fence[t] += 1
        f = self.fence[t]
        m = self.m
        m.begin_step(sid, f)
        loaded = sum(m.counters.tier_loaded_blocks.values())
        res = m.admit(sid, scope, prompt)
        if isinstance(res, DoesNotFit):
            event(f"does not fit: {res.reason}")
            return
        ns = self.ns_key(t, scope)
        B = self.B
        cached = res.num_cached_tokens
        if cached:
            event("hit")
        if sum(m.counters.tier_loaded_blocks.values()) > loaded:
            event("hit loaded from a lower tier")
        for i in range(cached // B):  # every cached block is this prefix's own K/V
            assert self.io.pool.get(res.block_table[i]) == kv(ns, prompt[:(i + 1) * B]), (
                f"block {i} of a hit holds foreign K/V")
        for i in range(cached // B, len(prompt) // B):
            self.io.write(res.block_table[i], kv(ns, prompt[:(i + 1) * B]))
        m.commit(sid, res.seq_id, f)
        m.complete_fence(sid, f)
        self.live[res.seq_id] = (t, ns, prompt, res.block_table, cached)
        for other in self.sessions:  # sequences preempted for this admit are gone
            for seq in m.take_preempted(other):
                event("preempted")
                self.live.pop(seq, None)
        if len(self.live) > 1 or data.draw(st.booleans(), label="release now"):
            self.release_one(data)

    def release_one(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)), label="release")
        t = self.live.pop(seq)[0]
        self.m.release(self.sessions[t], seq)

    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        tier = data.draw(st.sampled_from(["host", "disk"]), label="tier")
        if self.io.slots[tier]:
            slot = data.draw(st.sampled_from(sorted(self.io.slots[tier])), label="slot")
            self.io.corrupt(tier, slot)
            event("corrupted a slot")

    @rule(data=st.data())
    def flush(self, data: st.DataObject) -> None:
        which = data.draw(st.sampled_from(["lora", "tenant"]), label="flush")
        if which == "lora":
            self.m.flush(lora_id="l1")
        else:
            self.m.flush(tenant_id=f"t{data.draw(st.integers(0, 2), label='tenant')}")

    @rule()
    def snapshot_round_trip(self) -> None:
        again = snap.load(snap.dump(self.m), hasher_factory=self.m.index._new_hasher)
        again.set_ids(self.m.ids)  # the same minter: ids go on, never repeat
        again.set_tier_io(self.io)
        assert snap.canonical(again.tiers.lower) == snap.canonical(self.m.tiers.lower)
        self.m = again

    @invariant()
    def holds(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        B = self.B
        for _t, ns, prompt, table, _cached in self.live.values():
            for i in range(len(prompt) // B):
                assert self.io.pool.get(table[i]) == kv(ns, prompt[:(i + 1) * B])


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                   report_multiple_bugs=False)
