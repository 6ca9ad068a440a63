"""What the scheduler side tells the workers each step (vLLM pickles it to them).

``loads`` are copies blockd -> vLLM to finish before attention reads the blocks; ``saves`` are
copies vLLM -> blockd of blocks this step completes. ``fence`` is the scheduler session's
latest fence: the worker publishes it into that session's fence page once this step's copies
are done (``Session.complete_on_stream``'s page: in the stream's order on CUDA), which makes
the step's commits hittable and lets its releases' blocks be reused, never earlier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # the data path (worker, layout) runs on GPU machines without vLLM
    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's marker base class, when vLLM is not installed."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's marker base class, when vLLM is not installed."""


@dataclass
class PoolRef:
    """Which session's pool and fence page the worker maps (it changes with the epoch)."""

    session_id: str
    epoch: int
    handle_socket: str
    #: Bumped when blockd came back after an outage: the worker fetches the handles again (a
    #: restarted daemon may have given the same session a new fence page).
    generation: int = 0
    #: The session's ``AttachResponse.fetch_secret``, which the handle socket asks for with the
    #: session id (never in a repr: the worker logs refs).
    fetch_secret: str = field(repr=False, kw_only=True)


@dataclass
class BlockdMetadata(KVConnectorMetadata):
    pool: PoolRef | None = None
    #: The scheduler side's step number: the worker reports its saves done by it.
    step: int = 0
    fence: int = 0
    #: (vLLM block, blockd block) pairs to load this step.
    load_vllm: list[int] = field(default_factory=list)
    load_blockd: list[int] = field(default_factory=list)
    #: The session whose pool each load's blockd block belongs to (after an epoch change, loads
    #: promised in the old epoch come from the old mapping, or are recomputed).
    load_session: list[str] = field(default_factory=list)
    #: (vLLM block, blockd block) pairs to save once this step computed them.
    save_vllm: list[int] = field(default_factory=list)
    save_blockd: list[int] = field(default_factory=list)
    #: Requests that ended and whose vLLM blocks vLLM kept for this step's saves: the worker
    #: reports them in ``finished_sending`` once the saves ran (vLLM frees the blocks then).
    sent: list[str] = field(default_factory=list)
    #: Requests answered ``(n, True)`` whose loads (in ``load_*``) are all of this step: the
    #: worker reports them in ``finished_recving`` once they ran.
    recv: list[str] = field(default_factory=list)
    #: vLLM blocks promised to such a request that blockd does not hold (the fetch missed or
    #: failed): reported as load errors, vLLM recomputes them.
    load_failed: list[int] = field(default_factory=list)
    #: vLLM preempted a request while saves were in flight: the worker lets its copy thread
    #: finish them before this step writes anything (``handle_preemptions``).
    drain: bool = False

    def has_work(self) -> bool:
        return bool(self.load_vllm or self.save_vllm)


@dataclass
class SaveReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the steps whose saves are done (``ok``) or did not happen
    (``failed``). Only blocks a worker reported saved are ever committed: a save that failed
    can never make another request hit bytes that were not written."""

    ok: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    #: The last numbered step this worker finished (its copies are done).
    done: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SaveReport:
        assert isinstance(other, SaveReport)
        # Every worker must have saved its share for a step to count as saved.
        return SaveReport(ok=self.ok & other.ok, failed=self.failed | other.failed
                          | (self.ok ^ other.ok), done=min(self.done, other.done))
