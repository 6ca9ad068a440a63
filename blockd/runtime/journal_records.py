"""The journal's record kinds: one frozen dataclass per kind, the one durable format's types.

A record outlives the process that wrote it, so it is a type with a round trip, not a list
unpacked by position where it is read (``tests/server/test_journal_records.py`` round-trips
every kind and pins its encoding). On disk a record is a msgpack list whose first item names
the kind (``blockd.runtime.journal`` frames it)::

    ["attach", session_id, tenant_id, owner, worker_name, lease_ms]
    ["detach", session_id, reason]
    ["fence", session_id, completed_fence]
    ["step", session_id, StepRequest bytes, [minted sequence ids], [[index, status], ...],
     [numbers of the tier copies that failed]]   (the last item since issue 25)
    ["flush", {filter: value}]
    ["revoke", session_id, reason]          (a tenants reload took the session's rights)
    ["tenants", pickled tenant policies]
    ["adopt", tenant_id, [model_id, revision, lora_id, tokenizer digest, salt], token bytes,
     start, count, [numbers of the tier copies that failed]]   (the remote tier's fetches)

``from_record`` refuses (``ValueError``, naming the kind and the item) a list whose kind is
unknown or whose items do not have the kind's types: recovery treats that as a corrupt journal.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from blockd.core.namespace import PrefixScope
from blockd.core.tenants import TenantPolicy

__all__ = [
    "AdoptRecord", "AttachRecord", "DetachRecord", "FenceRecord", "FlushRecord", "Record",
    "RevokeRecord", "StepRecord", "TenantsRecord", "from_record",
]


def _check(kind: str, items: list[Any], types: tuple[type | tuple[type, ...], ...]) -> None:
    if len(items) != len(types):
        raise ValueError(f"journal record {kind!r}: {len(items)} items, expected {len(types)}")
    for i, (item, want) in enumerate(zip(items, types, strict=True)):
        if not isinstance(item, want) or isinstance(item, bool) and want is int:
            raise ValueError(f"journal record {kind!r}: item {i + 1} is a "
                             f"{type(item).__name__}")


@dataclass(frozen=True, slots=True)
class AttachRecord:
    """A session attached (``Sessions.attach``)."""

    kind: ClassVar[str] = "attach"
    session_id: str
    tenant_id: str
    #: The credential's name (who may resume it).
    owner: str
    worker_name: str
    lease_ms: int

    def to_record(self) -> list[Any]:
        return [self.kind, self.session_id, self.tenant_id, self.owner, self.worker_name,
                self.lease_ms]

    @classmethod
    def from_items(cls, items: list[Any]) -> AttachRecord:
        _check(cls.kind, items, (str, str, str, str, int))
        return cls(*items)


@dataclass(frozen=True, slots=True)
class DetachRecord:
    """A session closed: a Detach, an expired lease, a reap (``reason`` says which)."""

    kind: ClassVar[str] = "detach"
    session_id: str
    reason: str

    def to_record(self) -> list[Any]:
        return [self.kind, self.session_id, self.reason]

    @classmethod
    def from_items(cls, items: list[Any]) -> DetachRecord:
        _check(cls.kind, items, (str, str))
        return cls(*items)


@dataclass(frozen=True, slots=True)
class FenceRecord:
    """A session's fence completed (a Heartbeat, a Step's ``completed_fence`` or its page)."""

    kind: ClassVar[str] = "fence"
    session_id: str
    completed_fence: int

    def to_record(self) -> list[Any]:
        return [self.kind, self.session_id, self.completed_fence]

    @classmethod
    def from_items(cls, items: list[Any]) -> FenceRecord:
        _check(cls.kind, items, (str, int))
        return cls(*items)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What a Step applied (``blockd.runtime.step.journal_record``): the request without unknown
    fields and with its failed operations emptied, the sequence ids it minted, each failed
    operation's serialized status by index, and the numbers of its tier copies that failed
    (``blockd.core.tier_io.RecordingIO``: a replay answers them the same)."""

    kind: ClassVar[str] = "step"
    session_id: str
    request: bytes
    minted: tuple[str, ...]
    failed: tuple[tuple[int, bytes], ...]
    io_failures: tuple[int, ...] = ()

    def to_record(self) -> list[Any]:
        return [self.kind, self.session_id, self.request, list(self.minted),
                [[i, status] for i, status in self.failed], list(self.io_failures)]

    @classmethod
    def from_items(cls, items: list[Any]) -> StepRecord:
        if len(items) == 4:  # written before tiers: no copy failed
            items = [*items, []]
        _check(cls.kind, items, (str, bytes, list, list, list))
        sid, request, minted, failed, io_failures = items
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in io_failures):
            raise ValueError("journal record 'step': a failed tier copy is not a number")
        if not all(isinstance(x, str) for x in minted):
            raise ValueError("journal record 'step': a minted sequence id is not a string")
        out = []
        for entry in failed:
            if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], int)
                    or not isinstance(entry[1], bytes)):
                raise ValueError("journal record 'step': a failed operation is not "
                                 "[index, status]")
            out.append((entry[0], entry[1]))
        return cls(sid, request, tuple(minted), tuple(out), tuple(io_failures))

    def failed_statuses(self) -> dict[int, bytes]:
        return dict(self.failed)


#: The filters of a flush, in ``KVManager.flush``'s keyword names.
FLUSH_FILTERS = ("model_id", "model_revision", "lora_id", "tenant_id")


@dataclass(frozen=True, slots=True)
class FlushRecord:
    """A FlushNamespace that was applied (None: that filter was not given)."""

    kind: ClassVar[str] = "flush"
    model_id: str | None = None
    model_revision: str | None = None
    lora_id: str | None = None
    tenant_id: str | None = None

    def to_record(self) -> list[Any]:
        return [self.kind, self.filters()]

    def filters(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in FLUSH_FILTERS}

    @classmethod
    def from_items(cls, items: list[Any]) -> FlushRecord:
        _check(cls.kind, items, (dict,))
        filters = items[0]
        if set(filters) - set(FLUSH_FILTERS) or not all(
                v is None or isinstance(v, str) for v in filters.values()):
            raise ValueError(f"journal record 'flush': filters {sorted(filters)}")
        return cls(**filters)


@dataclass(frozen=True, slots=True)
class RevokeRecord:
    """A tenants reload took a session's rights (``Sessions.revoke``)."""

    kind: ClassVar[str] = "revoke"
    session_id: str
    reason: str

    def to_record(self) -> list[Any]:
        return [self.kind, self.session_id, self.reason]

    @classmethod
    def from_items(cls, items: list[Any]) -> RevokeRecord:
        _check(cls.kind, items, (str, str))
        return cls(*items)


@dataclass(frozen=True, slots=True)
class TenantsRecord:
    """A tenants reload that was applied: the new policies (pickled on disk: the journal is
    the daemon's own private file, like its snapshot)."""

    kind: ClassVar[str] = "tenants"
    policies: tuple[TenantPolicy, ...]

    def to_record(self) -> list[Any]:
        return [self.kind, pickle.dumps(list(self.policies))]

    @classmethod
    def from_items(cls, items: list[Any]) -> TenantsRecord:
        _check(cls.kind, items, (bytes,))
        policies = pickle.loads(items[0])  # noqa: S301 (our own private journal)
        if not isinstance(policies, list) or not all(isinstance(p, TenantPolicy)
                                                     for p in policies):
            raise ValueError("journal record 'tenants': not a list of tenant policies")
        return cls(tuple(policies))


@dataclass(frozen=True, slots=True)
class AdoptRecord:
    """Blocks fetched from the remote tier joined a tenant's lower tier
    (``KVManager.adopt_remote``); their bytes are in the tier's store, so a replay only needs
    the decision and which of its slot writes failed."""

    kind: ClassVar[str] = "adopt"
    tenant_id: str
    scope: PrefixScope
    tokens: bytes
    start: int
    count: int
    io_failures: tuple[int, ...] = ()

    def to_record(self) -> list[Any]:
        s = self.scope
        return [self.kind, self.tenant_id,
                [s.model_id, s.model_revision, s.lora_id, s.tokenizer_digest, s.salt],
                self.tokens, self.start, self.count, list(self.io_failures)]

    @classmethod
    def from_items(cls, items: list[Any]) -> AdoptRecord:
        _check(cls.kind, items, (str, list, bytes, int, int, list))
        tenant_id, scope, tokens, start, count, io_failures = items
        if (len(scope) != 5 or not isinstance(scope[0], str)
                or not all(x is None or isinstance(x, str) for x in scope[1:3])
                or not all(x is None or isinstance(x, bytes) for x in scope[3:])):
            raise ValueError("journal record 'adopt': the scope is not "
                             "[model_id, revision, lora_id, tokenizer_digest, salt]")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in io_failures):
            raise ValueError("journal record 'adopt': a failed tier copy is not a number")
        return cls(tenant_id, PrefixScope(*scope), tokens, start, count, tuple(io_failures))


Record = (AdoptRecord | AttachRecord | DetachRecord | FenceRecord | StepRecord | FlushRecord
          | RevokeRecord | TenantsRecord)

_KINDS: dict[str, Callable[[list[Any]], Record]] = {
    cls.kind: cls.from_items
    for cls in (AdoptRecord, AttachRecord, DetachRecord, FenceRecord, StepRecord, FlushRecord,
                RevokeRecord, TenantsRecord)
}


def from_record(raw: Any) -> Record:
    """The typed record of a decoded journal list (``ValueError`` if it is none)."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise ValueError("a journal record is a list whose first item names its kind")
    parse = _KINDS.get(raw[0])
    if parse is None:
        raise ValueError(f"unknown journal record {raw[0]!r}")
    return parse(raw[1:])
