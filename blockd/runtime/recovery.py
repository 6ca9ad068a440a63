"""Crash recovery: the snapshot and journal in ``state.dir``: save, record, replay.

Every change the daemon applies is journalled before it is acknowledged: attaches, detaches and
reaps, fence completions, Steps (the request plus the sequence ids it minted), flushes and
tenant reloads (docs/decisions.md, "Crash recovery"). A restart loads the last snapshot and
replays the journal after it through the same code (``blockd.runtime.step.apply_step``,
``Sessions``), without the side effects that already happened once: no journal is open while
it replays, fence pages are not polled, scrubbed blocks are not zeroed again, and the
per-request limits of this start are not applied. The daemon then carries on with the same
epoch: workers' block ids, sequences and mapped pool stay valid.

Journal records: one typed record per kind (``blockd.runtime.journal_records``).

A Step record is what was applied (``blockd.runtime.step.journal_record``): the request without
unknown fields, its failed operations emptied and their statuses kept. Nothing is applied
before its record can be written: new work (Steps, attaches) is refused with
RESOURCE_EXHAUSTED "state dir full" while the state directory's free space is under
``state.reserve_bytes`` plus the last snapshot's size (the reserve keeps room for the records
that free blocks, and for a snapshot); a write that fails anyway (EFBIG, EIO, a race for the
space) leaves the daemon's memory ahead of its journal, so the daemon stops: every later call
is UNAVAILABLE until it is restarted, and the restart replays exactly what was acknowledged.

A damaged journal (``blockd.runtime.journal.scan``): a torn final record (never acknowledged)
is dropped, logged and counted; a corrupt record raises ``JournalCorrupt``, and
``blockd.runtime.startup.start`` moves the state aside and starts a new epoch, logging what was
lost, rather than carry on with a hole in the acknowledged changes.

A snapshot another layout wrote (another ``SNAPSHOT_VERSION`` or core snapshot format, or one
that cannot be unpickled at all, e.g. it names a module that moved) is not loaded: the daemon
starts a new epoch, which workers detect and re-attach to.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from blockd import logs
from blockd.api.v1 import blockd_pb2 as pb
from blockd.core import snapshot
from blockd.core.contract import KVManager
from blockd.core.coordinator import PartitionCoordinator
from blockd.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from blockd.core.ids import SequenceIds
from blockd.core.spec import PoolSpec
from blockd.core.tiering import TierLimits
from blockd.runtime import step
from blockd.runtime.journal import OVERHEAD, Journal, scan
from blockd.runtime.journal_records import (
    AdoptRecord,
    AttachRecord,
    DetachRecord,
    FenceRecord,
    FlushRecord,
    Record,
    RevokeRecord,
    StepRecord,
    from_record,
)
from blockd.runtime.pool_set import partition_path
from blockd.runtime.sessions import SavedSession, SessionInfo, Sessions
from blockd.runtime.state_store import StateStore

log = logging.getLogger("blockd.recovery")

#: Told before a replayed Step: its session and the numbers of its tier copies that failed.
class TierIOReplay(Protocol):
    """Before a replayed record's tier copies: ``(session_id, failed)`` for a Step (its
    session's partition), ``("", failed, tenant_id=...)`` for an adopt (the tenant's)."""

    def __call__(self, session_id: str, failed: tuple[int, ...], *,
                 tenant_id: str = "") -> None: ...


#: The layout of the snapshot's state dict (and of the journal after it). 2: the runtime/core
#: split of issue 12 (every pickled module path changed); 3: journal headers with a checked
#: length, Step records of what was applied (issue 15); 4: one manager per pool partition
#: (``"partitions"``, name -> core snapshot, and their ``"layout"``; issue 14); 5: the lower
#: tiers (``"tiers"``, name -> their ``TierLimits``; issue 25).
SNAPSHOT_VERSION = 5


#: The least journal room kept above the reserve (``Recovery.margin``): free space within
#: this of the reserve starts a compaction, and a state directory without it is refused.
MIN_MARGIN = 1 << 16


class StateDirTooSmall(FailedPrecondition):
    """``state.dir`` cannot hold the pool, a snapshot, the reserve and journal room: every
    Step would be refused "state dir full" (``Recovery.check_room``)."""


class JournalCorrupt(FailedPrecondition):
    """A journal record changed after it was written: what follows it is lost."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}", field="state.dir")
        self.path = path
        self.what = what


@dataclass(slots=True)
class Saved:
    """What a readable snapshot restores."""

    manager: PartitionCoordinator
    epoch: int
    sessions: list[SavedSession]
    #: Closed revoked sessions -> why (``Sessions.saved_revoked``): their next call, after
    #: any number of restarts, still says why.
    revoked: dict[str, str] = field(default_factory=dict)


class Recovery:
    """The state directory's snapshot and journal; inert without ``state.dir``."""

    def __init__(self, store: StateStore | None, *, snapshot_min_bytes: int,
                 reserve_bytes: int = 0) -> None:
        self.store = store
        self.snapshot_min_bytes = snapshot_min_bytes
        self.reserve_bytes = reserve_bytes
        #: Why the journal can no longer be written (the daemon must restart), or None.
        self.failed: str | None = None
        #: Damaged journals found on load, by kind ("torn", "corrupt"; a metric).
        self.journal_damage: Counter[str] = Counter()
        #: New work refused for want of space in the state directory (a metric).
        self.space_refusals = 0
        #: The journal being written; None until the first snapshot (so during a replay).
        self.journal: Journal | None = None
        self.generation = 0
        self.snapshots = 0
        self.last_snapshot_seconds = 0.0
        self._snapshot_bytes = 0
        #: Bytes of Step records journalled, by the tenant whose Step wrote them (a metric;
        #: the daemon charges them to its work budget too).
        self.tenant_journal_bytes: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        """Whether this daemon journals and snapshots (``state.dir`` on a host pool)."""
        return self.store is not None

    @property
    def journal_bytes(self) -> int:
        """Bytes journalled since the last snapshot."""
        return self.journal.size if self.journal is not None else 0

    # -- loading -------------------------------------------------------------------------------

    def load(self, spec: PoolSpec, layout: dict[str, int], tiers: dict[str, TierLimits], *,
             ids: SequenceIds) -> Saved | None:
        """The last snapshot if this daemon can carry on from it (same pool, partition
        ``layout`` and lower ``tiers``); otherwise None, and the state directory is wiped for a
        clean epoch."""
        store = self.store
        if store is None:
            return None
        try:
            state = store.read_snapshot()
        except Exception as exc:  # unpicklable: another layout's module paths, or damage
            self._new_epoch(f"the snapshot cannot be read ({type(exc).__name__}: {exc})")
            return None
        if state is None:
            store.wipe()
            return None
        problem = _problem(state, spec, layout, tiers, store)
        if problem is not None:
            self._new_epoch(problem)
            return None
        try:
            manager = PartitionCoordinator.load(state["partitions"], spec, ids=ids)
        except Exception as exc:
            self._new_epoch(f"its block manager cannot be restored ({type(exc).__name__}: "
                            f"{exc})")
            return None
        self.generation = state["generation"]
        return Saved(manager, state["epoch"], state["sessions"], state.get("revoked", {}))

    def _new_epoch(self, problem: str) -> None:
        if self.store is not None:
            log.warning("not recovering: starting a new epoch",
                        extra=logs.fields(state_dir=self.store.dir, reason=problem))
            self.store.wipe()

    # -- replay --------------------------------------------------------------------------------

    def replay(self, m: KVManager, sessions: Sessions, ids: SequenceIds, *, epoch: int,
               errors: Counter[str], tier_io: TierIOReplay) -> int:
        """Apply the journal written after the snapshot; returns the number of records.
        ``tier_io(session_id, failed)`` is called before each Step with the numbers of its
        tier copies that failed when it was first applied (``blockd.core.tier_io``)."""
        if self.store is None:
            return 0
        path = self.store.journal_path(self.generation)
        found = scan(path)
        damage = found.damage
        if damage is not None and damage.kind == "corrupt":
            self.journal_damage["corrupt"] += 1
            raise JournalCorrupt(path, f"{damage.describe()}; {len(found.records)} intact "
                                       "records before it")
        if damage is not None:
            # A write cut short by the daemon's death: never acknowledged (journal.py).
            self.journal_damage["torn"] += 1
            log.warning("dropped a torn final journal record (its change was never "
                        "acknowledged)", extra=logs.fields(journal=path, offset=damage.offset,
                                                          bytes=damage.bytes_lost))
        for record in found.records:
            _apply(record, m, sessions, ids, epoch, errors, tier_io)
        return len(found.records)

    # -- space ---------------------------------------------------------------------------------

    def free_bytes(self) -> int | None:
        """Bytes an unprivileged writer may still use in ``state.dir`` (None without it)."""
        if self.store is None:
            return None
        st = os.statvfs(self.store.dir)
        return st.f_bavail * st.f_frsize

    @property
    def reserve(self) -> int:
        """Free bytes new work may not use: ``state.reserve_bytes`` plus room for a snapshot."""
        return self.reserve_bytes + self._snapshot_bytes

    @property
    def margin(self) -> int:
        """Journal room kept above the reserve: a compaction starts when less is free
        (``due``), so one tenant's journal cannot bring every tenant to "state dir full". A
        snapshot's size (at least ``MIN_MARGIN``): compactions then cost O(1) per byte."""
        return max(self._snapshot_bytes, MIN_MARGIN)

    def check_room(self) -> None:
        """At start, after the first snapshot: refuse a state directory that cannot hold what
        its files may still take (the pool's and fence pages' pages not yet touched, on a
        tmpfs), the reserve (``state.reserve_bytes`` plus a snapshot) and ``margin`` of
        journal; it would refuse every Step "state dir full" once the journal or the pool
        grew."""
        free = self.free_bytes()
        if free is None or self.store is None:
            return
        unwritten = _unwritten_bytes(self.store.dir)
        need = self.reserve + self.margin + unwritten
        if free < need:
            raise StateDirTooSmall(
                f"state.dir: {self.store.dir} has {free} bytes free, it needs {need}: "
                f"state.reserve_bytes ({self.reserve_bytes}) + a snapshot "
                f"({self._snapshot_bytes}) + journal room ({self.margin}) + what the pool "
                f"files may still take ({unwritten}); give it more room or lower "
                "state.reserve_bytes", field="state.dir")

    def require_space(self, record_bytes: int) -> None:
        """Before new work is applied: refuse it while its record would eat into the reserve,
        and refuse everything once a journal write has failed."""
        if self.failed is not None:
            raise Unavailable(f"the journal cannot be written ({self.failed}): the daemon "
                              "must be restarted")
        free = self.free_bytes()
        if free is None:
            return
        needed = self.reserve + record_bytes + OVERHEAD
        if free < needed:
            self.space_refusals += 1
            raise ResourceExhausted(
                f"state dir full: {free} bytes free in {self.store.dir if self.store else ''}, "
                f"new work needs {needed} (state.reserve_bytes plus a snapshot)",
                reason="state_dir", field="state.dir")

    # -- recording -----------------------------------------------------------------------------

    def record(self, record: Record) -> None:
        """Journal one applied change (no-op without ``state.dir`` and during a replay).

        A failed write raises UNAVAILABLE and marks the journal failed: the change is in
        memory but not in the journal, so nothing after it may be acknowledged (every later
        ``record`` and ``require_space`` refuses) until a restart replays the journal.
        """
        if self.failed is not None:
            raise Unavailable(f"the journal cannot be written ({self.failed}): the daemon "
                              "must be restarted")
        journal = self.journal
        if journal is None:
            return
        try:
            journal.append(record.to_record())
        except OSError as exc:
            self.failed = f"{exc.strerror or exc} writing {journal.path}"
            log.error("journal write failed: refusing every call until restarted (nothing "
                      "unjournalled was acknowledged)",
                      extra=logs.fields(journal=journal.path, record=record.kind,
                                        error=exc.strerror or str(exc)))
            raise Unavailable(f"the journal cannot be written ({self.failed}): the daemon "
                              "must be restarted") from None

    def record_step(self, session_id: str, req: pb.StepRequest, resp: pb.StepResponse,
                    minted: list[str], io_failures: tuple[int, ...] = (), *,
                    tenant_id: str = "") -> int:
        """Journal what a Step applied (``step.journal_record``), with the numbers of its tier
        copies that failed; the bytes written (0 without a journal), counted for
        ``tenant_id``."""
        journal = self.journal
        if journal is None:
            return 0
        raw, failed = step.journal_record(req, resp)
        before = journal.size
        self.record(StepRecord(session_id, raw, tuple(minted), tuple(sorted(failed.items())),
                               io_failures))
        written = journal.size - before
        self.tenant_journal_bytes[tenant_id] += written
        return written

    @property
    def due(self) -> bool:
        """The journal has grown enough that a snapshot (a compaction) is worth its cost, or
        free space is within ``margin`` of the reserve and the journal holds half of it (so
        a compaction gives back at least that: O(1) per journalled byte still). Before the
        second rule one tenant's admit+release cycles grew the journal until every tenant's
        Step was refused "state dir full", ``snapshot_min_bytes`` never reached."""
        journal = self.journal
        if journal is None:
            return False
        if journal.size >= max(self.snapshot_min_bytes, 2 * self._snapshot_bytes):
            return True
        if journal.size < self.margin // 2:
            return False
        free = self.free_bytes()
        return free is not None and free < self.reserve + self.margin

    def snapshot(self, parts: PartitionCoordinator, sessions: Sessions, spec: PoolSpec, epoch: int
                 ) -> None:
        """Write a snapshot of everything, then start the next journal generation.

        A snapshot that cannot be written (``OSError``, e.g. a full state directory) changes
        nothing: the previous snapshot and the current journal stay the truth; the caller
        decides (a live daemon defers the compaction, a starting one refuses to start)."""
        store = self.store
        if store is None:
            return
        t0 = time.perf_counter()
        state = {
            "version": SNAPSHOT_VERSION, "manager_format": snapshot.FORMAT_VERSION,
            "spec": dataclasses.asdict(spec), "epoch": epoch,
            "generation": self.generation + 1, "partitions": parts.dump(),
            "layout": dict(parts.layout), "tiers": _tiers(parts.tiers),
            "sessions": sessions.saved(), "revoked": sessions.saved_revoked(),
        }
        self._snapshot_bytes = store.write_snapshot(state)
        self.generation += 1
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        try:
            self.journal = Journal(store.journal_path(self.generation))
        except OSError as exc:  # the snapshot holds everything so far: only new work is refused
            self.failed = f"{exc.strerror or exc} opening {store.journal_path(self.generation)}"
            raise
        store.remove_journals(keep=self.generation)
        self.snapshots += 1
        self.last_snapshot_seconds = time.perf_counter() - t0
        log.debug("snapshot written", extra=logs.fields(
            generation=self.generation, bytes=self._snapshot_bytes,
            seconds=round(self.last_snapshot_seconds, 4)))

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.store is not None:
            self.store.close()


def _unwritten_bytes(directory: os.PathLike[str] | str) -> int:
    """Bytes the files in ``directory`` may still take: their sizes less what is allocated
    (a pool file or fence page on a tmpfs takes its pages as they are touched)."""
    total = 0
    with os.scandir(directory) as entries:
        for e in entries:
            if e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                total += max(0, st.st_size - st.st_blocks * 512)
    return total


def _tiers(tiers: dict[str, TierLimits]) -> dict[str, dict[str, int]]:
    return {name: dataclasses.asdict(limits) for name, limits in tiers.items()}


def _problem(state: object, spec: PoolSpec, layout: dict[str, int],
             tiers: dict[str, TierLimits], store: StateStore) -> str | None:
    """Why a readable snapshot cannot be carried on from, or None."""
    if not isinstance(state, dict):
        return f"the snapshot holds a {type(state).__name__}, not a state dict"
    if state.get("version") != SNAPSHOT_VERSION:
        return (f"snapshot version {state.get('version')!r} (this daemon reads "
                f"{SNAPSHOT_VERSION})")
    if state.get("manager_format") != snapshot.FORMAT_VERSION:
        return f"core snapshot format {state.get('manager_format')!r}"
    if state["spec"] != dataclasses.asdict(spec):
        return f"the pool was {state['spec']}, the configuration says {spec}"
    if state.get("layout") != layout:
        return f"the partitions were {state.get('layout')}, the tenants file says {layout}"
    if state.get("tiers") != _tiers(tiers):
        return f"the lower tiers were {state.get('tiers')}, the configuration says {_tiers(tiers)}"
    for name in layout:
        if not os.path.exists(partition_path(store.dir, name, store.pool_path)):
            return f"the pool file of partition {name!r} is gone"
    return None


def _apply(raw: list[Any], m: KVManager, sessions: Sessions, ids: SequenceIds,
           epoch: int, errors: Counter[str], tier_io: TierIOReplay) -> None:
    record = from_record(raw)
    if isinstance(record, StepRecord):
        info = _session(sessions, record)
        tier_io(record.session_id, record.io_failures)
        with ids.replaying(list(record.minted)):
            step.apply_step(m, sessions, info, pb.StepRequest.FromString(record.request),
                            epoch=epoch, limits=None, errors=errors,
                            failed=record.failed_statuses())
    elif isinstance(record, FenceRecord):
        m.complete_fence(record.session_id, record.completed_fence)
    elif isinstance(record, AttachRecord):
        sessions.open(record.session_id, record.tenant_id, record.owner, record.worker_name,
                      record.lease_ms)
    elif isinstance(record, DetachRecord):
        sessions.detach(_session(sessions, record), record.reason, poll_fence=False)
    elif isinstance(record, FlushRecord):
        m.flush(**record.filters())
    elif isinstance(record, RevokeRecord):
        sessions.revoke(_session(sessions, record), record.reason)
    elif isinstance(record, AdoptRecord):
        tier_io("", record.io_failures, tenant_id=record.tenant_id)
        m.adopt_remote(record.tenant_id, record.scope, record.tokens, record.start,
                       record.count)
    else:
        m.set_tenants(record.policies)


def _session(sessions: Sessions, record: StepRecord | DetachRecord | RevokeRecord
             ) -> SessionInfo:
    info = sessions.find(record.session_id)
    if info is None:
        raise ValueError(f"journal: a {record.kind} of unknown session {record.session_id!r}")
    return info
