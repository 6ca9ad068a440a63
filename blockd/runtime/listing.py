"""ListSequences in O(page): a sorted index of sequence ids per tenant, kept by the daemon.

The core keeps sequences in one dict, so a page taken from it costs a scan of every live
sequence (``CoreQueries.sequences_of``); an operator paging through a large tenant, or a tenant
calling ListSequences in a loop, would hold the shared event loop for O(sequences) per call.
The daemon sees every sequence as it is minted (an admit's or a fork's result in a Step's
answer), so it keeps their ids here, sorted per tenant, and a page walks only its own ids.

Ids are added when a Step's answer names them and dropped lazily: a listed id is checked
against the core (``sequence_session``, O(1)) and dropped when its sequence is gone (released,
preempted, its session ended). Ids are random and never reused, so a dropped id never comes
back. Each id is walked dead at most once, and the index is compacted whenever it holds more
than twice the live sequences (plus ``SLACK``), so its size stays bounded by the live
sequences and a page costs O(page) amortized.

A tenant's ids live in buckets keyed by the first ``PREFIX`` characters (a truncated prefix
keeps the order of strings), each a small sorted list, with the sorted list of bucket keys
beside them: an insertion moves a bucket's few entries, never the whole tenant's.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from blockd.api.v1 import blockd_pb2 as pb
from blockd.core.errors import InvalidArgument
from blockd.runtime import convert
from blockd.runtime.budgets import WorkBudgets, charge_key
from blockd.runtime.step import StepLimits
from blockd.runtime.tenants_file import Principal

#: ListSequences: sequences per page by default, and at most.
DEFAULT_LIST_PAGE = 1000
MAX_LIST_PAGE = 10_000
PREFIX = 2
#: Dead ids the index may hold beyond the live sequences before it is compacted.
SLACK = 4096
#: Work units of one listed sequence (its liveness check, table length and summary: ~1 us).
LIST_ENTRY_UNITS = 12
#: Work units of a ListSequences call before its entries.
LIST_CALL_UNITS = 256


class SortedIds:
    """A sorted set of strings in prefix buckets: add, discard, iterate after a key."""

    __slots__ = ("_buckets", "_keys", "_n")

    def __init__(self) -> None:
        self._buckets: dict[str, list[str]] = {}
        self._keys: list[str] = []
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, x: str) -> None:
        k = x[:PREFIX]
        b = self._buckets.get(k)
        if b is None:
            self._buckets[k] = [x]
            insort(self._keys, k)
        else:
            i = bisect_left(b, x)
            if i < len(b) and b[i] == x:
                return
            b.insert(i, x)
        self._n += 1

    def discard(self, x: str) -> None:
        k = x[:PREFIX]
        b = self._buckets.get(k)
        if b is None:
            return
        i = bisect_left(b, x)
        if i < len(b) and b[i] == x:
            del b[i]
            self._n -= 1
            if not b:
                del self._buckets[k]
                del self._keys[bisect_left(self._keys, k)]

    def after(self, key: str) -> Iterator[str]:
        """The ids sorting after ``key``, in order (do not add while iterating; discarding
        the id just yielded is allowed)."""
        keys = self._keys
        k = key[:PREFIX]
        i = bisect_left(keys, k)
        while i < len(keys):
            kk = keys[i]
            b = self._buckets[kk]
            j = bisect_right(b, key) if kk == k else 0
            while j < len(b):
                x = b[j]
                yield x
                if j < len(b) and b[j] == x:
                    j += 1  # not discarded meanwhile
                if kk not in self._buckets:
                    break
            if i < len(keys) and keys[i] == kk:
                i += 1

    def keep(self, alive: Callable[[str], bool]) -> None:
        """Drop every id ``alive`` refuses (a compaction: O(size))."""
        for k in list(self._keys):
            b = [x for x in self._buckets[k] if alive(x)]
            self._n -= len(self._buckets[k]) - len(b)
            if b:
                self._buckets[k] = b
            else:
                del self._buckets[k]
                del self._keys[bisect_left(self._keys, k)]


class SequenceIndex:
    """Every live sequence's id by tenant, sorted; ``answer`` is ListSequences."""

    def __init__(self, manager: Any, sessions: Any, budgets: WorkBudgets, limits: StepLimits,
                 block_size: int) -> None:
        #: The daemon's ``PartitionCoordinator`` (its public query API only) and ``Sessions``.
        self.m = manager
        self.sessions = sessions
        self.budgets = budgets
        self.limits = limits
        self.block_size = block_size
        self._by_tenant: dict[str, SortedIds] = {}
        self._size = 0

    def answer(self, principal: Principal, req: pb.ListSequencesRequest, *, epoch: int
               ) -> pb.ListSequencesResponse:
        """One page of the live sequences of the caller's tenants (every tenant for an
        admin), in sequence-id order; the page token is the last id of the previous page.
        Priced by its page size (``LIST_ENTRY_UNITS`` each; a page is cut to what
        ``server.max_work_per_call`` allows) and charged to the tenant it names (else the caller's
        first tenant, else the credential's own budget) before it is taken."""
        convert.check_id(req.tenant_id, "tenant_id", required=False)
        convert.check_id(req.page_token, "page_token", required=False)
        if req.page_size > MAX_LIST_PAGE:
            raise InvalidArgument(f"page_size is at most {MAX_LIST_PAGE}", field="page_size")
        m = self.m
        configured = sorted(m.tenant_policies())
        if req.tenant_id:
            if not principal.admin:
                principal.require_tenant(req.tenant_id)
            m.tenant_policy(req.tenant_id)  # NOT_FOUND on tenant_id for an unknown tenant
            scope = [req.tenant_id]
        else:
            scope = configured if principal.admin else \
                [t for t in configured if t in principal.tenants]
        # A page holds what server.max_work_per_call lets one call do ("at most page_size":
        # a shorter page with a next_page_token is a page).
        fits = (self.limits.max_work_per_call - LIST_CALL_UNITS) // LIST_ENTRY_UNITS
        size = max(1, min(req.page_size or DEFAULT_LIST_PAGE, fits))
        units = LIST_CALL_UNITS + LIST_ENTRY_UNITS * size
        self.budgets.charge(charge_key(principal, req.tenant_id or (scope or [""])[0]), units)
        # An admin's whole listing includes sequences of tenants a reload removed.
        every = principal.admin and not req.tenant_id
        page = self.page(None if every else scope, req.page_token, size + 1)
        resp = pb.ListSequencesResponse(epoch=epoch, block_size=self.block_size,
                                        tenant_ids=scope, admin=principal.admin)
        for seq_id, session_id, tenant_id, n, blocks in page[:size]:
            info = self.sessions.find(session_id)
            resp.sequences.add(sequence_id=seq_id, session_id=session_id, tenant_id=tenant_id,
                               worker_name=info.worker_name if info else "", num_tokens=n,
                               num_blocks=blocks)
        if len(page) > size:
            resp.next_page_token = page[size - 1][0]
        return resp

    def rebuild(self) -> None:
        """Index every live sequence (once at start, after a recovery: O(n log n))."""
        self._by_tenant.clear()
        self._size = 0
        for s in self.m.sequences_of(None, limit=max(1, self.m.num_sequences)):
            self._add(s.tenant_id, s.seq_id)

    def stepped(self, tenant_id: str, resp: pb.StepResponse) -> None:
        """Index the sequences a Step's answer names as new (admits, fork children)."""
        for r in resp.results:
            kind = r.WhichOneof("result")
            if kind == "admit" and r.admit.sequence_id:
                self._add(tenant_id, r.admit.sequence_id)
            elif kind == "fork":
                for child in r.fork.child_sequence_ids:
                    self._add(tenant_id, child)
        if self._size > 2 * self.m.num_sequences + SLACK:
            self.compact()

    def _add(self, tenant_id: str, seq_id: str) -> None:
        ids = self._by_tenant.get(tenant_id)
        if ids is None:
            ids = self._by_tenant[tenant_id] = SortedIds()
        before = len(ids)
        ids.add(seq_id)
        self._size += len(ids) - before

    def compact(self) -> None:
        """Drop every dead id (O(index), amortized over the admits that made it grow)."""
        alive = self._alive
        for t in list(self._by_tenant):
            ids = self._by_tenant[t]
            ids.keep(alive)
            if not ids:
                del self._by_tenant[t]
        self._size = sum(len(ids) for ids in self._by_tenant.values())

    def _alive(self, seq_id: str) -> bool:
        return self.m.sequence_session(seq_id) is not None

    def page(self, tenant_ids: Collection[str] | None, after: str, limit: int
             ) -> list[tuple[str, str, str, int, int]]:
        """Up to ``limit`` live sequences of these tenants (None: every tenant indexed),
        in id order after ``after``: (sequence id, session id, tenant id, tokens, blocks)."""
        scope: Iterable[str] = self._by_tenant if tenant_ids is None else tenant_ids
        streams = [self._live(t, self._by_tenant[t], after)
                   for t in scope if t in self._by_tenant]
        out: list[tuple[str, str, str, int, int]] = []
        for entry in heapq.merge(*streams):
            out.append(entry)
            if len(out) >= limit:
                break
        return out

    def _live(self, tenant_id: str, ids: SortedIds, after: str
              ) -> Iterator[tuple[str, str, str, int, int]]:
        for seq_id in ids.after(after):
            session = self.m.sequence_session(seq_id)
            if session is None:  # gone since it was indexed: dropped for good
                ids.discard(seq_id)
                self._size -= 1
                continue
            table, n = self.m.block_table(session, seq_id)
            yield seq_id, session, tenant_id, n, len(table)
